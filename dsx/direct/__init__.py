"""PyTorch-Direct in dsx: GPU neighbor sampling and the pipelined GNN loader."""

from dsx.direct.loader import DistributedNeighborLoader, NeighborLoader, attach
from dsx.direct.sampler import NeighborSampler, SampledSubgraph, csr_from_edge_index

__all__ = [
    "DistributedNeighborLoader",
    "NeighborLoader",
    "NeighborSampler",
    "SampledSubgraph",
    "attach",
    "csr_from_edge_index",
]
