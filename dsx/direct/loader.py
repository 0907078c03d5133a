"""``dsx.direct.NeighborLoader``: PyG-compatible mini-batches sampled and gathered on the GPU, pipelined.

Switching from PyG is a one-line change: the constructor takes PyG's names for what it supports
(``num_neighbors``, ``batch_size``, ``shuffle``, ``input_nodes``, ``drop_last``) and yields
``torch_geometric.data.Data`` batches with ``n_id``, ``edge_index``, ``batch_size``, ``num_sampled_nodes``,
``num_sampled_edges``, ``x``, ``y``, ``input_id`` and ``e_id``.

Batches are prepared ahead on the runtime scheduler's ``"loader"`` pool and stream
(:class:`~dsx.direct.pipeline.PipelinedLoader`, shared with :class:`dsx.direct.HeteroNeighborLoader`).
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import Unpack  # typing.Unpack is Python 3.11+

from dsx.direct.pipeline import (
    LoaderOptions,
    PipelinedLoader,
    bytes_to_place,
    csr_device,
    gather_rows,
    place_features,
    with_process_group,
)
from dsx.direct.sampler import NeighborSampler, check_csr, to_csr

__all__ = ["DistributedNeighborLoader", "NeighborLoader"]


class NeighborLoader(PipelinedLoader):
    """Mini-batches of sampled neighborhoods from ``data`` (a PyG ``Data``) or CSR tensors.

    Parameters
    ----------
    data:
        ``torch_geometric.data.Data`` with ``edge_index`` (and ``x``, ``y``), or a dict with ``rowptr``,
        ``col`` (CSR over targets), ``x``, ``y``. ``x`` may already be a :class:`dsx.direct.UnifiedTensor`
        (share one pinned table between loaders: pages can be registered only once per process).
    num_neighbors, batch_size, shuffle, input_nodes, drop_last:
        As in ``torch_geometric.loader.NeighborLoader``; ``input_nodes`` is an index or boolean mask.

    Keyword options (:class:`~dsx.direct.pipeline.LoaderOptions`, the same for every dsx neighbor loader):

    device:
        Where sampling runs and batches land; default the current CUDA device, else CPU.
    feature_placement:
        ``"host"`` (default): features stay in host memory, pinned in place with :func:`dsx.direct.unified` and
        gathered zero-copy by the GPU (shared per node across local ranks); ``"gpu"``: copied to ``device``.
    csr_placement:
        ``"auto"`` (default): the CSR is built on ``device`` if it fits in half the free GPU memory, else in host memory
        (sampling then runs on the CPU); ``"gpu"`` / ``"host"`` force it.
    prefetch:
        Batches prepared ahead on the scheduler (0: synchronous, on the caller's thread). Default: the
        ``"dsx"."unified".prefetch_batches`` of ``engine=`` (when its section is enabled), else of the
        process defaults (:func:`dsx.defaults.get`).
    engine:
        A DeepSpeed engine built by :func:`dsx.initialize`: its ``"unified"`` section and its scheduler apply.
    scheduler:
        The :class:`~dsx.runtime.scheduler.Scheduler` whose ``"loader"`` pool and stream prepare batches;
        default the engine's, else :func:`dsx.defaults.scheduler` (looked up at each epoch's start).
    rank, world_size:
        Give each rank its own share of seeds per epoch (see :class:`DistributedNeighborLoader`); default
        0 and 1.
    seed:
        Seeds the shuffle (identical on all ranks) and the sampler (default 0); ``set_epoch`` changes the
        shuffle.
    transform:
        As in PyG: a function applied to each batch before it is returned. It runs in the pipeline, on the
        loader's thread and (CUDA) stream, so its work overlaps the caller's step on the batch before
        (``dsx.rgnn.PrepareGraph`` prepares the relational layers' graph there). It runs after the batch's
        ``x`` / ``y`` gathers, unless it has ``reads_features = False`` (as ``PrepareGraph``, which reads only
        the edges and the node counts): then the two overlap.
    """

    def __init__(
        self,
        data: Any,
        num_neighbors: list[int],
        batch_size: int = 1,
        shuffle: bool = False,
        input_nodes: torch.Tensor | None = None,
        drop_last: bool = False,
        **options: Unpack[LoaderOptions],
    ) -> None:
        super().__init__(
            "num_neighbors, batch_size, shuffle, input_nodes, drop_last",
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            **options,
        )

        get = data.get if isinstance(data, dict) else (lambda k, d=None: getattr(data, k, d))
        x, y = get("x"), get("y")
        if get("rowptr") is not None:
            rowptr, col, perm = get("rowptr"), get("col"), None
            num_nodes = rowptr.numel() - 1
            if col is None:
                raise ValueError("data gives rowptr without col: a CSR over targets needs both")
            check_csr(rowptr, col, num_nodes, num_nodes, "data's CSR (rowptr, col)")
        else:
            ei = get("edge_index")
            if ei is None:
                raise ValueError("data needs edge_index (PyG Data) or rowptr/col (CSR over targets)")
            num_nodes = int(data.num_nodes) if not isinstance(data, dict) else int(x.shape[0])
            rowptr, col, perm = None, None, None
        if rowptr is None:  # to build: pointers, then per edge the sources, argsort, permutation and scratch
            need = 8 * (num_nodes + 1) + 8 * 4 * get("edge_index").shape[1]
        else:  # given: its own bytes, none if it is on the device already
            need = bytes_to_place((rowptr, col), self.device)
        csr_dev = csr_device(self.csr_placement, self.device, need)
        if rowptr is None:
            rowptr, col, perm = to_csr(get("edge_index"), num_nodes, csr_dev)
        else:
            rowptr, col = rowptr.to(csr_dev), col.to(csr_dev)
        self.num_nodes = num_nodes
        self.sampler = NeighborSampler(
            rowptr, col, num_neighbors, edge_id=perm, generator=self._generator(csr_dev)
        )

        self.x, self._ut, self._own_ut = place_features(
            x, self.feature_placement, self.device, "neighbor_loader_x", self._unified_config
        )
        self.y = y.to(self.device) if y is not None else None
        self.input_nodes = self._seed_ids(input_nodes, num_nodes)

    # --- batches ---------------------------------------------------------------------------------------------

    def _make(self, input_id: torch.Tensor) -> Any:
        from torch_geometric.data import Data

        out = self.sampler.sample(self.input_nodes[input_id])  # host ids: range-checked on the host
        n_id = out.n_id.to(self.device, non_blocking=True)
        batch = Data(edge_index=out.edge_index.to(self.device, non_blocking=True), num_nodes=n_id.numel())
        batch.n_id, batch.e_id = n_id, out.e_id.to(self.device, non_blocking=True)
        batch.batch_size, batch.input_id = out.batch_size, input_id.to(self.device)
        batch.num_sampled_nodes, batch.num_sampled_edges = out.num_sampled_nodes, out.num_sampled_edges
        with self._gathering(n_id):
            if self.x is not None:
                batch.x = gather_rows(self.x, self._ut, n_id, self.device)
            if self.y is not None:
                batch.y = self.y[n_id]
        return batch

    def _unified_tensors(self) -> list[Any]:
        return [self._ut] if self._ut is not None else []

    def close(self) -> None:
        """Unregister the features this loader pinned (a UnifiedTensor passed in stays open); later epochs gather
        from the host table with torch indexing."""
        if self._ut is not None and self._own_ut:
            self.x = self._ut.tensor
            self._ut.close()
        self._ut = None


class DistributedNeighborLoader(NeighborLoader):
    """:class:`NeighborLoader` whose rank and world size come from ``torch.distributed``: every rank gets an
    equal, disjoint share of the (identically shuffled) seeds each epoch; call ``set_epoch`` every epoch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **with_process_group(kwargs))
