"""Plain PyTorch edge operations shared by the interpreter and the unfused parts of compiled programs.

Both executors compute an op that was not fused the same way, so these live below both of them: the
interpreter (the spec) and :mod:`dsx.rgnn.compile` (the lowering) import them, and neither imports the other
for them.
"""

from __future__ import annotations

import torch

from dsx.rgnn.graph import RelGraph

__all__ = ["edge_scalar", "edge_softmax", "per_relation_matmul"]


def per_relation_matmul(v: torch.Tensor, w: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
    """``out[e] = v[e] @ w[rel[e]]`` with one matmul per relation (no per-edge weight copies)."""
    out = v.new_zeros((v.shape[0], w.shape[-1]))
    for r in range(w.shape[0]):
        mask = rel == r
        out = out.index_put((mask,), v[mask] @ w[r])
    return out


def edge_scalar(g: RelGraph, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A per-edge graph constant (``[E]``) named by the IR."""
    if name == "inv_deg_rel":
        return g.inv_deg_rel.to(dtype)
    deg = (g.dst_ptr[1:] - g.dst_ptr[:-1]).clamp_min(1)
    return (1.0 / deg.to(dtype))[g.dst]


def edge_softmax(logit: torch.Tensor, dst: torch.Tensor, num_dst: int) -> torch.Tensor:
    """Max-stabilised softmax of ``logit [E, H]`` over the edges sharing a destination."""
    heads = logit.shape[1]
    index = dst.view(-1, 1).expand(-1, heads)
    mx = torch.full((num_dst, heads), float("-inf"), dtype=logit.dtype, device=logit.device)
    mx = mx.scatter_reduce(0, index, logit.detach(), "amax", include_self=True)
    ex = torch.exp(logit - mx[dst])
    den = torch.zeros((num_dst, heads), dtype=logit.dtype, device=logit.device).index_add_(0, dst, ex)
    return ex / den[dst]
