"""Pallas interpret-mode tests compile without the suite's persistent compilation cache: jax
0.10.2 segfaulted serialising some interpret-mode bf16 kernel programs into it
(`compilation_cache.put_executable_and_time`, twice in full-suite runs under load), and
these programs are not shared across workers anyway."""

import jax
from jax._src import compilation_cache  # reset_cache: is_cache_used memoises its answer
import pytest


@pytest.fixture(autouse=True)
def _no_persistent_cache():
  old = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  yield
  jax.config.update("jax_enable_compilation_cache", old)
  compilation_cache.reset_cache()
