"""Training: config sections, train state, jitted steps, checkpoints, monitoring, the loop."""

from hybridmoe_jax.train.config import default_config
from hybridmoe_jax.train.loop import train_and_evaluate
from hybridmoe_jax.train.state import TrainState
