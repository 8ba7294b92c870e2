"""KDA: the op (`api.kda`, its dispatch table `api.choose`) over its implementations."""

from .api import PALLAS_BACKENDS, Impl, choose, kda

__all__ = ["PALLAS_BACKENDS", "Impl", "choose", "kda"]
