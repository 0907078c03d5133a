"""``dsx.direct.NeighborLoader``: PyG-compatible mini-batches sampled and gathered on the GPU, pipelined.

Switching from PyG is a one-line change: the constructor takes PyG's names for what it supports
(``num_neighbors``, ``batch_size``, ``shuffle``, ``input_nodes``, ``drop_last``) and yields
``torch_geometric.data.Data`` batches with ``n_id``, ``edge_index``, ``batch_size``, ``num_sampled_nodes``,
``num_sampled_edges``, ``x``, ``y``, ``input_id`` and ``e_id``.

Pipeline: the runtime scheduler prepares the next ``prefetch`` batches while the caller trains on the
current one, one task per batch on its ``"loader"`` pool (one thread, so batches are sampled in order from
the loader's random generator) and, on GPUs, its ``"loader"`` stream. The caller waits on each batch's
deadline (:meth:`Scheduler.wait <dsx.runtime.scheduler.Scheduler.wait>`: the time it blocks is the loader's
exposed stall in the telemetry), its stream waits on the batch's event and the tensors are
``record_stream``-ed, so the caching allocator never recycles them early.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from dsx import defaults
from dsx.config import UnifiedConfig
from dsx.direct.sampler import NeighborSampler, to_csr
from dsx.runtime.scheduler import Scheduler

__all__ = ["DistributedNeighborLoader", "NeighborLoader"]

_UNSUPPORTED = {
    "input_time", "replace", "subgraph_type", "disjoint", "temporal_strategy", "time_attr", "weight_attr",
    "transform", "transform_sampler_output", "is_sorted", "filter_per_worker", "neighbor_sampler",
    "directed", "num_workers", "persistent_workers", "pin_memory", "collate_fn", "sampler", "batch_sampler",
    "worker_init_fn", "prefetch_factor", "generator",
}  # fmt: skip

_loader_ids = itertools.count()


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
        Batches prepared ahead on the scheduler (0: synchronous, on the caller's thread). Default: the
        ``"dsx"."unified".prefetch_batches`` of ``engine=`` (when its section is enabled), else of the
        process defaults (:func:`dsx.defaults.get`).
    engine:
        A DeepSpeed engine built by :func:`dsx.initialize`: its ``"unified"`` section and its scheduler apply.
    scheduler:
        The :class:`~dsx.runtime.scheduler.Scheduler` whose ``"loader"`` pool and stream prepare batches;
        default the engine's, else :func:`dsx.defaults.scheduler` (looked up at each epoch's start).
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
        scheduler: Scheduler | None = None,
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
                "feature_placement, csr_placement, prefetch, engine, scheduler, rank, world_size, seed"
            )
        if feature_placement not in ("host", "gpu"):
            raise ValueError(f"feature_placement must be 'host' or 'gpu', got {feature_placement!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must lie in [0, world_size={world_size})")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # the pool thread selects it by index
            self.device = torch.device("cuda", torch.cuda.current_device())
        runtime = getattr(engine, "dsx", None)  # None: no engine, or plain DeepSpeed
        own = runtime.config.unified if runtime is not None and runtime.config.unified.enabled else None
        section: UnifiedConfig = own if own is not None else defaults.get("unified")
        if scheduler is None and runtime is not None:
            scheduler = runtime.scheduler
        self._scheduler = scheduler  # None: the process default's, looked up at each epoch
        self.prefetch = int(section.prefetch_batches if prefetch is None else prefetch)
        self.label = f"loader:{next(_loader_ids)}"  # deadlines "loader:<id>:<epoch run>:<batch>"
        self._runs = itertools.count()
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

            self._ut = unified(x, name="neighbor_loader_x", config=own)
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

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler that prepares this loader's batches (see ``scheduler=``)."""
        return self._scheduler if self._scheduler is not None else defaults.scheduler()

    def __iter__(self) -> Iterator[Any]:
        chunks = self._batches()
        if self.prefetch <= 0:
            for c in chunks:
                yield self._make(c)
        else:
            yield from self._pipelined(chunks)
        if self._ut is not None:
            self._ut.check()  # deferred out-of-range flags surface at epoch end

    def _prepare(self, chunk: torch.Tensor, stream: Any) -> tuple[Any, Any]:
        """One batch, on the scheduler's loader thread: sampled and gathered on ``stream`` (CUDA) and
        followed by an event the caller's stream waits on."""
        if stream is None:
            return self._make(chunk), None
        torch.cuda.set_device(self.device)  # the pool's thread is shared with other loaders
        with torch.cuda.stream(stream):
            batch = self._make(chunk)
            ready = torch.cuda.Event()
            ready.record(stream)
        return batch, ready

    def _pipelined(self, chunks: list[torch.Tensor]) -> Iterator[Any]:
        sched = self.scheduler
        stream = None
        if self.device.type == "cuda":
            stream = sched.stream("loader")
            if stream is None or stream.device != self.device:
                raise ValueError(
                    f"NeighborLoader on {self.device} needs a scheduler on that device, got one on "
                    f"{sched.device}; pass scheduler=dsx.runtime.scheduler.Scheduler(device=...)"
                )
        run = f"{self.label}:{next(self._runs)}"
        todo = iter(enumerate(chunks))
        inflight: deque[tuple[str, Future[Any]]] = deque()

        def submit_next() -> None:
            item = next(todo, None)
            if item is not None:
                label = f"{run}:{item[0]}"
                fut = sched.submit(self._prepare, item[1], stream, pool="loader", deadline=label)
                inflight.append((label, fut))

        try:
            for _ in range(self.prefetch):
                submit_next()
            while inflight:
                label, fut = inflight.popleft()
                sched.wait(label)  # the blocked time is the loader's stall; a task's error is raised here
                batch, ready = fut.result()
                submit_next()  # keeps ``prefetch`` batches in flight while the caller trains on this one
                if ready is not None:
                    cur = torch.cuda.current_stream(self.device)
                    cur.wait_event(ready)
                    for _, v in batch:
                        if isinstance(v, torch.Tensor) and v.is_cuda:
                            v.record_stream(cur)
                yield batch
        finally:
            # The caller went away (break, error, generator closed): batches not started are dropped; one
            # that runs is let finish, so that nothing samples or gathers after close() freed its state.
            for label, fut in inflight:
                sched.forget(label)
                fut.cancel()
            if not threading.current_thread().name.startswith("dsx-loader"):  # (it cannot wait on itself)
                wait_futures([f for _, f in inflight])
            if stream is not None:  # later work on the caller's stream (a synchronous epoch) comes after
                torch.cuda.current_stream(self.device).wait_stream(stream)

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
