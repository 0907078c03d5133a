"""Graph preparation for the relational layers: destination-CSR plus unique (node, relation) maps.

:func:`prepare` turns ``(edge_index, edge_type)`` into a :class:`RelGraph` once per graph (it may synchronise
with the host: validation reads index ranges), so that forward and backward never do. The result is cached
per ``edge_index`` / ``edge_type`` tensor objects (identity and in-place version), so calling a layer
repeatedly on the same graph costs one dictionary look-up.

Performance: a handful of sorts / ``unique`` over ``E`` elements on the graph's device; on a GPU this is
cheap enough to redo per sampled mini-batch (``benchmarks/bench_rgnn.py`` reports the cost).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["INT32_MAX", "RelGraph", "clear_cache", "prepare"]

INT32_MAX = 2**31 - 1
_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 8


@dataclass
class RelGraph:
    """A relational graph with edges sorted by destination (all index tensors int64, one device).

    Attributes
    ----------
    num_src, num_dst, num_relations, num_edges : sizes.
    dst_ptr : ``[num_dst + 1]`` CSR over destinations of the sorted edges.
    perm : ``[E]`` sorted position -> original edge id.
    src, dst, rel : ``[E]`` per sorted edge.
    src_row_idx, src_rel_ptr : unique (source, relation) pairs grouped by relation (compact materialization:
        a relation's projection of a source node is computed once for all its edges of that relation).
    edge_src_row : ``[E]`` each edge's row in the unique (source, relation) pairs.
    dst_row_idx, dst_rel_ptr, edge_dst_row : the same for (destination, relation) pairs.
    inv_deg_rel : ``[E]`` ``1 / deg_r(dst)``: the per-relation mean weight (PyG RGCNConv ``aggr="mean"``).
    rel_perm, rel_ptr, edge_rel_row : the sorted edges grouped by relation (``rel_perm``: positions,
        ``rel_ptr``: CSR over relations) and each edge's row there: the per-edge materialization used when
        compact materialization is switched off (ablation).
    """

    num_src: int
    num_dst: int
    num_relations: int
    num_edges: int
    dst_ptr: torch.Tensor
    perm: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    rel: torch.Tensor
    src_row_idx: torch.Tensor
    src_rel_ptr: torch.Tensor
    edge_src_row: torch.Tensor
    dst_row_idx: torch.Tensor
    dst_rel_ptr: torch.Tensor
    edge_dst_row: torch.Tensor
    inv_deg_rel: torch.Tensor
    rel_perm: torch.Tensor
    rel_ptr: torch.Tensor
    edge_rel_row: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.dst_ptr.device


def _ptr(groups: torch.Tensor, n: int) -> torch.Tensor:
    ptr = torch.zeros(n + 1, dtype=torch.int64, device=groups.device)
    ptr[1:] = torch.cumsum(torch.bincount(groups, minlength=n), 0)
    return ptr


def _pairs(node: torch.Tensor, rel: torch.Tensor, num_nodes: int, num_relations: int):
    # key = rel * N + node sorts by relation first: the unique pairs come out grouped by relation.
    key = rel * num_nodes + node
    uniq, inverse = torch.unique(key, return_inverse=True)
    return uniq % max(num_nodes, 1), _ptr(uniq // max(num_nodes, 1), num_relations), inverse


def _validate(edge_index, edge_type, num_src, num_dst, num_relations, index_dtype):
    if not isinstance(edge_index, torch.Tensor) or edge_index.dim() != 2 or edge_index.shape[0] != 2:
        shape = tuple(edge_index.shape) if isinstance(edge_index, torch.Tensor) else type(edge_index)
        raise ValueError(f"edge_index must be a [2, E] tensor, got {shape}")
    if edge_type is None:
        raise ValueError("edge_type is required: one relation id per edge ([E] integer tensor)")
    if edge_type.dim() != 1 or edge_type.numel() != edge_index.shape[1]:
        raise ValueError(
            f"edge_type has shape {tuple(edge_type.shape)} but edge_index has {edge_index.shape[1]} edges; "
            "pass one relation id per edge"
        )
    if edge_index.dtype.is_floating_point or edge_type.dtype.is_floating_point:
        raise TypeError("edge_index and edge_type must be integer tensors")
    if num_relations < 1:
        raise ValueError(f"num_relations={num_relations} must be >= 1")
    limit = INT32_MAX if index_dtype == torch.int32 else 2**63 - 1
    for name, value in (("num_edges", edge_index.shape[1]), ("num_src", num_src), ("num_dst", num_dst)):
        if value > limit:
            raise ValueError(
                f"{name}={value} exceeds {limit} ({index_dtype}); use index_dtype=torch.int64 or split the graph"
            )
    if num_src * num_relations > 2**62:
        raise ValueError(
            f"num_nodes * num_relations = {num_src * num_relations} overflows the int64 pair key"
        )
    if edge_index.shape[1] == 0:
        return
    et_min, et_max = int(edge_type.min()), int(edge_type.max())
    if et_min < 0 or et_max >= num_relations:
        raise ValueError(
            f"edge_type values span [{et_min}, {et_max}] but num_relations={num_relations}; "
            f"relation ids must be in [0, {num_relations - 1}]"
        )
    for row, name, n in ((0, "source", num_src), (1, "destination", num_dst)):
        lo, hi = int(edge_index[row].min()), int(edge_index[row].max())
        if lo < 0 or hi >= n:
            raise ValueError(f"{name} node indices span [{lo}, {hi}] but there are {n} {name} nodes")


def _build(edge_index, edge_type, num_src, num_dst, num_relations) -> RelGraph:
    device = edge_index.device
    src_all, dst_all = edge_index[0].long(), edge_index[1].long()
    rel_all = edge_type.long()
    num_edges = src_all.numel()
    # Stable sort by destination keeps the caller's edge order within a destination (matters only for
    # floating-point summation order, not for results beyond rounding).
    perm = torch.sort(dst_all, stable=True).indices
    src, dst, rel = src_all[perm], dst_all[perm], rel_all[perm]
    dst_ptr = _ptr(dst, num_dst)
    src_row_idx, src_rel_ptr, edge_src_row = _pairs(src, rel, num_src, num_relations)
    dst_row_idx, dst_rel_ptr, edge_dst_row = _pairs(dst, rel, num_dst, num_relations)
    deg = torch.bincount(edge_dst_row, minlength=dst_row_idx.numel()).clamp_min(1)
    inv_deg_rel = (1.0 / deg.to(torch.float32))[edge_dst_row]
    rel_perm = torch.sort(rel, stable=True).indices
    edge_rel_row = torch.empty_like(rel_perm)
    edge_rel_row[rel_perm] = torch.arange(num_edges, device=device)
    return RelGraph(
        num_src, num_dst, num_relations, num_edges, dst_ptr, perm, src, dst, rel,
        src_row_idx, src_rel_ptr, edge_src_row, dst_row_idx, dst_rel_ptr, edge_dst_row, inv_deg_rel,
        rel_perm, _ptr(rel, num_relations), edge_rel_row,
    )  # fmt: skip


def prepare(
    edge_index: torch.Tensor,
    edge_type: torch.Tensor,
    num_nodes: int | tuple[int, int],
    num_relations: int,
    *,
    index_dtype: torch.dtype = torch.int64,
    cache: bool = True,
) -> RelGraph:
    """Validate and index a relational graph; cached per (edge_index, edge_type) tensor objects.

    ``num_nodes`` is ``N`` or ``(num_src, num_dst)`` for bipartite graphs. ``index_dtype=torch.int32``
    additionally checks that every count fits int32 (for int32 consumers). Raises ``ValueError`` naming the
    offending value for out-of-range relation ids or node indices and mismatched sizes.
    """
    num_src, num_dst = (num_nodes, num_nodes) if isinstance(num_nodes, int) else tuple(num_nodes)
    key = (id(edge_index), id(edge_type), num_src, num_dst, num_relations, index_dtype)
    if cache and key in _CACHE:
        entry = _CACHE[key]
        # Identity is checked through the stored references (the cache keeps them alive, so ids cannot be
        # reused), the in-place version guards against edits of the same tensor.
        if entry[0] is edge_index and entry[1] is edge_type and entry[2] == (edge_index._version,
                                                                            edge_type._version):  # fmt: skip
            _CACHE.move_to_end(key)
            return entry[3]
    _validate(edge_index, edge_type, num_src, num_dst, num_relations, index_dtype)
    graph = _build(edge_index, edge_type, num_src, num_dst, num_relations)
    if cache:
        _CACHE[key] = (edge_index, edge_type, (edge_index._version, edge_type._version), graph)
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return graph


def clear_cache() -> None:
    """Drop every cached :class:`RelGraph` (and the references to the graphs' index tensors)."""
    _CACHE.clear()
