"""Relational layers on ``HeteroData`` batches: dict in, dict out (PyG's ``to_hetero`` role for RGCN / RGAT).

:func:`typed_layout` lays a typed graph (``x_dict`` sizes, ``edge_index_dict``) out in one node id space: node
types concatenated in ``x_dict`` order, relation ``r`` = the edge type's position in ``metadata``. It is what
``HeteroData.to_homogeneous()`` builds, without copying node attributes, and what :class:`dsx.rgnn.HGTConv`
and :class:`RelationalHetero` run on.

:class:`RelationalHetero` wraps a :class:`dsx.rgnn.RGCNConv` or :class:`dsx.rgnn.RGATConv` (or PyG's, for a
reference) so that it takes ``(x_dict, edge_index_dict)`` and returns a dict per destination node type:

    conv = RelationalHetero(dsx.rgnn.RGCNConv(64, 64, num_relations=len(metadata[1])), metadata)
    out_dict = conv(batch.x_dict, batch.edge_index_dict)

Performance: a layout costs one concatenation of the edge lists, a handful of launches and one host
synchronisation (the range check of every edge type at once), none for edge lists whose ids
``dsx.direct.HeteroNeighborLoader`` vouched for (:mod:`dsx.id_bounds`). Layouts are kept for the last few
``edge_index_dict`` tensor sets (by identity and in-place version), so every layer of a model on one batch
reuses the first layer's tensors, and
:func:`dsx.rgnn.prepare`'s cache then serves them the prepared graph; :func:`typed_graph` does the same for
HGT, keeping the prepared graph itself.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from dsx.id_bounds import vouched_within
from dsx.rgnn.graph import (
    RelGraph,
    cache_clear,
    cache_get,
    cache_put,
    check_index_tensor,
    prepare,
    tensor_version,
)
from dsx.rgnn.graph import clear_cache as clear_graph_cache
from dsx.runtime.host_memory import device_table

__all__ = [
    "EdgeType",
    "PrepareGraph",
    "RelationalHetero",
    "TypedLayout",
    "clear_cache",
    "typed_graph",
    "typed_layout",
]

EdgeType = tuple[str, str, str]
_LAYOUTS: OrderedDict[tuple, tuple[list[torch.Tensor], TypedLayout]] = OrderedDict()
_GRAPHS: OrderedDict[tuple, tuple[list[torch.Tensor], RelGraph, dict[str, int]]] = OrderedDict()
# Batches whose graphs are alive at once: the one a model's layers run on, the loader's prefetched ones
# (PrepareGraph builds them ahead), and an evaluation batch between.
_LAYOUTS_KEPT = _GRAPHS_KEPT = 4


@dataclass(frozen=True)
class TypedLayout:
    """A typed graph in one node id space: type ``t`` owns ids ``offset[t] <= i < offset[t] + sizes[t]``."""

    offset: dict[str, int]
    sizes: dict[str, int]
    edge_index: torch.Tensor  # [2, E] int64, homogeneous ids
    edge_type: torch.Tensor  # [E] int64, the edge type's position in metadata

    @property
    def num_nodes(self) -> int:
        return sum(self.sizes.values())

    def concat(self, x_dict: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Node features in layout order: one ``[num_nodes, F]`` tensor (every type needs the same ``F``)."""
        widths = {t: x_dict[t].size(-1) for t in self.sizes}
        if len(set(widths.values())) > 1:
            raise ValueError(
                f"node types have different feature widths {widths}: project each type to one width first "
                "(a torch.nn.Linear per type, or an nn.Embedding for featureless types)"
            )
        return torch.cat([x_dict[t] for t in self.sizes], 0)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """``Tensor.record_stream`` for the layout's tensors (see :meth:`dsx.rgnn.RelGraph.record_stream`)."""
        for t in (self.edge_index, self.edge_type):
            if t.is_cuda:
                t.record_stream(stream)

    def split(self, out: torch.Tensor, node_types: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Rows of ``out`` (layout order) per node type: views, no copy."""
        types = list(self.sizes) if node_types is None else node_types
        return {t: out[self.offset[t] : self.offset[t] + self.sizes[t]] for t in types}


def typed_layout(
    sizes: Mapping[str, int],
    edge_index_dict: Mapping[EdgeType, torch.Tensor],
    edge_types: list[EdgeType],
    *,
    cache: bool = True,
    device: torch.device | str | None = None,
) -> TypedLayout:
    """Lay ``edge_index_dict`` (local ids per type, row 0 source) out over the node types of ``sizes``.

    ``edge_types`` is the model's metadata: an edge type's position there is its relation id, so a batch
    that lacks some edge types keeps the ids of the others. ``device``: where an empty layout (no edge types
    given) is made; otherwise the edges' device. Raises ``ValueError`` naming the edge type for one that is
    not in ``edge_types``, whose node types are not in ``sizes``, or whose ids are out of range.
    """
    rel_of = {tuple(e): i for i, e in enumerate(edge_types)}
    items = [(tuple(e), ei) for e, ei in edge_index_dict.items()]
    # every layer of a model asks for the same layout: the cache is looked in first, as what it holds was
    # validated when built (inference tensors keep no in-place version: a layout of them is never reused)
    cache = cache and all(isinstance(ei, torch.Tensor) and not ei.is_inference() for _, ei in items)
    if cache:
        key = (
            tuple((e, id(ei), tensor_version(ei)) for e, ei in items),
            tuple(sizes.items()),
            tuple(rel_of),
            str(device),
        )
        hit = cache_get(_LAYOUTS, key)
        if hit is not None:
            return hit[1]
    for e, ei in items:
        check_index_tensor(ei, f"edge_index_dict[{e}]", "a [2, E] tensor of node ids")
        if e not in rel_of:
            raise ValueError(f"edge type {e} is not in the metadata's edge types {list(rel_of)}")
        if e[0] not in sizes or e[-1] not in sizes:
            raise ValueError(f"edge type {e} needs node types {e[0]!r} and {e[-1]!r} in x_dict")
        if ei.dim() != 2 or ei.size(0) != 2:
            raise ValueError(f"edge_index_dict[{e}] must be a [2, E] tensor, got {tuple(ei.shape)}")
    layout = _build(dict(sizes), items, rel_of, torch.device(device or "cpu"))
    if cache:  # the entry keeps the keyed tensors alive, so their ids cannot be reused by others
        cache_put(_LAYOUTS, key, ([ei for _, ei in items], layout), _LAYOUTS_KEPT)
    return layout


def _build(
    sizes: dict[str, int], items: list, rel_of: dict[EdgeType, int], empty_on: torch.device
) -> TypedLayout:
    offset, start = {}, 0
    for t, n in sizes.items():
        offset[t], start = start, start + int(n)
    nonempty = [(e, ei) for e, ei in items if ei.numel()]
    if not nonempty:
        device = items[0][1].device if items else empty_on
        empty = torch.zeros(2, 0, dtype=torch.long, device=device)
        return TypedLayout(offset, sizes, empty, empty[0])
    # A batch has a handful of edge types and a few hundred thousand edges: the cost is in launches, not
    # bytes. So the edge lists are concatenated first and every per-type value comes from one small table,
    # gathered per edge by its segment: five launches whatever the number of edge types, and three more and a
    # host synchronisation for the range check. (One launch gathers the table's rows into rows per edge,
    # contiguous: a gather of its columns, [E, 6], was measured slower.)
    device = nonempty[0][1].device
    first_s = [offset[e[0]] for e, _ in nonempty]
    first_d = [offset[e[-1]] for e, _ in nonempty]
    columns = [first_s, first_d, [rel_of[e] for e, _ in nonempty],
               [f + sizes[e[0]] - 1 for f, (e, _) in zip(first_s, nonempty)],
               [f + sizes[e[-1]] - 1 for f, (e, _) in zip(first_d, nonempty)],
               list(itertools.accumulate(ei.size(1) for _, ei in nonempty))]  # fmt: skip
    table = device_table(columns, device)
    local = torch.cat([ei.long() for _, ei in nonempty], 1)
    seg = torch.searchsorted(table[5], torch.arange(local.size(1), device=device), right=True)
    # edge lists that dsx's sampler made for these node counts are in range: no check, no host sync
    check = not all(vouched_within(ei, (sizes[e[0]], sizes[e[-1]])) for e, ei in nonempty)
    # [5, E]: source and destination offsets, relation, last source and destination ids (layout ids); without the
    # check, the first three
    per_edge = table[: 5 if check else 3].index_select(1, seg)
    edge_index = per_edge[:2].add_(local)
    # in range where local >= 0 and id <= last: (last - id) | local is negative where either fails
    if check and int(per_edge[3:].sub_(edge_index).bitwise_or_(local).min()) < 0:
        _raise_out_of_range(sizes, nonempty)
    return TypedLayout(offset, sizes, per_edge[:2], per_edge[2])


def _raise_out_of_range(sizes: dict[str, int], nonempty: list) -> None:
    """The error for a layout whose ids are out of range, naming the first offending edge type."""
    for e, ei in nonempty:
        (lo_s, lo_d), (hi_s, hi_d) = torch.stack(ei.aminmax(dim=1)).long().tolist()
        if min(lo_s, lo_d) < 0 or hi_s >= sizes[e[0]] or hi_d >= sizes[e[-1]]:
            raise ValueError(
                f"edge type {e}: node ids out of range (sources up to {hi_s} for {sizes[e[0]]} {e[0]!r} "
                f"nodes, destinations up to {hi_d} for {sizes[e[-1]]} {e[-1]!r} nodes, smallest "
                f"{min(lo_s, lo_d)})"
            )
    raise ValueError("node ids out of range")  # (the loop names the edge type: both checks read the same ids)


def typed_graph(
    sizes: Mapping[str, int],
    edge_index_dict: Mapping[EdgeType, torch.Tensor],
    edge_types: list[EdgeType],
    needs: tuple[str, ...] = (),
    *,
    device: torch.device | str | None = None,
) -> tuple[RelGraph, dict[str, int]]:
    """The prepared graph (:func:`dsx.rgnn.prepare`) of :func:`typed_layout`'s layout and the node types'
    offsets, kept for the last four ``edge_index_dict`` tensor sets: every layer of a model on one batch gets
    the first layer's graph. The graph drops the layout's per-edge table once built (24 bytes per edge, 40 where
    the layout checked the ids' range)."""
    items = [(tuple(e), ei) for e, ei in edge_index_dict.items()]
    cache = not any(ei.is_inference() for _, ei in items)
    key = (
        tuple((e, id(ei), tensor_version(ei)) for e, ei in items),
        tuple(sizes.items()),
        tuple(tuple(e) for e in edge_types),
        str(device),
    )
    hit = cache_get(_GRAPHS, key) if cache else None
    if hit is not None:
        graph, offset = hit[1:]
        return graph.require(*needs), offset
    layout = typed_layout(sizes, edge_index_dict, edge_types, cache=False, device=device)
    graph = prepare(layout.edge_index, layout.edge_type, layout.num_nodes, max(1, len(edge_types)), cache=False,
                    needs=needs, checked=True)  # fmt: skip
    graph.release_edges()
    if cache:  # the entry keeps the keyed tensors alive, so their ids cannot be reused by others
        cache_put(_GRAPHS, key, ([ei for _, ei in items], graph, layout.offset), _GRAPHS_KEPT)
    return graph, layout.offset


def clear_cache() -> None:
    """Drop every cached layout and graph: these, and :func:`dsx.rgnn.prepare`'s."""
    cache_clear(_LAYOUTS, _GRAPHS)
    clear_graph_cache()


class RelationalHetero(nn.Module):
    """Run a relational layer (``conv(x, edge_index, edge_type)``) on ``(x_dict, edge_index_dict)``.

    Returns the output rows of every node type in ``x_dict`` that is the destination of an edge type in
    ``metadata`` (as :class:`dsx.rgnn.HGTConv` and PyG's ``to_hetero``). ``conv.num_relations`` must equal
    the number of edge types in ``metadata``; every node type's features need the same width.
    """

    def __init__(self, conv: nn.Module, metadata: tuple[list[str], list[EdgeType]]) -> None:
        super().__init__()
        self.edge_types = [tuple(e) for e in metadata[1]]
        if getattr(conv, "num_relations", None) != len(self.edge_types):
            raise ValueError(
                f"{type(conv).__name__} has num_relations={getattr(conv, 'num_relations', None)}; the metadata "
                f"has {len(self.edge_types)} edge types (one relation per edge type)"
            )
        self.conv = conv
        self.dst_node_types = {e[-1] for e in self.edge_types}

    def forward(
        self,
        x_dict: Mapping[str, torch.Tensor] | torch.Tensor,
        edge_index_dict: Mapping[EdgeType, torch.Tensor],
        sizes: Mapping[str, int] | None = None,
    ) -> dict[str, torch.Tensor] | torch.Tensor:
        """``x_dict`` per node type in, the destination types' rows out; or, with ``sizes`` (each node type's
        row count, in layout order), one layout-order tensor in and the conv's whole output out, for a stack
        of layers that all node types reach (no concatenation and split between layers)."""
        if isinstance(x_dict, torch.Tensor):
            if sizes is None:
                raise ValueError(
                    "a layout-order tensor needs sizes: each node type's row count, in layout order"
                )
            if x_dict.size(0) != sum(sizes.values()):
                raise ValueError(
                    f"a layout-order tensor of {x_dict.size(0)} rows for sizes {dict(sizes)} "
                    f"({sum(sizes.values())} rows)"
                )
            layout = self.prepare_graph(sizes, edge_index_dict, x_dict.device)[0]
            return self.conv(x_dict, layout.edge_index, layout.edge_type)
        sizes = {t: x.size(0) for t, x in x_dict.items()}
        device = next(iter(x_dict.values())).device if x_dict else None
        layout = self.prepare_graph(sizes, edge_index_dict, device)[0]
        out = self.conv(layout.concat(x_dict), layout.edge_index, layout.edge_type)
        return layout.split(out, [t for t in x_dict if t in self.dst_node_types])

    def prepare_graph(
        self, sizes: Mapping[str, int], edge_index_dict: Mapping[EdgeType, torch.Tensor], device: torch.device
    ) -> tuple[TypedLayout, RelGraph | None]:
        """The layout, and for dsx's convs the prepared graph, that a forward on these node counts and edges
        reads (both cached: :class:`PrepareGraph` builds them ahead on the loader's thread)."""
        layout = typed_layout(sizes, edge_index_dict, self.edge_types, device=device)
        needs = getattr(self.conv, "graph_needs", None)  # dsx's convs; PyG's prepare nothing
        if needs is None or not layout.edge_type.numel() or layout.edge_index.is_inference():
            return layout, None  # (inference tensors: nothing is cached, the conv prepares its graph itself)
        # the layout's ids are checked: the conv's own prepare() finds this graph in the cache
        graph = prepare(layout.edge_index, layout.edge_type, layout.num_nodes, len(self.edge_types),
                        needs=needs(), checked=True)  # fmt: skip
        return layout, graph

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.conv!r}, edge_types={len(self.edge_types)})"


