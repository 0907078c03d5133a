"""Python side of the CUDA kernels in ``csrc/``: DeepSpeed ``OpBuilder`` subclasses (JIT or ahead of time)."""

from dsx.ops.unified_gather import UnifiedGatherBuilder, build_ops, load_unified_gather

__all__ = ["UnifiedGatherBuilder", "build_ops", "load_unified_gather"]
