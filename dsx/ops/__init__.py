"""dsx's compiled ops: the CUDA kernels in ``csrc/`` as DeepSpeed ``OpBuilder`` subclasses (JIT or ahead of
time), and the Triton plumbing (:mod:`dsx.ops.triton_backend`, :mod:`dsx.ops.triton_source`).

The OpBuilder names load on first use: importing DeepSpeed's op builder probes the accelerator, which a
module that only wants the Triton helpers (the relational layers, the sampler) should not pay for.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

_LAZY = {
    "announce_builds": "notice", "announce_comm_build": "notice", "pending_builds": "notice",
    "UnifiedGatherBuilder": "unified_gather", "build_ops": "unified_gather", "load_unified_gather": "unified_gather",
}  # fmt: skip

__all__ = [
    "UnifiedGatherBuilder",
    "announce_builds",
    "announce_comm_build",
    "build_ops",
    "cli_build",
    "load_unified_gather",
    "pending_builds",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"dsx.ops.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'dsx.ops' has no attribute {name!r}")


def cli_build(args: object) -> int:
    """``dsx build-ops``: build every dsx op now instead of on first use; with ``--config``, every op a job with
    that DeepSpeed config would compile at its start (:mod:`dsx.ops.prebuild`)."""
    verbose = not getattr(args, "quiet", False)
    config = getattr(args, "config", None)
    if config is None:
        from dsx.ops.unified_gather import build_ops

        try:
            build_ops(verbose=verbose)
        except RuntimeError as exc:  # no CUDA, no compiler: the reason is in the message
            print(f"dsx build-ops: {exc}", file=sys.stderr)
            return 1
        return 0
    from dsx.ops.prebuild import build_for_config, read_ds_config

    try:
        ds_config = read_ds_config(config)
    except ValueError as exc:
        print(f"dsx build-ops: {exc}", file=sys.stderr)
        return 2
    try:
        built = build_for_config(ds_config, verbose=verbose)
    except RuntimeError as exc:
        print(f"dsx build-ops: {exc}", file=sys.stderr)
        return 1
    if verbose:
        print(
            f"built: {', '.join(built)}" if built else f"nothing to build: every op {config} needs is cached"
        )
    return 0
