"""Start-up shared by the example jobs: the distributed init, also for one process without a launcher.

The examples put this folder on ``sys.path`` and import it as ``_launch``; it is not part of the dsx package.
"""

from __future__ import annotations

import contextlib
import hashlib

import deepspeed
import torch
import torch.distributed as dist

from dsx.ops import announce_comm_build
from dsx.runtime.process import single_process_env

__all__ = ["all_sum", "init_distributed", "param_digest"]


def init_distributed(local_rank: int) -> tuple[int, int]:
    """Join the process group (NCCL on GPUs, gloo on CPU ranks) and pick this rank's GPU; (rank, world)."""
    single_process_env()
    announce_comm_build()  # DeepSpeed compiles its CPU all-reduce op here on a first CPU run
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size()


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks in place (a collective), or ``t`` itself in one process."""
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def param_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the model's parameters (names and bytes, in order): equal only when training was bitwise
    equal. A collective under ZeRO-3 (every rank gathers its partitioned parameters)."""
    params = list(model.named_parameters())
    gather = any(hasattr(p, "ds_id") for _, p in params)  # ZeRO-3 keeps only a partition on each rank
    ctx = deepspeed.zero.GatheredParameters([p for _, p in params]) if gather else contextlib.nullcontext()
    h = hashlib.sha256()
    with ctx, torch.no_grad():
        for name, p in params:
            h.update(name.encode())
            h.update(p.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
