"""Pure-PyTorch twins of the fused kernels: the ground truth of the tests and the CPU fallback.

They materialise per-edge tensors (``E x H x D``) and loop over relations, so they are simple rather than
fast; autograd differentiates them directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsx.rgnn.codegen.spec import EdgeSpec

__all__ = ["edge_dst_index", "fused_edge_ref", "gather_gemm_ref"]


def gather_gemm_ref(
    x: torch.Tensor, weight: torch.Tensor, row_idx: torch.Tensor, rel_ptr: torch.Tensor, **_: object
) -> torch.Tensor:
    """``out[i] = x[row_idx[i]] @ weight[r]`` for the relation segment ``r`` holding position ``i``.

    Loops over relations on the host (one ``index_select`` + ``mm`` each); reads ``rel_ptr`` to the host.
    """
    bounds = rel_ptr.tolist()
    parts = []
    for r in range(weight.shape[0]):
        rows = row_idx[bounds[r] : bounds[r + 1]]
        parts.append(x.index_select(0, rows) @ weight[r])
    if not parts:
        return x.new_zeros((0, weight.shape[-1]))
    return torch.cat(parts, dim=0)


def edge_dst_index(dst_ptr: torch.Tensor, num_edges: int) -> torch.Tensor:
    """Destination node of each edge of a destination-CSR (no host synchronisation)."""
    counts = dst_ptr[1:] - dst_ptr[:-1]
    nodes = torch.arange(counts.numel(), device=dst_ptr.device)
    return torch.repeat_interleave(nodes, counts, output_size=num_edges)


def _edge_logit(spec: EdgeSpec, src_term, dst_term, edge_src_row, edge_dst_row, edge_rel, rel_scale):
    s = src_term.index_select(0, edge_src_row)
    t = dst_term.index_select(0, edge_dst_row)
    logit = s + t if spec.score == "add" else (s * t).sum(-1)
    if spec.leaky_relu_slope is not None:
        logit = F.leaky_relu(logit, spec.leaky_relu_slope)
    if spec.rel_scale:
        logit = logit * rel_scale.index_select(0, edge_rel)
    return logit


def fused_edge_ref(
    spec: EdgeSpec,
    dst_ptr: torch.Tensor,
    msg: torch.Tensor,
    edge_msg_row: torch.Tensor,
    *,
    edge_src_row: torch.Tensor | None = None,
    edge_dst_row: torch.Tensor | None = None,
    src_term: torch.Tensor | None = None,
    dst_term: torch.Tensor | None = None,
    edge_rel: torch.Tensor | None = None,
    rel_scale: torch.Tensor | None = None,
    edge_weight: torch.Tensor | None = None,
    **_: object,
) -> torch.Tensor:
    """Reference semantics of :func:`dsx.rgnn.kernels.fused_edge` (see the package docstring)."""
    num_dst = dst_ptr.numel() - 1
    num_edges = edge_msg_row.numel()
    _, heads, dim = msg.shape
    dst = edge_dst_index(dst_ptr, num_edges)
    acc = torch.promote_types(msg.dtype, torch.float32)  # fp32 accumulation for bf16/fp16, fp64 stays fp64
    if spec.has_logit:
        dst_rows = dst if edge_dst_row is None else edge_dst_row  # None: dst_term is indexed by node
        alpha = _edge_logit(spec, src_term, dst_term, edge_src_row, dst_rows, edge_rel, rel_scale).to(acc)
        if spec.softmax:
            # Segment softmax per (destination, head); the max only stabilises, so it carries no gradient.
            idx = dst[:, None].expand(-1, heads)
            node_max = alpha.new_full((num_dst, heads), float("-inf"))
            node_max = node_max.scatter_reduce(0, idx, alpha.detach(), "amax", include_self=False)
            p = torch.exp(alpha - node_max.index_select(0, dst))
            denom = p.new_zeros((num_dst, heads)).index_add(0, dst, p)
            alpha = p / denom.index_select(0, dst)
    else:
        alpha = msg.new_ones((num_edges, heads), dtype=acc)
    if spec.edge_weight:
        alpha = alpha * edge_weight.to(acc)[:, None]
    rows = msg.index_select(0, edge_msg_row).to(acc)
    out = msg.new_zeros((num_dst, heads, dim), dtype=acc).index_add(0, dst, alpha[..., None] * rows)
    return out.to(msg.dtype)
