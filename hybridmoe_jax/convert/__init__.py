"""Hugging Face Kimi-Linear interop: config and weight mapping, streaming conversion both
ways (`python -m hybridmoe_jax.convert`). It imports numpy only; loading an HF dir as a
model is `hybridmoe_jax.loading.load_hf_model`.
"""
