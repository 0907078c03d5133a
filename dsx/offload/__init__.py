"""Activation offload (SSDTrain in dsx): saved activations leave the device in forward, return in backward.

:class:`ActivationOffload` works on a bare ``nn.Module`` (call :meth:`ActivationOffload.end_step` after each
optimizer step); :func:`dsx.initialize` attaches it to a DeepSpeed engine (:mod:`dsx.offload.deepspeed`).
The planner is :mod:`dsx.offload.plan`.
"""

from dsx.offload.calibration import MAX_CALIBRATIONS
from dsx.offload.checkpointing import check_model, find_layers
from dsx.offload.controller import ActivationOffload
from dsx.offload.entry import OffloadIntegrityError
from dsx.offload.io import describe_backends, select_backend
from dsx.offload.plan import Action, LayerProfile, Plan, PlanError, make_plan
from dsx.offload.saved import tensors_of

__all__ = [
    "MAX_CALIBRATIONS",
    "Action",
    "ActivationOffload",
    "LayerProfile",
    "OffloadIntegrityError",
    "Plan",
    "PlanError",
    "check_model",
    "describe_backends",
    "find_layers",
    "make_plan",
    "select_backend",
    "tensors_of",
]
