"""Evaluations: perplexity / bits per byte, passkey NIAH, MQAR, generation (models load
through `hybridmoe_jax.loading`)."""

from hybridmoe_jax.evals.runner import EvalOptions
from hybridmoe_jax.evals.runner import run_evals
