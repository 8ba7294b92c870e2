"""Training: config sections, train state, jitted steps, checkpoints, monitoring, the run.

Import the modules themselves (`train.loop.train_and_evaluate`, `train.state`, ...):
importing this package pulls in nothing, so the CLIs' flag checks stay free of flax, optax
and orbax.
"""
