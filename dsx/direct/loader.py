"""``dsx.direct.NeighborLoader``: PyG-compatible mini-batches sampled and gathered on the GPU, pipelined.

Switching from PyG is a one-line change: the constructor takes PyG's names for what it supports
(``num_neighbors``, ``batch_size``, ``shuffle``, ``input_nodes``, ``drop_last``) and yields
``torch_geometric.data.Data`` batches with ``n_id``, ``edge_index``, ``batch_size``, ``num_sampled_nodes``,
``num_sampled_edges``, ``x``, ``y``, ``input_id`` and ``e_id``.

Pipeline: a background thread samples and gathers batch i+1 (on a side CUDA stream on GPUs) while the caller
trains on batch i; the caller's stream waits on an event and the tensors are ``record_stream``-ed, so the
caching allocator never recycles them early. ``prefetch`` batches are kept ready.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch

from dsx.direct.sampler import NeighborSampler, to_csr

__all__ = ["DistributedNeighborLoader", "NeighborLoader"]

_UNSUPPORTED = {
    "input_time", "replace", "subgraph_type", "disjoint", "temporal_strategy", "time_attr", "weight_attr",
    "transform", "transform_sampler_output", "is_sorted", "filter_per_worker", "neighbor_sampler",
    "directed", "num_workers", "persistent_workers", "pin_memory", "collate_fn", "sampler", "batch_sampler",
    "worker_init_fn", "prefetch_factor", "generator",
}  # fmt: skip


class NeighborLoader:
    """Mini-batches of sampled neighborhoods from ``data`` (a PyG ``Data``) or CSR tensors.

    Parameters
    ----------
    data:
        ``torch_geometric.data.Data`` with ``edge_index`` (and ``x``, ``y``), or a dict with ``rowptr``,
        ``col`` (CSR over targets), ``x``, ``y``. ``x`` may already be a :class:`dsx.direct.UnifiedTensor`
        (share one pinned table between loaders: pages can be registered only once per process).
    num_neighbors, batch_size, shuffle, input_nodes, drop_last:
        As in ``torch_geometric.loader.NeighborLoader``; ``input_nodes`` is an index or boolean mask.
    device:
        Where sampling runs and batches land; default the current CUDA device, else CPU.
    feature_placement:
        ``"host"``: features stay in host memory, pinned in place with :func:`dsx.direct.unified` and
        gathered zero-copy by the GPU (shared per node across local ranks); ``"gpu"``: copied to ``device``.
    csr_placement:
        ``"auto"``: the CSR is built on ``device`` if it fits in half the free GPU memory, else in host memory
        (sampling then runs on the CPU); ``"gpu"`` / ``"host"`` force it.
    prefetch:
        Batches prepared ahead in the background (0: synchronous). ``engine=`` takes it from the engine's
        ``"dsx"."unified".prefetch_batches``.
    rank, world_size:
        Give each rank its own share of seeds per epoch (see :class:`DistributedNeighborLoader`).
    seed:
        Seeds the shuffle (identical on all ranks) and the sampler; ``set_epoch`` changes the shuffle.
    """

    def __init__(
        self,
        data: Any,
        num_neighbors: list[int],
        batch_size: int = 1,
        shuffle: bool = False,
        input_nodes: torch.Tensor | None = None,
        drop_last: bool = False,
        *,
        device: torch.device | str | None = None,
        feature_placement: str = "host",
        csr_placement: str = "auto",
        prefetch: int | None = None,
        engine: Any = None,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        bad = sorted(set(kwargs))
        if bad:
            known = [k for k in bad if k in _UNSUPPORTED]
            raise TypeError(
                f"dsx.direct.NeighborLoader does not support {bad}"
                + (f" (PyG NeighborLoader options not implemented here: {known})" if known else "")
                + "; supported: num_neighbors, batch_size, shuffle, input_nodes, drop_last, device, "
                "feature_placement, csr_placement, prefetch, engine, rank, world_size, seed"
            )
        if feature_placement not in ("host", "gpu"):
            raise ValueError(f"feature_placement must be 'host' or 'gpu', got {feature_placement!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must lie in [0, world_size={world_size})")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if (
            self.device.type == "cuda" and self.device.index is None
        ):  # side streams and threads need the index
            self.device = torch.device("cuda", torch.cuda.current_device())
        if prefetch is None:
            prefetch = 1
            rt = getattr(engine, "dsx", None)
            cfg = getattr(getattr(rt, "config", None), "unified", None)
            if cfg is not None and cfg.enabled:
                prefetch = cfg.prefetch_batches
        self.prefetch = int(prefetch)
        self.batch_size, self.shuffle, self.drop_last = int(batch_size), bool(shuffle), bool(drop_last)
        self.rank, self.world_size, self.seed, self.epoch = int(rank), int(world_size), int(seed), 0

        get = data.get if isinstance(data, dict) else (lambda k, d=None: getattr(data, k, d))
        x, y = get("x"), get("y")
        if get("rowptr") is not None:
            rowptr, col, perm = get("rowptr"), get("col"), None
            num_nodes = rowptr.numel() - 1
        else:
            ei = get("edge_index")
            if ei is None:
                raise ValueError("data needs edge_index (PyG Data) or rowptr/col (CSR over targets)")
            num_nodes = int(data.num_nodes) if not isinstance(data, dict) else int(x.shape[0])
            rowptr, col, perm = None, None, None
        csr_dev = self._csr_device(csr_placement, num_nodes, rowptr, col, get("edge_index"))
        if rowptr is None:
            rowptr, col, perm = to_csr(get("edge_index"), num_nodes, csr_dev)
        else:
            rowptr, col = rowptr.to(csr_dev), col.to(csr_dev)
        self.num_nodes = num_nodes
        gen = torch.Generator(device=csr_dev)
        gen.manual_seed(self.seed + 1_000_003 * self.rank)
        self.sampler = NeighborSampler(rowptr, col, num_neighbors, edge_id=perm, generator=gen)

        from dsx.direct.unified import UnifiedTensor

        self._ut, self._own_ut = None, False
        if isinstance(
            x, UnifiedTensor
        ):  # shared by several loaders (train/val): registered once, not closed here
            self._ut = self.x = x
        elif x is None:
            self.x = None
        elif feature_placement == "gpu":
            self.x = x.to(self.device)
        elif self.device.type == "cuda":
            from dsx.direct.unified import unified

            self._ut = unified(x, name="neighbor_loader_x")
            self.x, self._own_ut = self._ut, True
        else:
            self.x = x
        self.y = y.to(self.device) if y is not None else None

        if input_nodes is None:
            input_nodes = torch.arange(num_nodes)
        elif input_nodes.dtype == torch.bool:
            input_nodes = input_nodes.nonzero().flatten()
        self.input_nodes = input_nodes.long().cpu()

    def _csr_device(self, placement: str, n: int, rowptr: Any, col: Any, ei: Any) -> torch.device:
        if placement == "host" or self.device.type != "cuda":
            return torch.device("cpu")
        if placement == "gpu":
            return self.device
        if placement != "auto":
            raise ValueError(f"csr_placement must be 'auto', 'gpu' or 'host', got {placement!r}")
        e = col.numel() if col is not None else ei.shape[1]
        need = 8 * (n + 1) + 8 * 4 * e  # rowptr + col + perm + sort scratch
        free, _ = torch.cuda.mem_get_info(self.device)
        return self.device if need < free // 2 else torch.device("cpu")

    # --- seeds -----------------------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Change the shuffle (identical on every rank for the same epoch)."""
        self.epoch = int(epoch)

    def rank_seeds(self) -> torch.Tensor:
        """This rank's seeds for the current epoch: equal counts on every rank (padded by wrapping, or cut
        with ``drop_last``)."""
        ids = self.input_nodes
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 7919 + self.epoch)
            ids = ids[torch.randperm(ids.numel(), generator=g)]
        if self.world_size > 1:
            n = ids.numel()
            per = n // self.world_size if self.drop_last else -(-n // self.world_size)
            total = per * self.world_size
            if total > n:
                ids = torch.cat([ids, ids[: total - n]])
            ids = ids[:total][self.rank :: self.world_size]
        return ids

    def __len__(self) -> int:
        n = self.rank_seeds().numel()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    # --- batches ---------------------------------------------------------------------------------------------

    def _make(self, input_id: torch.Tensor) -> Any:
        from torch_geometric.data import Data

        out = self.sampler.sample(input_id)  # host ids: range-checked on the host, no device sync
        n_id = out.n_id.to(self.device, non_blocking=True)
        batch = Data(edge_index=out.edge_index.to(self.device, non_blocking=True), num_nodes=n_id.numel())
        batch.n_id, batch.e_id = n_id, out.e_id.to(self.device, non_blocking=True)
        batch.batch_size, batch.input_id = out.batch_size, input_id.to(self.device)
        batch.num_sampled_nodes, batch.num_sampled_edges = out.num_sampled_nodes, out.num_sampled_edges
        if self.x is not None:
            if self._ut is not None:
                batch.x = self._ut.gather(n_id, check="deferred")
            else:
                batch.x = self.x[n_id.to(self.x.device)].to(self.device)
        if self.y is not None:
            batch.y = self.y[n_id]
        return batch

    def _batches(self) -> list[torch.Tensor]:
        ids = self.rank_seeds()
        chunks = list(torch.split(ids, self.batch_size))
        if self.drop_last and chunks and chunks[-1].numel() < self.batch_size:
            chunks.pop()
        return chunks

    def __iter__(self) -> Iterator[Any]:
        chunks = self._batches()
        if self.prefetch <= 0:
            for c in chunks:
                yield self._make(c)
        else:
            yield from self._pipelined(chunks)
        if self._ut is not None:
            self._ut.check()  # deferred out-of-range flags surface at epoch end

    def _pipelined(self, chunks: list[torch.Tensor]) -> Iterator[Any]:
        cuda = self.device.type == "cuda"
        side = torch.cuda.Stream(self.device) if cuda else None
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def work() -> None:
            try:
                if cuda:
                    torch.cuda.set_device(self.device)
                for c in chunks:
                    if stop.is_set():
                        return
                    if cuda:
                        with torch.cuda.stream(side):
                            b = self._make(c)
                            ev = torch.cuda.Event()
                            ev.record(side)
                    else:
                        b, ev = self._make(c), None
                    q.put((b, ev))
                q.put(None)
            except BaseException as exc:  # surfaced in the consumer
                q.put(exc)

        t = threading.Thread(target=work, name="dsx-neighbor-loader", daemon=True)
        t.start()
        try:
            while True:
                item = q.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                b, ev = item
                if ev is not None:
                    cur = torch.cuda.current_stream(self.device)
                    cur.wait_event(ev)
                    for _, v in b:
                        if isinstance(v, torch.Tensor) and v.is_cuda:
                            v.record_stream(cur)
                yield b
        finally:
            stop.set()
            while t.is_alive():  # unblock a producer waiting on a full queue
                with contextlib.suppress(queue.Empty):
                    q.get(timeout=0.05)
            t.join()

    def close(self) -> None:
        """Unregister the features this loader pinned (a UnifiedTensor passed in stays open)."""
        if self._ut is not None and self._own_ut:
            self._ut.close()
        self._ut = None


class DistributedNeighborLoader(NeighborLoader):
    """:class:`NeighborLoader` whose rank and world size come from ``torch.distributed``: every rank gets an
    equal, disjoint share of the (identically shuffled) seeds each epoch; call ``set_epoch`` every epoch."""

    def __init__(self, data: Any, num_neighbors: list[int], batch_size: int = 1, **kwargs: Any) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            kwargs.setdefault("rank", dist.get_rank())
            kwargs.setdefault("world_size", dist.get_world_size())
        super().__init__(data, num_neighbors, batch_size, **kwargs)
