"""Hugging Face Kimi-Linear interop: config and weight mapping, streaming conversion both
ways (`python -m hybridmoe_jax.convert`), and `load_hf_model` (an HF dir -> HybridLM).

The converter itself (`convert`, `hf_config`, `hf_weights`) imports numpy only; loading a
model (`load_hf_model`) imports jax and flax when first used.
"""


def load_hf_model(path, compute=None):
  """A Kimi-Linear HF dir -> (HybridLM, info dict); see `convert.loading.load_hf_model`."""
  from hybridmoe_jax.convert.loading import load_hf_model as load  # pylint: disable=import-outside-toplevel
  return load(path, compute)
