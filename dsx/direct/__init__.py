"""PyTorch-Direct in dsx: unified (zero-copy) host tensors, GPU neighbor sampling and the pipelined loader."""

from typing import Any

from dsx.direct import loader as _loader
from dsx.direct.gather import IndexOutOfRangeError
from dsx.direct.loader import DistributedNeighborLoader, NeighborLoader
from dsx.direct.pinning import PinningError
from dsx.direct.sampler import NeighborSampler, SampledSubgraph, csr_from_edge_index
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
    "csr_from_edge_index",
    "unified",
]


class _Handles:
    def __init__(self, *handles: Any) -> None:
        self.handles = handles

    def close(self) -> None:
        for h in reversed(self.handles):
            h.close()


def attach(engine: Any, section: Any, runtime: Any) -> _Handles:
    """Feature hook for ``"dsx"."unified"``: the section becomes the default of ``unified()`` and of loaders
    built with ``engine=``."""
    return _Handles(attach_unified(engine, section, runtime), _loader.attach(engine, section, runtime))
