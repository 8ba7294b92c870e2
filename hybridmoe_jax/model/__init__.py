"""The hybrid decoder model and its parameter counting (routing-bias updates: layers.balancing)."""

from hybridmoe_jax.model.count import count_params, param_breakdown
from hybridmoe_jax.model.decoder import HybridLM
