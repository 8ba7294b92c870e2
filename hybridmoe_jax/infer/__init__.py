"""Inference: chunked prefill, cached decode, scoring and sampling over the model's caches."""

from hybridmoe_jax.infer.context_engine import ContextParallelEngine
from hybridmoe_jax.infer.engine import Engine
from hybridmoe_jax.infer.steps import trace_counts
from hybridmoe_jax.infer.sampling import SamplingConfig
from hybridmoe_jax.model.cache import KDACache
from hybridmoe_jax.model.cache import MLACache
from hybridmoe_jax.model.cache import cache_bytes
from hybridmoe_jax.model.cache import init_cache
from hybridmoe_jax.model.cache import mla_bytes_per_token
