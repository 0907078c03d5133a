"""One line before a first-run op build: what is compiled, why the start waits, how long, where it lands.

DeepSpeed JIT-compiles some of its ops (and dsx its gather kernel) with ninja the first time a job needs them
and caches the result in torch's extension directory; until then the job sits silently at start-up. This
module tells, from a DeepSpeed config, which ops the job is about to build and says so once per machine
(local rank 0) when they are not in the cache yet. Nothing is printed when every op is cached or prebuilt.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

from dsx.ops.aio import async_io_status
from dsx.ops.cache import build_lock, extensions_root, is_cached

__all__ = [
    "OpBuild",
    "announce",
    "announce_builds",
    "announce_comm_build",
    "op_build",
    "pending_builds",
]


@dataclass(frozen=True)
class OpBuild:
    """An op a job builds on first use: its extension name (the cache folder), the reason, a rough time."""

    name: str
    why: str
    seconds: int  # rough compile time on a small machine; only used to tell the user how long to wait


# Rough one-time compile times on a few-core machine: enough to say "a minute" or "a few minutes" honestly.
_COMPILE_S = {
    "cpu_adam": 60,
    "cpu_adagrad": 60,
    "cpu_lion": 60,
    "async_io": 90,
    "deepspeed_shm_comm": 45,
    "dsx_unified_gather": 60,
}

GATHER_OP = "dsx_unified_gather"  # UnifiedGatherBuilder.NAME, without importing DeepSpeed's builders here

_announced: set[str] = set()  # ops already named in this process: one line per op and process at most

# A build lock older than this is named in the notice: no build of these ops takes that long on a small machine.
STALE_LOCK_S = 600.0


def _device(section: Any) -> str:
    return str(section.get("device") or "none").lower() if isinstance(section, Mapping) else "none"


def op_build(name: str, why: str) -> OpBuild:
    """``name`` built for ``why``, with its rough compile time."""
    return OpBuild(name, why, _COMPILE_S.get(name, 60))


def _optimizer_op(ds_config: Mapping[str, Any]) -> str | None:
    """The CPU optimizer op DeepSpeed builds when it offloads the optimizer (its ``optimizer.type``)."""
    opt = ds_config.get("optimizer")
    if not isinstance(opt, Mapping):
        return None  # a client optimizer: DeepSpeed keeps it and builds nothing
    kind = str(opt.get("type", "")).lower()
    params = opt.get("params") if isinstance(opt.get("params"), Mapping) else {}
    if kind in ("adam", "adamw"):
        return None if params.get("torch_adam") else "cpu_adam"
    return {"adagrad": "cpu_adagrad", "lion": "cpu_lion"}.get(kind)


def _async_io_compatible() -> bool:
    return async_io_status()[0]


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _dist_initialized() -> bool:
    try:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()
    except ImportError:
        return False


def pending_builds(ds_config: Mapping[str, Any]) -> list[OpBuild]:
    """The ops a job with this DeepSpeed config (``"dsx"`` section included) builds because they are not cached.

    - ZeRO optimizer offload (cpu or nvme): the CPU optimizer (``cpu_adam`` for Adam/AdamW);
    - ZeRO-3 offload of the optimizer or parameters to nvme: ``async_io`` (stages 1 and 2 treat nvme as cpu);
    - dsx activation offload to the ssd tier through DeepSpeed's aio backend: ``async_io``;
    - dsx unified tensors on a GPU: dsx's gather kernel;
    - the CPU accelerator, before the process group exists: DeepSpeed's shared-memory all-reduce op.
    """
    zero = ds_config.get("zero_optimization") or {}
    zero = zero if isinstance(zero, Mapping) else {}
    stage = int(zero.get("stage", 0) or 0)
    opt_dev, param_dev = _device(zero.get("offload_optimizer")), _device(zero.get("offload_param"))
    dsx_section = ds_config.get("dsx") or {}
    dsx_section = dsx_section if isinstance(dsx_section, Mapping) else {}

    wanted: dict[str, str] = {}  # op name -> why; the first reason wins
    if opt_dev in ("cpu", "nvme") and (op := _optimizer_op(ds_config)) is not None:
        wanted.setdefault(op, f"ZeRO offload_optimizer to {opt_dev}")
    if stage == 3 and "nvme" in (opt_dev, param_dev):
        what = "offload_optimizer" if opt_dev == "nvme" else "offload_param"
        wanted.setdefault("async_io", f"ZeRO-3 {what} to nvme")
    act = dsx_section.get("activation_offload") or {}
    if isinstance(act, Mapping) and act.get("enabled") and "ssd" in (act.get("tiers") or []):
        backend = act.get("io_backend", "auto")
        if backend == "aio" or (backend == "auto" and _async_io_compatible()):
            wanted.setdefault("async_io", "dsx activation offload to ssd")
    uni = dsx_section.get("unified") or {}
    if isinstance(uni, Mapping) and uni.get("enabled") and uni.get("backend", "auto") != "torch" and _cuda():
        wanted.setdefault(GATHER_OP, "dsx unified-tensor gathers")
    if not _dist_initialized() and not _cuda() and os.environ.get("DS_ACCELERATOR", "cpu") == "cpu":
        wanted.setdefault("deepspeed_shm_comm", "DeepSpeed's CPU all-reduce")
    return [op_build(name, why) for name, why in wanted.items() if not is_cached(name)]


def _about(seconds: int) -> str:
    return f"about {max(1, round(seconds / 60))} min" if seconds >= 90 else "up to a minute"


def announce(builds: Iterable[OpBuild], stream: TextIO | None = None) -> str | None:
    """Print one line naming ``builds`` (those not named before in this process) on local rank 0; return it.

    Returns the line on every rank (None when there is nothing to say), so callers and tests can see it.
    """
    todo = [b for b in builds if b.name not in _announced]
    if not todo:
        return None
    _announced.update(b.name for b in todo)
    ops = ", ".join(f"{b.name} (for {b.why})" for b in todo)
    line = (
        f"dsx: first run: compiling {ops}; the start waits {_about(sum(b.seconds for b in todo))} "
        f"this once, later runs load the build from {extensions_root()}"
    )
    for b in todo:
        lock = build_lock(b.name)
        if lock is not None and lock[1] >= STALE_LOCK_S:
            line += (
                f". {b.name}'s build lock {lock[0]} is {lock[1] / 60:.0f} min old: a build that died leaves it, "
                "and the start then waits on it forever; if no build of that op runs on this machine, remove it"
            )
    if os.environ.get("LOCAL_RANK", "0") in ("", "0"):  # the ranks of a machine share the cache
        print(line, file=stream or sys.stderr, flush=True)
    return line


def announce_builds(ds_config: Mapping[str, Any], stream: TextIO | None = None) -> str | None:
    """Announce, in one line, the ops this DeepSpeed config makes the job compile now (see :func:`pending_builds`)."""
    return announce(pending_builds(ds_config), stream)


def announce_comm_build(stream: TextIO | None = None) -> str | None:
    """Before ``deepspeed.init_distributed`` on the CPU accelerator: announce its all-reduce op if not cached."""
    return announce(pending_builds({}), stream)
