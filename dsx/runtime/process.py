"""Process lifetime: liveness of other ranks' processes, and a clean distributed exit."""

from __future__ import annotations

import os

__all__ = ["exit_distributed", "pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this machine (signal 0; a process we may not signal still counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_distributed() -> None:
    """Wait for every rank, then tear the process group down before the interpreter exits.

    A rank that leaves while a peer still runs collectives (rank 0 writing its log, say) lets gloo's
    background threads be destroyed un-joined at exit, which aborts the process ("terminate called
    without an active exception", exit -6) and fails the launcher. Entry points call this last.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
