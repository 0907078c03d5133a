"""``dsx build-ops --config``: build ahead of time every op a job with that DeepSpeed config would compile at its
start (DeepSpeed's CPU optimizer and ``async_io``, its CPU all-reduce, dsx's gather kernel), so that the job's
first start does not wait minutes, or run out of a scheduler's time limit, while ninja compiles.

The ops land in torch's extension cache (``TORCH_EXTENSIONS_DIR``) as a first job would leave them; an op already
there is not built again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsx.ops.aio import async_io_status
from dsx.ops.notice import GATHER_OP, announce, pending_builds

__all__ = ["build_for_config", "read_ds_config"]

# DeepSpeed's builder class for each op name pending_builds can give (DeepSpeed's accelerator picks the
# implementation: CUDA, or CPU under DS_ACCELERATOR=cpu)
_DS_BUILDERS = {
    "cpu_adam": "CPUAdamBuilder",
    "cpu_adagrad": "CPUAdagradBuilder",
    "cpu_lion": "CPULionBuilder",
    "async_io": "AsyncIOBuilder",
    "deepspeed_shm_comm": "ShareMemCommBuilder",
}


def read_ds_config(path: str | Path) -> dict[str, Any]:
    """The DeepSpeed config at ``path``; ``ValueError`` naming the file when it is missing or not a JSON object."""
    p = Path(path)
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"no DeepSpeed config at {p}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"the DeepSpeed config {p} is not valid JSON: {exc}") from None
    except OSError as exc:  # a directory, no permission
        raise ValueError(f"cannot read the DeepSpeed config {p}: {exc.strerror or exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"the DeepSpeed config {p} holds a JSON {type(cfg).__name__}, not an object")
    return cfg


def build_for_config(ds_config: Mapping[str, Any], verbose: bool = True) -> list[str]:
    """Build the ops a job with ``ds_config`` would build on first use and are not cached yet; their names.

    Raises ``RuntimeError`` naming the op when DeepSpeed cannot build it here (``async_io`` without the libaio
    headers, for one), with DeepSpeed's own reason.
    """
    todo = pending_builds(ds_config)
    if todo and verbose:
        announce(todo)
    built = []
    for op in todo:
        if op.name == GATHER_OP:
            from dsx.ops.unified_gather import load_unified_gather

            load_unified_gather(verbose=verbose)
        else:
            _load_deepspeed_op(op.name, verbose)
        built.append(op.name)
    return built


def _load_deepspeed_op(name: str, verbose: bool) -> None:
    from deepspeed.accelerator import get_accelerator

    if name == "async_io":
        # DeepSpeed's own check passes with the libaio runtime alone, and the build then fails at link time
        ok, why = async_io_status()
        if not ok:
            raise RuntimeError(f"DeepSpeed cannot build async_io on this machine: {why}")
    builder = get_accelerator().create_op_builder(_DS_BUILDERS[name])
    if builder is None:
        raise RuntimeError(f"DeepSpeed's {get_accelerator()._name} accelerator has no {name} op to build")
    if not builder.is_compatible(verbose=verbose):
        raise RuntimeError(
            f"DeepSpeed cannot build {name} on this machine"
            + (f": {builder.error_log}" if getattr(builder, "error_log", None) else "")
        )
    try:
        builder.load(verbose=verbose)
    except Exception as exc:  # a compiler or linker failure: its output is above (verbose) or in the message
        raise RuntimeError(f"building {name} failed: {type(exc).__name__}: {exc}") from exc
