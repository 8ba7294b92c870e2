"""Numerical ops: references, chunked XLA forms and dispatchers."""

from .decay import bounded_log_decay
from .decay import unbounded_log_decay
from .kda import kda
from .kda_chunked import kda_chunked
from .kda_recurrent import kda_recurrent
