"""Start-up shared by the example jobs: the distributed init, also for one process without a launcher.

The examples put this folder on ``sys.path`` and import it as ``_launch``; it is not part of the dsx package.
"""

from __future__ import annotations

import deepspeed
import torch
import torch.distributed as dist

from dsx.ops import announce_comm_build
from dsx.runtime.process import single_process_env

__all__ = ["init_distributed"]


def init_distributed(local_rank: int) -> tuple[int, int]:
    """Join the process group (NCCL on GPUs, gloo on CPU ranks) and pick this rank's GPU; (rank, world)."""
    single_process_env()
    announce_comm_build()  # DeepSpeed compiles its CPU all-reduce op here on a first CPU run
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size()
