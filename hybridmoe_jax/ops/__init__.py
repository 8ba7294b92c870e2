"""Numerical ops: pure functions of jax arrays (references, chunked XLA forms, dispatchers).

Importable with jax alone (no flax, grain or ml_collections).
"""

from .attention.dense import causal_attention
from .decay import bounded_log_decay
from .decay import unbounded_log_decay
from .glu import situ_glu
from .glu import swiglu
from .quantile_balance import bias_from_histogram
from .quantile_balance import qb_histogram
from .quantile_balance import quantile_balance
from .quantile_balance import sign_rule_update
from .routing import max_violation
from .routing import sigmoid_topk_route
