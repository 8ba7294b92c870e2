"""KDA: the op (`api.kda`) over its implementations (`api.TABLE`, picked by `api.choose`)."""

from .api import TABLE, choose, kda

__all__ = ["TABLE", "choose", "kda"]
