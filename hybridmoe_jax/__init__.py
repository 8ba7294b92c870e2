"""hybridmoe_jax: hybrid KDA/MLA sparse-MoE multimodal LLMs in JAX/Flax NNX."""

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.config import ModelConfig
from hybridmoe_jax.config import model_config_from_dict
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.model import count_params
