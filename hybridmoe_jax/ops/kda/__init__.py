"""KDA: the op (`api.kda`) over its implementations (`api.TABLE`, picked by `api.choose`)."""

from .api import TABLE, Choice, Impl, choose, kda

__all__ = ["TABLE", "Choice", "Impl", "choose", "kda"]
