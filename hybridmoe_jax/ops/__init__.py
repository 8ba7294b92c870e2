"""Numerical ops: pure functions of jax arrays (references, chunked XLA forms, dispatchers).

Importable with jax alone (no flax, grain or ml_collections).
"""

from .decay import bounded_log_decay
from .decay import unbounded_log_decay
from .glu import situ_glu
from .glu import swiglu
