"""MLA attention: `api.py` (the entries and the one implementation table), `reference.py`
(the input contract and the exact reference), one file per core: `dense.py`, `blockwise.py`
(XLA), `cudnn.py`, `triton.py`, `splash.py` (kernels), `absorbed.py` (the latent decode)."""
