"""``dsx.direct.HeteroNeighborLoader``: PyG-compatible heterogeneous mini-batches sampled on the GPU.

A drop-in for ``torch_geometric.loader.NeighborLoader`` on ``HeteroData`` for the options it supports
(``num_neighbors`` as a list or a dict per edge type, ``input_nodes=(node_type, index or mask)``,
``batch_size``, ``shuffle``, ``drop_last``). Batches are ``HeteroData`` with, per node type, ``n_id``,
``num_sampled_nodes`` (per hop) and ``x`` / ``y`` where the graph has them; per edge type ``edge_index``
(local ids; row 0 the source, row 1 the destination), ``e_id`` (the edge's column in the graph's
``edge_index`` of that type) and ``num_sampled_edges``; on the seed type ``batch_size`` and ``input_id``
(the seeds' node ids, as :class:`dsx.direct.NeighborLoader` gives). ``batch.num_sampled_nodes_dict`` and
``batch.num_sampled_edges_dict`` are what PyG's ``trim_to_layer`` takes.

Sampling is :class:`~dsx.direct.hetero_sampler.HeteroNeighborSampler` over one CSR per edge type, built once
(on the device when all of them fit); features per node type stay in host memory as unified tensors (one
copy per node across local ranks) or are copied to the device. Batches are prepared ahead on the runtime
scheduler exactly as the homogeneous loader's (:class:`~dsx.direct.pipeline.PipelinedLoader`).
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import Unpack  # typing.Unpack is Python 3.11+

from dsx.direct.hetero_sampler import EdgeType, HeteroNeighborSampler
from dsx.direct.pipeline import (
    LoaderOptions,
    PipelinedLoader,
    bytes_to_place,
    csr_device,
    gather_rows,
    place_features,
    with_process_group,
)
from dsx.direct.sampler import check_csr, to_csr
from dsx.id_bounds import vouch

__all__ = ["DistributedHeteroNeighborLoader", "HeteroNeighborLoader", "fanouts_per_edge_type"]


def fanouts_per_edge_type(
    num_neighbors: list[int] | dict[EdgeType, list[int]], edge_types: list[EdgeType]
) -> dict[EdgeType, list[int]]:
    """PyG's ``num_neighbors`` as a fanout list per edge type: a list applies to every edge type; a dict must
    name every edge type of the graph and no other (as PyG's ``NumNeighbors`` without a default)."""
    if isinstance(num_neighbors, (list, tuple)):
        return {et: list(num_neighbors) for et in edge_types}
    if not isinstance(num_neighbors, dict):
        raise TypeError(
            f"num_neighbors must be a list or a dict per edge type, got {type(num_neighbors).__name__}"
        )
    given = {tuple(k): list(v) for k, v in num_neighbors.items()}
    unknown = sorted(set(given) - set(edge_types))
    missing = [et for et in edge_types if et not in given]
    if unknown or missing:
        raise ValueError(
            f"num_neighbors names edge types not in the graph: {unknown}; missing: {missing}"
            if unknown
            else f"num_neighbors is missing the edge types {missing} (give every edge type, 0 to skip one)"
        )
    return given


class HeteroNeighborLoader(PipelinedLoader):
    """Mini-batches of sampled typed neighborhoods from a ``torch_geometric.data.HeteroData``.

    Parameters
    ----------
    data:
        ``HeteroData`` with, per edge type, ``edge_index`` (COO, row 0 source, row 1 destination) or ``rowptr``
        and ``col``, a CSR over destinations (``col[rowptr[v]:rowptr[v + 1]]`` are the sources of the edges
        into node ``v``; int32 ``col`` halves its memory; its positions are the batches' ``e_id``): graphs whose
        edge lists would not fit in host memory beside their features are built as CSRs (on the GPU), and, per
        node type, ``x`` (a tensor or a :class:`dsx.direct.UnifiedTensor`, shared by several loaders and not
        closed by this one) and ``y`` where present; node types without ``x`` need ``num_nodes``. Other node
        and edge attributes are not carried into the batches.
    num_neighbors:
        Fanout per hop, for every edge type (``[15, 10]``) or per edge type (a dict naming every edge type;
        ``-1`` takes all neighbors, ``0`` none on that hop). The seeds are destinations: hop ``h`` samples,
        for every edge type, in-edges of the nodes of its destination type first reached at hop ``h - 1``.
    input_nodes:
        ``(node_type, index, boolean mask or None)`` or a node type (all its nodes): the seeds.
    batch_size, shuffle, drop_last:
        As in ``torch_geometric.loader.NeighborLoader``.
    device, feature_placement, csr_placement, prefetch, engine, scheduler, rank, world_size, seed, transform:
        As in :class:`dsx.direct.NeighborLoader`; ``feature_placement`` applies to every node type's ``x``,
        ``csr_placement="auto"`` puts all edge types' CSRs on the device if together they fit in half its
        free memory.
    """

    def __init__(
        self,
        data: Any,
        num_neighbors: list[int] | dict[EdgeType, list[int]],
        input_nodes: str | tuple[str, torch.Tensor | None],
        batch_size: int = 1,
        shuffle: bool = False,
        drop_last: bool = False,
        **options: Unpack[LoaderOptions],
    ) -> None:
        from torch_geometric.data import HeteroData

        if not isinstance(data, HeteroData):
            raise TypeError(
                f"HeteroNeighborLoader needs a torch_geometric.data.HeteroData, got {type(data).__name__} "
                "(dsx.direct.NeighborLoader takes a homogeneous Data)"
            )
        super().__init__(
            "num_neighbors, input_nodes, batch_size, shuffle, drop_last",
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            **options,
        )
        self.node_types: list[str] = list(data.node_types)
        self.edge_types: list[EdgeType] = [tuple(et) for et in data.edge_types]
        self.input_type, index = input_nodes if isinstance(input_nodes, tuple) else (input_nodes, None)
        if self.input_type not in self.node_types:
            raise ValueError(
                f"input_nodes names node type {self.input_type!r}; the graph has {self.node_types}"
            )
        self.num_nodes = {t: self._node_count(data, t) for t in self.node_types}
        fanouts = fanouts_per_edge_type(num_neighbors, self.edge_types)

        given = {et: self._given_csr(data, et) for et in self.edge_types}
        edge_index = {et: self._edge_index(data, et) for et in self.edge_types if given[et] is None}
        # to build: pointers, then per edge the sources, argsort, permutation and sort scratch; given CSRs
        # take their own bytes, none if already on the device (built there)
        need = sum(8 * (self.num_nodes[et[2]] + 1) + 32 * ei.shape[1] for et, ei in edge_index.items())
        need += bytes_to_place([c for rc in given.values() if rc is not None for c in rc], self.device)
        # and the sampler's one pointer array over every edge type
        need += sum(8 * (self.num_nodes[et[2]] + 1) for et in self.edge_types)
        csr_dev = csr_device(self.csr_placement, self.device, need + 8 * sum(self.num_nodes.values()))
        csr, perm = {}, {}
        for et in self.edge_types:
            if given[et] is not None:  # CSR positions are the edge ids (e_id)
                csr[et] = tuple(c.to(csr_dev) for c in given[et])
                continue
            rowptr, col, perm[et] = to_csr(edge_index[et], self.num_nodes[et[2]], csr_dev)
            csr[et] = (rowptr, col)
        self.sampler = HeteroNeighborSampler(
            csr, self.num_nodes, fanouts, edge_id=perm, generator=self._generator(csr_dev)
        )

        # Per node type: (table, unified tensor or None, owned); registration order is the node types' order
        # on every rank (sharing a table per node is collective over the local ranks).
        self._x = {
            t: place_features(
                data[t].x, self.feature_placement, self.device, f"hetero_loader_x_{t}", self._unified_config
            )
            for t in self.node_types
            if getattr(data[t], "x", None) is not None
        }
        self.y = {
            t: data[t].y.to(self.device) for t in self.node_types if getattr(data[t], "y", None) is not None
        }
        self.input_nodes = self._seed_ids(index, self.num_nodes[self.input_type])

    @staticmethod
    def _node_count(data: Any, t: str) -> int:
        store = data[t]
        x = getattr(store, "x", None)
        n = getattr(store, "num_nodes", None) if "num_nodes" in store or x is None else len(x)
        if n is None:
            raise ValueError(f"node type {t!r} has neither x nor num_nodes: set data[{t!r}].num_nodes")
        return int(n)

    def _given_csr(self, data: Any, et: EdgeType) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(rowptr, col)`` where the edge type stores its CSR over destinations, validated; else None."""
        store = data[et]
        rowptr, col = getattr(store, "rowptr", None), getattr(store, "col", None)
        if rowptr is None and col is None:
            return None
        if not isinstance(rowptr, torch.Tensor) or not isinstance(col, torch.Tensor):
            raise ValueError(
                f"edge type {et}: give both rowptr and col (a CSR over destinations), or edge_index"
            )
        check_csr(rowptr, col, self.num_nodes[et[2]], self.num_nodes[et[0]], f"edge type {et}")
        return rowptr, col

    def _edge_index(self, data: Any, et: EdgeType) -> torch.Tensor:
        ei = getattr(data[et], "edge_index", None)
        if not isinstance(ei, torch.Tensor) or ei.dim() != 2 or ei.shape[0] != 2:
            raise ValueError(
                f"edge type {et} needs edge_index, a [2, E] tensor, or rowptr and col, a CSR over "
                "destinations (adj_t / SparseTensor unsupported)"
            )
        if ei.numel():  # once, at construction: a bad id would index another node's row of the CSR or map
            lo_s, hi_s, lo_d, hi_d = (
                int(v) for v in torch.stack([ei[0].min(), ei[0].max(), ei[1].min(), ei[1].max()]).tolist()
            )
            ns, nd = self.num_nodes[et[0]], self.num_nodes[et[2]]
            if lo_s < 0 or lo_d < 0 or hi_s >= ns or hi_d >= nd:
                raise ValueError(
                    f"edge type {et}: node ids out of range (sources in [{lo_s}, {hi_s}] for {ns} {et[0]!r} "
                    f"nodes, destinations in [{lo_d}, {hi_d}] for {nd} {et[2]!r} nodes)"
                )
        return ei

    # --- batches ---------------------------------------------------------------------------------------------

    def _make(self, input_id: torch.Tensor) -> Any:
        from torch_geometric.data import HeteroData

        out = self.sampler.sample(
            self.input_type, self.input_nodes[input_id]
        )  # host ids: range-checked there
        batch, dev = HeteroData(), self.device
        n_ids = {t: out.n_id[t].to(dev, non_blocking=True) for t in self.node_types}
        for t, n_id in n_ids.items():
            store = batch[t]
            store.num_nodes, store.n_id = n_id.numel(), n_id
            store.num_sampled_nodes = out.num_sampled_nodes[t]
        with self._gathering(*n_ids.values()):
            for t, n_id in n_ids.items():
                if t in self._x:
                    batch[t].x = gather_rows(*self._x[t][:2], n_id, dev)
                if t in self.y:
                    batch[t].y = self.y[t][n_id]
        for et in self.edge_types:
            store = batch[et]
            edge_index = out.edge_index[et].to(dev, non_blocking=True)
            # in range by construction: the relational layers' layout may skip its check (and its host sync)
            vouch(edge_index, (n_ids[et[0]].numel(), n_ids[et[2]].numel()))
            store.edge_index = edge_index
            store.e_id = out.e_id[et].to(dev, non_blocking=True)
            store.num_sampled_edges = out.num_sampled_edges[et]
        batch[self.input_type].batch_size = out.batch_size
        batch[self.input_type].input_id = input_id.to(dev)
        return batch

    def _unified_tensors(self) -> list[Any]:
        return [ut for _, ut, _ in self._x.values() if ut is not None]

    def close(self) -> None:
        """Unregister the features this loader pinned (UnifiedTensors passed in stay open)."""
        for t, (_, ut, owned) in list(self._x.items()):
            if owned:  # later batches (if any) index the host table
                ut.close()
                self._x[t] = (ut.tensor, None, False)


class DistributedHeteroNeighborLoader(HeteroNeighborLoader):
    """:class:`HeteroNeighborLoader` whose rank and world size come from ``torch.distributed``: every rank
    gets an equal, disjoint share of the (identically shuffled) seeds each epoch; call ``set_epoch`` every
    epoch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **with_process_group(kwargs))
