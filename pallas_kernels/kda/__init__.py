"""KDA (Kimi Delta Attention) as Pallas kernels: TPU (Mosaic) and GPU (Triton)."""

from .api import kda_pallas
from .config import GpuConfig, TpuConfig, check_domain_dims

__all__ = ["GpuConfig", "TpuConfig", "check_domain_dims", "kda_pallas"]
