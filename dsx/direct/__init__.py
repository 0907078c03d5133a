"""Unified tensors, GPU neighbor sampling and the distributed GNN loader (PyTorch-Direct in dsx).

This file is owned by the sampler side; the unified-tensor exports and the ``attach`` hook for the
``"dsx"."unified"`` section are listed here so that they merge.
"""

from typing import Any

from dsx.direct.gather import IndexOutOfRangeError
from dsx.direct.loader import DistributedNeighborLoader, NeighborLoader
from dsx.direct.pinning import PinningError
from dsx.direct.sampler import NeighborSampler, SampledSubgraph, to_csr
from dsx.direct.shm import SharedMemoryError
from dsx.direct.unified import UnifiedTensor, attach_unified, configure, unified

__all__ = [
    "DistributedNeighborLoader",
    "IndexOutOfRangeError",
    "NeighborLoader",
    "NeighborSampler",
    "PinningError",
    "SampledSubgraph",
    "SharedMemoryError",
    "UnifiedTensor",
    "attach",
    "configure",
    "to_csr",
    "unified",
]


def attach(engine: Any, section: Any, runtime: Any) -> Any:
    """Feature hook called by ``dsx.initialize`` when ``"dsx"."unified"."enabled"`` is true."""
    return attach_unified(engine, section, runtime)
