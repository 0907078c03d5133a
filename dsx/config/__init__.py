"""The ``"dsx"`` section of a DeepSpeed JSON config: pydantic models, their checks, errors a user can act on.

Every section is off unless it says ``"enabled": true``; a config without a ``"dsx"`` section behaves exactly
as DeepSpeed. Unknown keys, wrong types and out-of-range values fail at start-up with a
:class:`DsxConfigError` that names the key path (``dsx.activation_offload.tiers[1]``), the value given and
what is allowed.
"""

from dsx.config.checks import MAX_GB
from dsx.config.errors import DSX_KEY, DsxConfigError
from dsx.config.load import load_deepspeed_config, parse_dsx_config, split_config
from dsx.config.sections import ActivationOffloadConfig, DsxConfig, RGNNConfig, SchedulerConfig, UnifiedConfig

__all__ = [
    "DSX_KEY",
    "MAX_GB",
    "ActivationOffloadConfig",
    "DsxConfig",
    "DsxConfigError",
    "RGNNConfig",
    "SchedulerConfig",
    "UnifiedConfig",
    "load_deepspeed_config",
    "parse_dsx_config",
    "split_config",
]
