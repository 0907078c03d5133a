"""Small random relational graphs for the rgnn kernel tests (shared by CPU and GPU tests)."""

from __future__ import annotations

import torch

from dsx.rgnn.kernels import EdgeSpec


def segments(num_rel: int, num_rows: int, num_src: int, gen: torch.Generator, empty=(1,)):
    """row_idx grouped by relation with ``rel_ptr``; the relations in ``empty`` get no rows."""
    weights = torch.rand(num_rel, generator=gen) + 0.2
    for r in empty:
        if r < num_rel:
            weights[r] = 0.0
    rel = torch.multinomial(weights, num_rows, replacement=True, generator=gen).sort().values
    counts = torch.bincount(rel, minlength=num_rel)
    rel_ptr = torch.zeros(num_rel + 1, dtype=torch.int64)
    rel_ptr[1:] = torch.cumsum(counts, 0)
    row_idx = torch.randint(0, num_src, (num_rows,), generator=gen)
    return row_idx, rel_ptr


def edge_graph(spec: EdgeSpec, num_dst: int, num_src: int, num_rel: int, num_edges: int, heads: int, dim: int,
               gen: torch.Generator, dp: int = 3, dtype=torch.float32, node_dst: bool = False):  # fmt: skip
    """Edges sorted by destination with isolated destinations, duplicate edges and empty relations.

    Returns ``(dst_ptr, msg, edge_msg_row, kwargs)`` where ``msg`` is compact: one row per unique
    (source, relation) pair. ``node_dst``: ``dst_term`` per destination node instead of per (node, relation).
    """
    used_dst = max(1, num_dst - 3)  # the last destinations stay isolated
    dst = torch.randint(0, used_dst, (num_edges,), generator=gen)
    dst[1] = 0  # a guaranteed isolated node: skip destination 1 entirely
    dst[dst == 1] = 0
    src = torch.randint(0, num_src, (num_edges,), generator=gen)
    rel = torch.randint(0, max(1, num_rel - 1), (num_edges,), generator=gen)  # the last relation stays empty
    src[3], dst[3], rel[3] = src[2], dst[2], rel[2]  # a duplicate edge
    order = torch.argsort(dst * num_edges + torch.arange(num_edges), stable=True)
    dst, src, rel = dst[order], src[order], rel[order]
    dst_ptr = torch.zeros(num_dst + 1, dtype=torch.int64)
    dst_ptr[1:] = torch.cumsum(torch.bincount(dst, minlength=num_dst), 0)
    pair, edge_msg_row = torch.unique(src * num_rel + rel, return_inverse=True)
    msg = torch.randn(pair.numel(), heads, dim, generator=gen).to(dtype)
    kw = {}
    if spec.has_logit:
        # Terms indexed per edge by (source, relation) and (destination, relation) rows, as in RGAT / HGT.
        src_pair, kw["edge_src_row"] = torch.unique(src * num_rel + rel, return_inverse=True)
        shape = (heads,) if spec.score == "add" else (heads, dp)
        kw["src_term"] = torch.randn(src_pair.numel(), *shape, generator=gen).to(dtype)
        if node_dst:  # dst_term indexed by the destination node itself (no edge_dst_row)
            kw["dst_term"] = torch.randn(num_dst, *shape, generator=gen).to(dtype)
        else:
            dst_pair, kw["edge_dst_row"] = torch.unique(dst * num_rel + rel, return_inverse=True)
            kw["dst_term"] = torch.randn(dst_pair.numel(), *shape, generator=gen).to(dtype)
    if spec.rel_scale:
        kw["edge_rel"] = rel
        kw["rel_scale"] = (torch.rand(num_rel, heads, generator=gen) + 0.5).to(dtype)
    if spec.edge_weight:
        kw["edge_weight"] = (torch.rand(num_edges, generator=gen) + 0.1).to(dtype)
    return dst_ptr, msg, edge_msg_row, kw


def to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


# The EdgeSpec variants the RGCN / RGAT / HGT layers use, plus the unnormalised-score and everything-on corners.
SPECS = {
    "rgcn_sum": EdgeSpec(),
    "rgcn_mean": EdgeSpec(edge_weight=True),
    "rgat": EdgeSpec(score="add", leaky_relu_slope=0.2, softmax=True),
    "rgat_weighted": EdgeSpec(score="add", leaky_relu_slope=0.2, softmax=True, edge_weight=True),
    "hgt": EdgeSpec(score="dot", rel_scale=True, softmax=True),
    "dot_all": EdgeSpec(score="dot", leaky_relu_slope=0.1, rel_scale=True, edge_weight=True, softmax=True),
    "add_unnormalised": EdgeSpec(score="add", rel_scale=True, edge_weight=True),
}

LOGIT_SPECS = [name for name, spec in SPECS.items() if spec.has_logit]
