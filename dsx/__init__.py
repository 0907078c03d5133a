"""dsx: a DeepSpeed-integrated training engine for workloads limited by data movement.

Public API only; everything else is reached through its subpackage (``dsx.offload``, ``dsx.direct``,
``dsx.rgnn``, ``dsx.runtime``, ``dsx.data``, ``dsx.models``). ``dsx.defaults`` holds the process defaults of the
config sections (what a feature reads without an engine).
"""

from dsx.config import (
    ActivationOffloadConfig,
    DsxConfig,
    DsxConfigError,
    RGNNConfig,
    SchedulerConfig,
    UnifiedConfig,
)

# DeepSpeed and torch are imported on first use of these names, not by ``import dsx``: ``dsx report`` must be
# able to set DS_ACCELERATOR before DeepSpeed's import-time accelerator probe (which otherwise prints its
# "Setting accelerator to CPU" warning to stdout, breaking ``dsx report --json`` on CPU machines).
_LAZY = {
    "defaults": None,  # the module itself
    "DsxRuntime": "dsx.engine",
    "initialize": "dsx.engine",
    "runtime_of": "dsx.engine",
    "UnifiedTensor": "dsx.direct",
    "unified": "dsx.direct",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module = _LAZY[name]
        value = importlib.import_module(f"dsx.{name}") if module is None else getattr(
            importlib.import_module(module), name)  # fmt: skip
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dsx' has no attribute {name!r}")


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
    "defaults",
    "initialize",
    "runtime_of",
    "unified",
]
