"""Seeded R-MAT power-law graphs with node features and labels that follow the graph's communities.

Each edge picks one of four quadrants per level of the adjacency matrix (probabilities a, b, c, d), so the
degree distribution is power-law. Labels are the top bits of a node's (pre-shuffle) id: with ``a`` and ``d``
on the diagonal, most edges stay inside a label's block, so neighbors share labels. Features are a class
centroid plus strong noise: a single node's features are a weak label signal, aggregating neighbors (what
GraphSAGE does) cleans it, so accuracy rises as the model learns to use the graph.

Performance: all work is vectorised torch ops in chunks of ``chunk`` edges (one ``rand`` per edge and level);
on a GPU 2.4M nodes / 62M edges take about a second, on one CPU core roughly a minute.
"""

from __future__ import annotations

import math

import torch

from dsx.direct.gather import host_empty

__all__ = ["rmat_edges", "rmat_graph"]


def rmat_edges(
    num_nodes: int,
    num_edges: int,
    *,
    a: float = 0.57,
    b: float = 0.19,
    c: float = 0.19,
    seed: int = 0,
    device: torch.device | str = "cpu",
    chunk: int = 1 << 23,
) -> torch.Tensor:
    """``[2, num_edges]`` int64 R-MAT edges over ``range(num_nodes)`` (ids before any shuffle)."""
    if num_nodes < 2 or num_edges < 1:
        raise ValueError(f"rmat needs num_nodes >= 2 and num_edges >= 1, got {num_nodes}, {num_edges}")
    if not (a > 0 and b >= 0 and c >= 0 and a + b + c < 1):
        raise ValueError(f"quadrant probabilities need a > 0, b, c >= 0 and a + b + c < 1; got {a}, {b}, {c}")
    scale = math.ceil(math.log2(num_nodes))
    g = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty(2, num_edges, dtype=torch.long, device=device)
    for lo in range(0, num_edges, chunk):
        n = min(chunk, num_edges - lo)
        src = torch.zeros(n, dtype=torch.long, device=device)
        dst = torch.zeros(n, dtype=torch.long, device=device)
        for _ in range(scale):
            r = torch.rand(n, generator=g, device=device)
            sbit = r >= a + b  # quadrants c, d: lower half
            dbit = ((r >= a) & (r < a + b)) | (r >= a + b + c)  # quadrants b, d: right half
            src = (src << 1) | sbit
            dst = (dst << 1) | dbit
        # Fold ids beyond num_nodes back (num_nodes need not be a power of two); keeps the block structure.
        out[0, lo : lo + n] = src % num_nodes
        out[1, lo : lo + n] = dst % num_nodes
    return out


def rmat_graph(
    num_nodes: int,
    num_edges: int,
    num_features: int = 128,
    num_classes: int = 16,
    *,
    undirected: bool = True,
    noise: float = 2.0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    feature_dtype: torch.dtype = torch.float32,
    chunk: int = 1 << 23,
):
    """A PyG ``Data`` R-MAT graph: ``edge_index`` (``num_edges`` directed edges, half of them the reverses of
    the others when ``undirected``), ``x`` ``[num_nodes, num_features]``, ``y`` in ``range(num_classes)``,
    and ``train_mask`` / ``val_mask`` (80 / 20 %). Everything is returned on the CPU."""
    from torch_geometric.data import Data

    half = num_edges // 2 if undirected else num_edges
    ei = rmat_edges(num_nodes, half, seed=seed, device=device, chunk=chunk)
    if undirected:
        ei = torch.cat([ei, ei.flip(0)], 1)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    bits = max(1, math.ceil(math.log2(num_classes)))
    scale = math.ceil(math.log2(num_nodes))
    y = ((torch.arange(num_nodes, device=device) >> max(0, scale - bits)) % num_classes).long()
    # Shuffle the ids so that labels and degree are not tied to id order (a sampler must not rely on it).
    perm = torch.randperm(num_nodes, generator=g, device=device)
    ei = perm[ei]
    y_new = torch.empty_like(y)
    y_new[perm] = y
    centroids = torch.randn(num_classes, num_features, generator=g, device=device)
    # page-aligned, so rows of a multiple of 128 bytes start on a line (docs/unified.md, 'Where the table starts')
    x = host_empty((num_nodes, num_features), feature_dtype)
    for lo in range(0, num_nodes, chunk):
        hi = min(num_nodes, lo + chunk)
        xc = centroids[y_new[lo:hi]] + noise * torch.randn(hi - lo, num_features, generator=g, device=device)
        x[lo:hi] = xc.to(feature_dtype).cpu()
    train = torch.rand(num_nodes, generator=g, device=device) < 0.8
    return Data(
        edge_index=ei.cpu(),
        x=x,
        y=y_new.cpu(),
        train_mask=train.cpu(),
        val_mask=~train.cpu(),
        num_nodes=num_nodes,
    )
