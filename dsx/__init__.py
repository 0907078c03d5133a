"""dsx: a DeepSpeed-integrated training engine for workloads limited by data movement.

Public API only; everything else is reached through its subpackage (``dsx.offload``, ``dsx.direct``,
``dsx.rgnn``, ``dsx.runtime``, ``dsx.data``).
"""

from dsx.config import (
    ActivationOffloadConfig,
    DsxConfig,
    DsxConfigError,
    RGNNConfig,
    SchedulerConfig,
    UnifiedConfig,
)
from dsx.direct import UnifiedTensor, unified
from dsx.engine import DsxRuntime, initialize, runtime_of

__version__ = "0.1.0"

__all__ = [
    "ActivationOffloadConfig",
    "DsxConfig",
    "DsxConfigError",
    "DsxRuntime",
    "RGNNConfig",
    "SchedulerConfig",
    "UnifiedConfig",
    "UnifiedTensor",
    "__version__",
    "initialize",
    "runtime_of",
    "unified",
]
