"""Graph preparation for the relational layers: destination-CSR plus unique (node, relation) maps.

:func:`prepare` turns ``(edge_index, edge_type)`` into a :class:`RelGraph` once per graph (it may synchronise
with the host: validation reads index ranges), so that forward and backward never do. The result is cached
per ``edge_index`` / ``edge_type`` tensor objects (identity and in-place version), so calling a layer
repeatedly on the same graph costs one dictionary look-up. Inference tensors keep no version counter, so an
in-place refill of one could not be told from the graph it held before: they are never cached.

Performance: one sort of ``E`` keys on the graph's device; the unique (node, relation) maps and the RGCN
degrees scatter into a table with a slot per key on a GPU where that table is small next to the edges (a
sampled mini-batch), else they sort the keys (``torch.unique``). A host synchronisation only per unique-pair
map (its size depends on the data). On a GPU the cost is about twenty launches, whose host time sets it; cheap
enough to redo per sampled mini-batch (``benchmarks/bench_hetero.py`` reports it, ``prep_ms``).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict

import torch

__all__ = ["INDEX_DTYPES", "INT32_MAX", "RelGraph", "check_index_tensor", "clear_cache", "prepare"]

INT32_MAX = 2**31 - 1
# what PyG's layers index with: narrower integers and bool are refused there, so they are here too
INDEX_DTYPES = (torch.int32, torch.int64)
_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 8
# a loader thread may prepare a batch's graph (dsx.rgnn.PrepareGraph) while the training thread reads the
# caches (this module's and dsx.rgnn.hetero's): one lock for all of them
_LOCK = threading.Lock()


class RelGraph:
    """A relational graph with edges sorted by destination (all index tensors int64, one device).

    Stored (built by :func:`prepare`; what every fused layer reads):

    num_src, num_dst, num_relations, num_edges : sizes.
    dst_ptr : ``[num_dst + 1]`` CSR over destinations of the sorted edges.
    src_row_idx, src_rel_ptr : unique (source, relation) pairs grouped by relation (compact materialization:
        a relation's projection of a source node is computed once for all its edges of that relation).
    edge_src_row : ``[E]`` each sorted edge's row in the unique (source, relation) pairs.

    Derived on first use and then kept (:meth:`require` builds them ahead of time; the layers call it right
    after :func:`prepare`, so forward and backward only read them):

    src, dst, rel : ``[E]`` per sorted edge (gathers from the stored maps, no host synchronisation).
    perm : ``[E]`` sorted position -> original edge id (sorts the original ``edge_index`` again).
    dst_row_idx, dst_rel_ptr, edge_dst_row : unique (destination, relation) pairs (RGAT's destination terms).
    inv_deg_rel : ``[E]`` float32 ``1 / deg_r(dst)``: the per-relation mean weight (PyG RGCNConv ``aggr="mean"``).
    rel_perm, rel_ptr, edge_rel_row : the sorted edges grouped by relation (``rel_perm``: positions,
        ``rel_ptr``: CSR over relations) and each edge's row there: the per-edge materialization used when
        compact materialization is switched off (ablation).

    Memory: the stored part is ``12-16 bytes per edge`` (one int64 map, plus float32 ``inv_deg_rel`` for
    RGCN mean, or one more int64 map for RGAT / HGT); every derived ``[E]`` field adds 8 bytes per edge.
    """

    LAZY = ("src", "dst", "rel", "perm", "dst_row_idx", "dst_rel_ptr", "edge_dst_row", "inv_deg_rel",
            "rel_perm", "rel_ptr", "edge_rel_row")  # fmt: skip

    def __init__(self, num_src: int, num_dst: int, num_relations: int, num_edges: int, dst_ptr: torch.Tensor,
                 src_row_idx: torch.Tensor, src_rel_ptr: torch.Tensor, edge_src_row: torch.Tensor,
                 edge_index: torch.Tensor | None = None):  # fmt: skip
        self.num_src, self.num_dst, self.num_relations, self.num_edges = (
            num_src,
            num_dst,
            num_relations,
            num_edges,
        )
        self.dst_ptr, self.src_row_idx, self.src_rel_ptr, self.edge_src_row = (
            dst_ptr, src_row_idx, src_rel_ptr, edge_src_row,
        )  # fmt: skip
        self._edge_index = edge_index  # the caller's tensor (no copy): only ``perm`` reads it again
        self._wanted: set[str] = set()
        self._fresh = False  # True while fields seeded by prepare() await the first require()
        self._sorted_dst: torch.Tensor | None = None  # prepare()'s sort key (int32 where ids fit), until then

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """``Tensor.record_stream`` for every tensor the graph holds now: a graph built on one stream (a
        loader's) and read on another is not recycled by the caching allocator before that stream is done."""
        for v in self.__dict__.values():  # (the caller's edge_index, while kept, is one of them)
            if isinstance(v, torch.Tensor) and v.is_cuda:
                v.record_stream(stream)

    @property
    def device(self) -> torch.device:
        return self.dst_ptr.device

    def require(self, *names: str) -> RelGraph:
        """Build the derived fields ``names`` now and keep them; returns ``self``.

        The graph keeps the fields some caller required (the union over calls); intermediates built on the
        way (e.g. ``dst`` for ``inv_deg_rel``) are dropped again, so a graph used only by RGCN holds no
        ``[E]`` maps that only RGAT needs. May synchronise with the host (a unique-pair map's size) the first
        time a field is built, never once it exists.
        """
        bad = [n for n in names if n not in self.LAZY]
        if bad:
            raise ValueError(f"RelGraph has no derived field {bad}; derived fields: {self.LAZY}")
        self._wanted.update(names)
        missing = [n for n in names if n not in self.__dict__]
        for name in missing:
            getattr(self, name)
        if missing or self._fresh:
            self._fresh, self._sorted_dst = False, None
            for name in self.LAZY:
                if name not in self._wanted:
                    self.__dict__.pop(name, None)
            for name in ("src", "dst", "rel"):  # a row of prepare()'s [3, E] gather keeps all three alive
                v = self.__dict__.get(name)
                if v is not None and v.untyped_storage().nbytes() > v.numel() * v.element_size():
                    self.__dict__[name] = v.clone()
        return self

    def release_edges(self) -> None:
        """Drop the reference to the caller's ``edge_index`` (``perm`` can then no longer be rebuilt)."""
        self._edge_index = None

    def nbytes(self) -> int:
        """Bytes held by the tensors built so far (the stored part and the derived fields used)."""
        seen, total = set(), 0
        for v in vars(self).values():
            if isinstance(v, torch.Tensor) and v is not self._edge_index and v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                total += v.numel() * v.element_size()
        return total

    @functools.cached_property
    def src(self) -> torch.Tensor:
        return self.src_row_idx[self.edge_src_row]

    @functools.cached_property
    def rel(self) -> torch.Tensor:
        pair_rel = _ptr_groups(self.src_rel_ptr, self.src_row_idx.numel())
        return pair_rel[self.edge_src_row]

    @functools.cached_property
    def dst(self) -> torch.Tensor:
        if self._sorted_dst is not None:
            return self._sorted_dst.long()
        return _ptr_groups(self.dst_ptr, self.num_edges)

    @functools.cached_property
    def perm(self) -> torch.Tensor:
        if self._edge_index is None:
            raise ValueError(
                "this RelGraph released its edge_index (release_edges), so perm cannot be rebuilt; "
                "call graph.require('perm') before releasing"
            )
        return torch.sort(self._edge_index[1].long(), stable=True).indices

    def _dst_key(self) -> torch.Tensor:
        """Each sorted edge's destination for building a key: ``dst`` if built, else prepare()'s narrow sort key
        while it is kept (no widening launch), else ``dst`` built now."""
        dst = self.__dict__.get("dst", self._sorted_dst)
        return self.dst if dst is None else dst

    def _dst_pairs(self):
        idx, ptr, inverse = _pairs(self._dst_key(), self.rel, self.num_dst, self.num_relations)
        self.__dict__.update(dst_row_idx=idx, dst_rel_ptr=ptr, edge_dst_row=inverse)
        return idx, ptr, inverse

    @functools.cached_property
    def dst_row_idx(self) -> torch.Tensor:
        return self._dst_pairs()[0]

    @functools.cached_property
    def dst_rel_ptr(self) -> torch.Tensor:
        return self._dst_pairs()[1]

    @functools.cached_property
    def edge_dst_row(self) -> torch.Tensor:
        return self._dst_pairs()[2]

    @functools.cached_property
    def inv_deg_rel(self) -> torch.Tensor:
        if "edge_dst_row" in self.__dict__:
            inverse = self.edge_dst_row
            return 1.0 / _counts(inverse, self.dst_row_idx.numel())[inverse].to(torch.float32)
        # only the counts are needed: each edge's (relation, destination) key counted in a dense table, or
        # found in the sorted keys where the key space is too large for a table
        n = max(self.num_dst, 1)
        if not _dense_fits(self.num_relations * n, self.num_edges, self.device):
            key = _pair_key(self.dst, self.rel, self.num_dst, self.num_relations)
            keys = torch.sort(key).values
            deg = torch.searchsorted(keys, key, right=True) - torch.searchsorted(keys, key)
            return 1.0 / deg.to(torch.float32)
        key = torch.add(self._dst_key(), self.rel, alpha=n)  # int64 (rel is)
        exact = self.num_edges < _FLOAT_COUNTS_EXACT_BELOW
        dtype = torch.float32 if exact else torch.int64
        counts = torch.zeros(self.num_relations * n, dtype=dtype, device=key.device)
        counts.index_add_(0, key, torch.ones((), dtype=dtype, device=key.device).expand(self.num_edges))
        deg = counts.index_select(0, key)
        return deg.reciprocal_() if exact else 1.0 / deg.to(torch.float32)

    @functools.cached_property
    def rel_perm(self) -> torch.Tensor:
        return torch.sort(self.rel, stable=True).indices

    @functools.cached_property
    def rel_ptr(self) -> torch.Tensor:
        return _ptr(self.rel, self.num_relations)

    @functools.cached_property
    def edge_rel_row(self) -> torch.Tensor:
        row = torch.empty_like(self.rel_perm)
        row[self.rel_perm] = torch.arange(self.num_edges, device=self.device)
        return row


# Sampled mini-batches prepare a graph every step, so these helpers never synchronise with the host (torch's
# bincount does: it reads the largest value to size its output) except where an output's size depends on the
# data (the unique pairs), and sort the narrowest keys that hold the ids (a radix sort's passes scale with the
# key's width).


def _counts(groups: torch.Tensor, n: int) -> torch.Tensor:
    """How many of ``groups`` (ids in ``[0, n)``) fall in each group, without a host synchronisation."""
    return torch.zeros(n, dtype=torch.int64, device=groups.device).index_add_(
        0, groups, torch.ones((), dtype=torch.int64, device=groups.device).expand(groups.numel())
    )


def _ptr(groups: torch.Tensor, n: int) -> torch.Tensor:
    ptr = torch.zeros(n + 1, dtype=torch.int64, device=groups.device)
    ptr[1:] = torch.cumsum(_counts(groups, n), 0)
    return ptr


def _sorted_ptr(sorted_groups: torch.Tensor, n: int, stride: int = 1) -> torch.Tensor:
    """CSR pointer over ``n`` groups of ``sorted_groups`` (group ``g`` holds the values in
    ``[g * stride, (g + 1) * stride)``): a binary search per group instead of a histogram."""
    bounds = torch.arange(0, (n + 1) * stride, stride, device=sorted_groups.device, dtype=sorted_groups.dtype)
    return torch.searchsorted(sorted_groups, bounds)


def _ptr_groups(ptr: torch.Tensor, total: int) -> torch.Tensor:
    """Inverse of a CSR pointer: the group of each of ``total`` rows (``output_size`` given: no sync)."""
    groups = torch.arange(ptr.numel() - 1, device=ptr.device)
    return torch.repeat_interleave(groups, ptr.diff(), output_size=total)


# float32 counts are exact below 2**24 (a degree never exceeds the edges); more edges count in int64
_FLOAT_COUNTS_EXACT_BELOW = 2**24


def _key_dtype(bound: int) -> torch.dtype:
    return torch.int32 if bound <= INT32_MAX else torch.int64


def _dense_fits(num_keys: int, num_edges: int, device: torch.device) -> bool:
    """Whether the maps are built by scattering into a table with one slot per (relation, node) key instead
    of sorting the edges' keys: on a GPU, where the table is small next to the edges (a sampled batch: a few
    hundred thousand nodes, a handful of relations). The table's few launches beat a sort's many there; a large
    sparse graph sorts, and so does the CPU, where sorting is the cheaper of the two."""
    return device.type == "cuda" and num_keys <= 8 * num_edges


def _pair_key(node: torch.Tensor, rel: torch.Tensor, num_nodes: int, num_relations: int) -> torch.Tensor:
    # key = rel * N + node sorts by relation first: the unique pairs come out grouped by relation.
    n = max(num_nodes, 1)
    dtype = _key_dtype(num_relations * n)
    return torch.add(node.to(dtype), rel.to(dtype), alpha=n)


def _pairs(node: torch.Tensor, rel: torch.Tensor, num_nodes: int, num_relations: int):
    """The unique (node, relation) pairs of ``E`` edges, grouped by relation and ascending within one:
    ``(node of each pair, CSR over relations, each edge's pair)``. One host synchronisation (their number)."""
    n = max(num_nodes, 1)
    if _dense_fits(num_relations * n, node.numel(), node.device):
        return _pairs_dense(node, rel, n, num_relations)
    return _pairs_sorted(node, rel, n, num_relations)


def _pairs_sorted(node: torch.Tensor, rel: torch.Tensor, n: int, num_relations: int):
    uniq, inverse = torch.unique(_pair_key(node, rel, n, num_relations), return_inverse=True)
    ptr = _sorted_ptr(uniq, num_relations, n)
    return (uniq % n).long(), ptr.long(), inverse


def _pairs_dense(node: torch.Tensor, rel: torch.Tensor, n: int, num_relations: int):
    # the keys present, marked in a table of every key: its non-zeros are the sorted unique keys, in which a
    # binary search finds each edge's pair, without sorting the edges (torch.unique sorts them, at several times
    # the launches)
    key = torch.add(node, rel.long(), alpha=n)  # int64 (rel is), from a narrower node id too
    seen = torch.zeros(num_relations * n, dtype=torch.bool, device=key.device).index_fill_(0, key, True)
    uniq = seen.nonzero().view(-1)
    return uniq % n, _sorted_ptr(uniq, num_relations, n), torch.searchsorted(uniq, key)


def check_index_tensor(t: object, name: str, what: str) -> None:
    """TypeError unless ``t`` is an int32 or int64 tensor (``what`` says what it holds, for the message)."""
    if t is None:
        raise TypeError(f"{name} is required: {what}")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor ({what}), got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor ({what}), got {t.dtype}")


def _validate(edge_index, edge_type, num_src, num_dst, num_relations, index_dtype, checked=False):
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"edge_index must be a [2, E] tensor, got {tuple(edge_index.shape)}")
    if edge_type.dim() != 1 or edge_type.numel() != edge_index.shape[1]:
        raise ValueError(
            f"edge_type has shape {tuple(edge_type.shape)} but edge_index has {edge_index.shape[1]} edges; "
            "pass one relation id per edge"
        )
    if num_relations < 1:
        raise ValueError(f"num_relations={num_relations} must be >= 1")
    limit = INT32_MAX if index_dtype == torch.int32 else 2**63 - 1
    for name, value in (("num_edges", edge_index.shape[1]), ("num_src", num_src), ("num_dst", num_dst)):
        if value > limit:
            raise ValueError(
                f"{name}={value} exceeds {limit} ({index_dtype}); use index_dtype=torch.int64 or split the graph"
            )
    if max(num_src, num_dst) * num_relations > 2**62:
        raise ValueError(
            f"num_nodes * num_relations = {max(num_src, num_dst) * num_relations} overflows the int64 pair key"
        )
    if edge_index.shape[1] == 0 or checked:
        return
    # one host synchronisation for the six bounds (a sampled mini-batch pays this per batch)
    lo, hi = edge_index.aminmax(dim=1)
    et_lo, et_hi = edge_type.aminmax()
    et_min, et_max, s_lo, s_hi, d_lo, d_hi = torch.stack(
        [et_lo.long(), et_hi.long(), lo[0].long(), hi[0].long(), lo[1].long(), hi[1].long()]
    ).tolist()
    if et_min < 0 or et_max >= num_relations:
        raise ValueError(
            f"edge_type values span [{et_min}, {et_max}] but num_relations={num_relations}; "
            f"relation ids must be in [0, {num_relations - 1}]"
        )
    for lo, hi, name, n in ((s_lo, s_hi, "source", num_src), (d_lo, d_hi, "destination", num_dst)):
        if lo < 0 or hi >= n:
            raise ValueError(f"{name} node indices span [{lo}, {hi}] but there are {n} {name} nodes")


def _build(edge_index, edge_type, num_src, num_dst, num_relations) -> RelGraph:
    # Stable sort by destination keeps the caller's edge order within a destination (matters only for
    # floating-point summation order, not for results beyond rounding).
    dst, perm = torch.sort(edge_index[1].to(_key_dtype(num_dst)), stable=True)
    # (torch._convert_indices_from_coo_to_csr is one launch, but its CUDA kernel fills each run of nodes without
    # edges from one thread, and a batch's last hop is such a run of hundreds of thousands)
    dst_ptr = _sorted_ptr(dst, num_dst).long()
    rows = _rows_of_one(edge_index, edge_type)
    if rows is not None:  # one gather for source, destination and relation
        src, dst_long, rel = rows.index_select(1, perm)
        seeded = {"src": src, "dst": dst_long, "rel": rel}
    else:
        src, rel = edge_index[0].index_select(0, perm).long(), edge_type.index_select(0, perm).long()
        seeded = {"src": src, "rel": rel}
    del perm
    src_row_idx, src_rel_ptr, edge_src_row = _pairs(src, rel, num_src, num_relations)
    graph = RelGraph(num_src, num_dst, num_relations, src.numel(), dst_ptr, src_row_idx, src_rel_ptr,
                     edge_src_row, edge_index)  # fmt: skip
    # Already computed: seeded so that require() reuses them, then drops them unless someone wants them.
    graph.__dict__.update(seeded)
    graph._sorted_dst, graph._fresh = dst, True
    return graph


def _rows_of_one(edge_index: torch.Tensor, edge_type: torch.Tensor) -> torch.Tensor | None:
    """``[3, E]``: ``edge_index``'s two rows and ``edge_type`` where they are the rows of one int64 tensor (as
    :func:`dsx.rgnn.typed_layout` makes them), so that one gather permutes all three; else None."""
    e = edge_type.numel()
    if not (edge_index.dtype == edge_type.dtype == torch.int64 and edge_index.is_contiguous() and e
            and edge_type.stride() == (1,) and edge_index.untyped_storage().data_ptr()
            == edge_type.untyped_storage().data_ptr()
            and edge_type.storage_offset() == edge_index.storage_offset() + 2 * e):  # fmt: skip
        return None
    return edge_index.as_strided((3, e), (e, 1))


def tensor_version(t: torch.Tensor) -> int | None:
    """``t._version`` for the caches' in-place guard; None for inference tensors, which keep no version
    counter (reading it raises): a cache must not keep what it builds from them."""
    return None if t.is_inference() else t._version


def prepare(
    edge_index: torch.Tensor,
    edge_type: torch.Tensor,
    num_nodes: int | tuple[int, int],
    num_relations: int,
    *,
    index_dtype: torch.dtype = torch.int64,
    cache: bool = True,
    needs: tuple[str, ...] = (),
    checked: bool = False,
) -> RelGraph:
    """Validate and index a relational graph; cached per (edge_index, edge_type) tensor objects.

    ``needs`` names derived fields of :class:`RelGraph` to build now (``graph.require(*needs)``): a layer
    passes what its kernels read, so the first call pays for them and later forwards only read them.

    ``num_nodes`` is ``N`` or ``(num_src, num_dst)`` for bipartite graphs. ``index_dtype=torch.int32``
    additionally checks that every count fits int32 (for int32 consumers). Raises ``TypeError`` for a missing
    ``edge_type`` or index tensors that are not int32 / int64 (as PyG's layers do), ``ValueError`` naming the
    offending value for out-of-range relation ids or node indices and mismatched sizes. Graphs built from
    inference tensors are not cached.

    ``checked=True``: the caller vouches that the node and relation ids are in range
    (:func:`dsx.rgnn.typed_layout` checks them for every edge type at once, or holds the loader's word for them:
    :mod:`dsx.id_bounds`); the shapes are still checked, the ids' bounds and their host synchronisation are
    skipped.
    """
    check_index_tensor(edge_index, "edge_index", "a [2, E] tensor of (source, destination) node ids")
    check_index_tensor(edge_type, "edge_type", "one relation id per edge, an [E] tensor")
    num_src, num_dst = (num_nodes, num_nodes) if isinstance(num_nodes, int) else tuple(num_nodes)
    cache = cache and not (edge_index.is_inference() or edge_type.is_inference())
    key = (id(edge_index), id(edge_type), num_src, num_dst, num_relations, index_dtype)
    versions = (tensor_version(edge_index), tensor_version(edge_type)) if cache else None
    entry = cache_get(_CACHE, key) if cache else None
    # Identity is checked through the stored references (the cache keeps them alive, so ids cannot be
    # reused), the in-place version guards against edits of the same tensor.
    if entry is not None and not (entry[0] is edge_index and entry[1] is edge_type and entry[2] == versions):
        entry = None
    if entry is not None:
        graph = entry[3]
        return graph.require(*needs) if needs else graph
    _validate(edge_index, edge_type, num_src, num_dst, num_relations, index_dtype, checked)
    graph = _build(edge_index, edge_type, num_src, num_dst, num_relations).require(*needs)
    if cache:
        cache_put(_CACHE, key, (edge_index, edge_type, versions, graph), _CACHE_SIZE)
    return graph


def cache_get(cache: OrderedDict, key: tuple) -> tuple | None:
    """The entry of an LRU cache of prepared graphs (this module's, or dsx.rgnn.hetero's), marked most recent."""
    with _LOCK:
        entry = cache.get(key)
        if entry is not None:
            cache.move_to_end(key)
        return entry


def cache_clear(*caches: OrderedDict) -> None:
    """Empty LRU caches of prepared graphs."""
    with _LOCK:
        for cache in caches:
            cache.clear()


def cache_put(cache: OrderedDict, key: tuple, entry: tuple, kept: int) -> None:
    """Insert into an LRU cache of prepared graphs, dropping the oldest beyond ``kept`` entries."""
    with _LOCK:
        cache[key] = entry
        while len(cache) > kept:
            cache.popitem(last=False)


def clear_cache() -> None:
    """Drop every cached :class:`RelGraph` (and the references to the graphs' index tensors)."""
    cache_clear(_CACHE)
