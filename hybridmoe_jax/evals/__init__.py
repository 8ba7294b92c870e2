"""Evaluations: perplexity / bits per byte, passkey NIAH, MQAR, generation; model loading."""

from hybridmoe_jax.evals.loading import load_model
from hybridmoe_jax.evals.runner import TASKS
from hybridmoe_jax.evals.runner import EvalOptions
from hybridmoe_jax.evals.runner import resolve_tasks
from hybridmoe_jax.evals.runner import run_evals
