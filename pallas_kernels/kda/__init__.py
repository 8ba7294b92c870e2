"""KDA (Kimi Delta Attention) as Pallas kernels: TPU (Mosaic) and GPU (Triton)."""

from .api import check_domain, check_domain_dims, kda_pallas
from .config import GpuConfig, TpuConfig
from .reference import kda_reference

__all__ = ["GpuConfig", "TpuConfig", "check_domain", "check_domain_dims", "kda_pallas", "kda_reference"]
