"""Python side of the CUDA kernels in ``csrc/``: DeepSpeed ``OpBuilder`` subclasses (JIT or ahead of time)."""

from dsx.ops.notice import announce_builds, announce_comm_build, pending_builds
from dsx.ops.unified_gather import UnifiedGatherBuilder, build_ops, load_unified_gather

__all__ = [
    "UnifiedGatherBuilder",
    "announce_builds",
    "announce_comm_build",
    "build_ops",
    "cli_build",
    "load_unified_gather",
    "pending_builds",
]


def cli_build(args: object) -> int:
    """``dsx build-ops``: build every dsx op now instead of on first use."""
    build_ops(verbose=not getattr(args, "quiet", False))
    return 0
