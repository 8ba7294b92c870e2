"""Inference: per-layer decode caches, chunked prefill, cached decode and sampling."""

from hybridmoe_jax.infer.cache import DecodeCache
from hybridmoe_jax.infer.cache import KDACache
from hybridmoe_jax.infer.cache import MLACache
from hybridmoe_jax.infer.cache import cache_bytes
from hybridmoe_jax.infer.cache import init_cache
from hybridmoe_jax.infer.cache import mla_bytes_per_token
from hybridmoe_jax.infer.engine import TRACE_COUNTS
from hybridmoe_jax.infer.engine import Engine
from hybridmoe_jax.infer.engine import GenerateOutput
from hybridmoe_jax.infer.engine import decode_step
from hybridmoe_jax.infer.engine import generate
from hybridmoe_jax.infer.engine import prefill
from hybridmoe_jax.infer.sampling import SamplingConfig
from hybridmoe_jax.infer.sampling import sample
