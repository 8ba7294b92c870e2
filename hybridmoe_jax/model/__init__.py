"""The hybrid decoder model, its parameter counting and routing-bias updates."""

from hybridmoe_jax.model.count import count_params
from hybridmoe_jax.model.count import param_breakdown
from hybridmoe_jax.model.decoder import HybridLM
from hybridmoe_jax.model.balancing import update_routing_biases
