"""strictnorm: RMSNorm-family kernels whose results are the same bits on every backend.

See docs/contract.md for the numerics and README.md for usage.
"""

from .api import fused_add_rms_norm, qk_norm, reduce_rows_left_fold, rms_norm, rms_norm_with_rstd
from .backends.registry import BackendUnavailable
from .contract import StrictNormError
from .nn import FusedAddRMSNorm, GemmaFusedAddRMSNorm, GemmaQKNorm, GemmaRMSNorm, QKNorm, RMSNorm

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "FusedAddRMSNorm",
    "GemmaFusedAddRMSNorm",
    "GemmaQKNorm",
    "GemmaRMSNorm",
    "QKNorm",
    "RMSNorm",
    "StrictNormError",
    "fused_add_rms_norm",
    "qk_norm",
    "reduce_rows_left_fold",
    "rms_norm",
    "rms_norm_with_rstd",
]