class PrepareGraph:
    """A loader ``transform`` that prepares, on the loader's thread and stream, the graph a model's relational
    layers will read on each batch: the training step then finds it in the cache instead of building it.

        model = HeteroClassifier("rgcn", data.metadata(), {"paper": 128}, 64, 349).cuda()
        loader = dsx.direct.HeteroNeighborLoader(data, [25, 20], ("paper", train_idx), batch_size=1024,
                                                 device="cuda", transform=dsx.rgnn.PrepareGraph(model))

    It serves every :class:`RelationalHetero` and :class:`dsx.rgnn.HGTConv` in ``model`` that gets the batch's
    ``edge_index_dict`` and ``x_dict`` with one row per node in the batch's node-type order (as
    :class:`dsx.models.hetero_gnn.HeteroClassifier` passes them); a layer fed otherwise builds its graph itself,
    as without the transform. The batch keeps what was built in ``batch.prepared_graph`` (alive while the batch
    is), and the loader records those tensors on the training stream.

    Performance: graph preparation (sorting the batch's edges, one host synchronisation per unique-pair map, and
    one for the range check of edge lists the loader did not vouch for) leaves the training step for the
    loader's pipeline, where it overlaps the step before.
    """

    #: a loader refuses more prefetched batches than this: the caches keep four batches' graphs (the step's,
    #: the prefetched ones, an evaluation batch), so more would push prepared graphs out before their step
    max_prefetch = _GRAPHS_KEPT - 2
    #: the loaders run it without waiting for the batch's feature gathers: it reads edges and node counts only
    reads_features = False

    def __init__(self, model: nn.Module) -> None:
        self.layers = [m for m in model.modules() if callable(getattr(m, "prepare_graph", None))]
        if not self.layers:
            raise ValueError(
                f"{type(model).__name__} has no layer that prepares a typed graph (dsx.rgnn.RelationalHetero "
                "or dsx.rgnn.HGTConv): PrepareGraph would do nothing"
            )

    def __call__(self, batch: object) -> object:
        sizes = {t: batch[t].num_nodes for t in batch.node_types}
        edges = batch.edge_index_dict
        device = next(iter(edges.values())).device if edges else None
        batch.prepared_graph = [self._one(layer, sizes, edges, device) for layer in self.layers]
        return batch

    @staticmethod
    def _one(layer: nn.Module, sizes: dict, edges: dict, device: torch.device | None) -> tuple:
        return tuple(v for v in layer.prepare_graph(sizes, edges, device) if hasattr(v, "record_stream"))
