"""hybridmoe_jax: hybrid KDA/MLA sparse-MoE LLMs in JAX."""
