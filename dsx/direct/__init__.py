"""Unified tensors, GPU neighbor sampling and the distributed GNN loader (PyTorch-Direct in dsx).

Re-exports only. The DeepSpeed glue of the ``"dsx"."unified"`` section is :mod:`dsx.direct.deepspeed`.
"""

from dsx.direct.gather import IndexOutOfRangeError, host_empty
from dsx.direct.hetero_loader import DistributedHeteroNeighborLoader, HeteroNeighborLoader
from dsx.direct.hetero_sampler import HeteroNeighborSampler, HeteroSampledSubgraph
from dsx.direct.loader import DistributedNeighborLoader, NeighborLoader
from dsx.direct.sampler import NeighborSampler, SampledSubgraph, to_csr
from dsx.direct.shm import SharedMemoryError
from dsx.direct.unified import UnifiedTensor, unified
from dsx.runtime.pinning import PinningError

__all__ = [
    "DistributedHeteroNeighborLoader",
    "DistributedNeighborLoader",
    "HeteroNeighborLoader",
    "HeteroNeighborSampler",
    "HeteroSampledSubgraph",
    "IndexOutOfRangeError",
    "NeighborLoader",
    "NeighborSampler",
    "PinningError",
    "SampledSubgraph",
    "SharedMemoryError",
    "UnifiedTensor",
    "host_empty",
    "to_csr",
    "unified",
]
