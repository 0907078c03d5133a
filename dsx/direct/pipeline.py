"""What the neighbor loaders share: seeds per rank and epoch, feature placement, and the batch pipeline on the
runtime scheduler.

:class:`PipelinedLoader` is the base of :class:`dsx.direct.NeighborLoader` (homogeneous ``Data``) and
:class:`dsx.direct.HeteroNeighborLoader` (``HeteroData``); a subclass only builds one batch from a chunk of
seeds (``_make``). Pipeline: the runtime scheduler prepares the next ``prefetch`` batches while the caller
trains on the current one, one task per batch on its ``"loader"`` pool (one thread, so batches are sampled
in order from the loader's random generator) and, on GPUs, its ``"loader"`` stream. The caller waits on each
batch's deadline (:meth:`Scheduler.wait <dsx.runtime.scheduler.Scheduler.wait>`: the time it blocks is the
loader's exposed stall in the telemetry), its stream waits on the batch's event and the tensors are
``record_stream``-ed, so the caching allocator never recycles them early.

A batch's feature and label gathers run on a second stream, ``"gather"``, after the sampling that gave their
node ids. Sampling synchronises with the host once per hop; on the loader stream, each of those waits would
also wait for the previous batch's gathers, which read host-memory features over the host link for
milliseconds, and the loader's thread (its pace sets the pipeline's when the step is shorter) would idle.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, TypedDict

import torch
from typing_extensions import Unpack  # typing.Unpack is Python 3.11+

from dsx import defaults
from dsx.config import UnifiedConfig
from dsx.runtime.scheduler import Scheduler

__all__ = [
    "PYG_UNSUPPORTED",
    "LoaderOptions",
    "PipelinedLoader",
    "bytes_to_place",
    "csr_device",
    "gather_rows",
    "place_features",
    "reject_unsupported",
    "with_process_group",
]

# PyG NeighborLoader options that the dsx loaders do not implement: named in the error, not ignored.
PYG_UNSUPPORTED = {
    "input_time", "replace", "subgraph_type", "disjoint", "temporal_strategy", "time_attr", "weight_attr",
    "transform_sampler_output", "is_sorted", "filter_per_worker", "neighbor_sampler",
    "directed", "num_workers", "persistent_workers", "pin_memory", "collate_fn", "sampler", "batch_sampler",
    "worker_init_fn", "prefetch_factor", "generator",
}  # fmt: skip

_loader_ids = itertools.count()
# ``side``: the gather stream of the batch this thread prepares (a pool thread prepares one batch at a time);
# kept off the loaders, which stay picklable
_preparing = threading.local()


class LoaderOptions(TypedDict, total=False):
    """The keyword options every dsx neighbor loader takes (documented on :class:`dsx.direct.NeighborLoader`)."""

    device: torch.device | str | None
    feature_placement: str
    csr_placement: str
    prefetch: int | None
    engine: Any
    scheduler: Scheduler | None
    rank: int
    world_size: int
    seed: int
    transform: Callable[[Any], Any] | None


_OPTION_DEFAULTS: dict[str, Any] = {
    "device": None, "feature_placement": "host", "csr_placement": "auto", "prefetch": None, "engine": None,
    "scheduler": None, "rank": 0, "world_size": 1, "seed": 0, "transform": None,
}  # fmt: skip


def reject_unsupported(loader: str, kwargs: dict[str, Any], supported: str) -> None:
    """Raise a ``TypeError`` naming every unknown keyword (and which of them are PyG options not done here)."""
    bad = sorted(set(kwargs))
    if bad:
        known = [k for k in bad if k in PYG_UNSUPPORTED]
        raise TypeError(
            f"dsx.direct.{loader} does not support {bad}"
            + (f" (PyG NeighborLoader options not implemented here: {known})" if known else "")
            + f"; supported: {supported}"
        )


def with_process_group(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with ``rank`` / ``world_size`` from ``torch.distributed`` when it is initialised (explicit
    values win)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        kwargs.setdefault("rank", dist.get_rank())
        kwargs.setdefault("world_size", dist.get_world_size())
    return kwargs


def csr_device(placement: str, device: torch.device, need_bytes: int) -> torch.device:
    """Where a loader builds its CSR: ``"auto"`` puts it on ``device`` when ``need_bytes`` fit in half the
    free GPU memory (sampling then runs there), else in host memory, with a warning: sampling on the CPU is
    slower; ``"gpu"`` / ``"host"`` force it. Free memory counts what torch's caching
    allocator holds unused (after building a graph on the GPU, that can be most of it)."""
    if placement not in ("auto", "gpu", "host"):
        raise ValueError(f"csr_placement must be 'auto', 'gpu' or 'host', got {placement!r}")
    if placement == "host" or device.type != "cuda":
        return torch.device("cpu")
    if placement == "gpu":
        return device
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if need_bytes < free // 2:
        return device
    warnings.warn(
        f"dsx loader: the graph's CSR needs {need_bytes / 1e9:.1f} GB, more than half the free memory of "
        f"{device} ({free / 1e9:.1f} GB): it stays in host memory and sampling runs on the CPU, slower; "
        "csr_placement='gpu' puts it on the GPU anyway",
        stacklevel=3,
    )
    return torch.device("cpu")


def bytes_to_place(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes of ``tensors`` that placing them on ``device`` would add there (those already there add none)."""
    return sum(t.numel() * t.element_size() for t in tensors if t.device != device)


def place_features(
    x: Any, placement: str, device: torch.device, name: str, config: UnifiedConfig | None
) -> tuple[Any, Any, bool]:
    """``(table, unified tensor or None, owned)`` for a feature (or any row) table.

    A :class:`~dsx.direct.UnifiedTensor` passed in is used as is and not owned (several loaders may share
    one: pages can be registered only once per process); ``"gpu"`` copies to ``device``; ``"host"`` on a
    CUDA device pins the table in place (shared per node across local ranks); on a CPU it stays as is.
    """
    from dsx.direct.unified import UnifiedTensor, unified

    if isinstance(x, UnifiedTensor):
        return x, x, False
    if x is None:
        return None, None, False
    if placement == "gpu":
        return x.to(device), None, False
    if device.type == "cuda":
        ut = unified(x, name=name, config=config)
        return ut, ut, True
    return x, None, False


def gather_rows(table: Any, ut: Any, n_id: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table[n_id]`` on ``device``: zero-copy from host memory for a unified table (out-of-range ids are
    checked deferred, at the epoch's end), else an index on the table's device."""
    if ut is not None:
        return ut.gather(n_id, check="deferred")
    return table[n_id.to(table.device)].to(device)


def _record_stream(v: Any, stream: torch.cuda.Stream) -> None:
    """A batch value made on the loader's stream is in use on ``stream``: CUDA tensors, objects that record
    their own tensors (``dsx.rgnn.RelGraph``, put in a batch by a transform), and lists or tuples of them."""
    if isinstance(v, torch.Tensor):
        if v.is_cuda:
            v.record_stream(stream)
    elif isinstance(v, (list, tuple)):
        for item in v:
            _record_stream(item, stream)
    elif callable(getattr(v, "record_stream", None)):
        v.record_stream(stream)


class PipelinedLoader:
    """Seeds, epochs, rank shares and the scheduler pipeline of a neighbor loader (see the module's doc).

    Subclasses set :attr:`input_nodes` (host int64 seed ids) and implement ``_make(chunk) -> batch`` (whose
    feature and label gathers run inside :meth:`_gathering`) and ``_unified_tensors()`` (the unified tables
    whose deferred checks surface at an epoch's end).
    """

    input_nodes: torch.Tensor

    def __init__(
        self,
        positional: str,
        *,
        batch_size: int,
        shuffle: bool,
        drop_last: bool,
        **options: Unpack[LoaderOptions],
    ) -> None:
        """``positional`` names the subclass's own arguments, for the message that rejects unknown ones."""
        unknown = {k: v for k, v in options.items() if k not in _OPTION_DEFAULTS}
        reject_unsupported(type(self).__name__, unknown, ", ".join([positional, *_OPTION_DEFAULTS]))
        opt = {**_OPTION_DEFAULTS, **options}
        device, feature_placement, rank, world_size = (
            opt["device"], opt["feature_placement"], int(opt["rank"]), int(opt["world_size"])
        )  # fmt: skip
        if feature_placement not in ("host", "gpu"):
            raise ValueError(f"feature_placement must be 'host' or 'gpu', got {feature_placement!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must lie in [0, world_size={world_size})")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # the pool thread selects it by index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.feature_placement, self.csr_placement = feature_placement, opt["csr_placement"]
        engine, scheduler, prefetch = opt["engine"], opt["scheduler"], opt["prefetch"]
        runtime = getattr(engine, "dsx", None)  # None: no engine, or plain DeepSpeed
        own = runtime.config.unified if runtime is not None and runtime.config.unified.enabled else None
        self._unified_config = own  # the engine's section for the tables this loader pins, else None
        section: UnifiedConfig = own if own is not None else defaults.get("unified")
        if scheduler is None and runtime is not None:
            scheduler = runtime.scheduler
        self._scheduler = scheduler  # None: the process default's, looked up at each epoch
        self.prefetch = int(section.prefetch_batches if prefetch is None else prefetch)
        self.label = f"loader:{next(_loader_ids)}"  # deadlines "loader:<id>:<epoch run>:<batch>"
        self._runs = itertools.count()
        self.batch_size, self.shuffle, self.drop_last = int(batch_size), bool(shuffle), bool(drop_last)
        self.rank, self.world_size, self.seed, self.epoch = rank, world_size, int(opt["seed"]), 0
        self.transform = opt["transform"]
        if self.transform is not None and not callable(self.transform):
            raise TypeError(
                f"transform must be callable (batch -> batch), got {type(self.transform).__name__}"
            )
        limit = getattr(self.transform, "max_prefetch", None)
        if limit is not None and self.prefetch > limit:
            raise ValueError(
                f"transform {type(self.transform).__name__} serves at most prefetch={limit} batches ahead, got "
                f"prefetch={self.prefetch}; pass prefetch={limit} (or less) to the loader"
            )

    def _generator(self, device: torch.device) -> torch.Generator:
        """The sampler's generator: seeded per rank, so that ranks draw different neighborhoods."""
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed + 1_000_003 * self.rank)
        return gen

    @staticmethod
    def _seed_ids(input_nodes: torch.Tensor | None, num_nodes: int) -> torch.Tensor:
        """Host int64 ids of an index, a boolean mask or ``None`` (every node)."""
        if input_nodes is None:
            return torch.arange(num_nodes)
        if input_nodes.dtype == torch.bool:
            input_nodes = input_nodes.nonzero().flatten()
        return input_nodes.long().cpu()

    # --- seeds -----------------------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Change the shuffle (identical on every rank for the same epoch)."""
        self.epoch = int(epoch)

    def rank_positions(self) -> torch.Tensor:
        """This rank's seeds for the current epoch, as positions in ``input_nodes`` (what a batch's
        ``input_id`` holds, as in PyG): equal counts on every rank, padded by repeating the seeds (however few
        there are) or cut with ``drop_last``, so that no rank runs a step the others do not."""
        n = self.input_nodes.numel()
        pos = torch.arange(n)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 7919 + self.epoch)
            pos = pos[torch.randperm(n, generator=g)]
        if self.world_size > 1:
            per = n // self.world_size if self.drop_last else -(-n // self.world_size)
            total = per * self.world_size
            if total > n:
                pos = pos.repeat(-(-total // n))
            pos = pos[:total][self.rank :: self.world_size]
        return pos

    def rank_seeds(self) -> torch.Tensor:
        """This rank's seed node ids for the current epoch (``input_nodes`` at :meth:`rank_positions`)."""
        return self.input_nodes[self.rank_positions()]

    def __len__(self) -> int:
        n = self.rank_positions().numel()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _batches(self) -> list[torch.Tensor]:
        chunks = list(torch.split(self.rank_positions(), self.batch_size))
        if self.drop_last and chunks and chunks[-1].numel() < self.batch_size:
            chunks.pop()
        return chunks

    # --- batches ---------------------------------------------------------------------------------------------

    def _make(self, input_id: torch.Tensor) -> Any:
        """The batch of the seeds at positions ``input_id`` of ``input_nodes``."""
        raise NotImplementedError

    def _unified_tensors(self) -> list[Any]:
        return []

    @contextlib.contextmanager
    def _gathering(self, *ids: torch.Tensor) -> Iterator[None]:
        """Run a batch's gathers by node ``ids`` on the pipeline's gather stream, after the work so far on the
        current stream (which made ``ids``); outside the pipeline, on the current stream."""
        side = getattr(_preparing, "side", None)
        if side is None:
            yield
            return
        side.wait_stream(torch.cuda.current_stream(self.device))
        for t in ids:  # read there: not recycled for the loader stream's next batch before the gathers ran
            t.record_stream(side)
        with torch.cuda.stream(side):
            yield

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler that prepares this loader's batches (see ``scheduler=``)."""
        return self._scheduler if self._scheduler is not None else defaults.scheduler()

    def __iter__(self) -> Iterator[Any]:
        chunks = self._batches()
        if self.prefetch <= 0:
            for c in chunks:
                yield self._transformed(c)
        else:
            yield from self._pipelined(chunks)
        for ut in self._unified_tensors():
            ut.check()  # deferred out-of-range flags surface at epoch end

    def _transformed(self, chunk: torch.Tensor) -> Any:
        batch = self._make(chunk)
        if self.transform is None:
            return batch
        side = getattr(_preparing, "side", None)
        if side is not None and getattr(self.transform, "reads_features", True):
            # a transform may read x / y: its work on the loader stream waits for their gathers
            torch.cuda.current_stream(self.device).wait_stream(side)
        out = self.transform(batch)
        if not hasattr(out, "stores"):  # the pipeline records its tensors on the training stream
            raise TypeError(
                f"transform {type(self.transform).__name__} returned {type(out).__name__}; it must return the "
                "batch (a torch_geometric Data or HeteroData)"
            )
        return out

    def _prepare(self, chunk: torch.Tensor, stream: Any, side: Any) -> tuple[Any, Any]:
        """One batch, on the scheduler's loader thread: sampled on ``stream`` and gathered on ``side`` (CUDA),
        followed by an event, after both, that the caller's stream waits on."""
        if stream is None:
            return self._transformed(chunk), None
        torch.cuda.set_device(self.device)  # the pool's thread is shared with other loaders
        _preparing.side = side
        try:
            with torch.cuda.stream(stream):
                batch = self._transformed(chunk)
        finally:
            _preparing.side = None
        side.wait_stream(stream)
        ready = torch.cuda.Event()
        ready.record(side)
        return batch, ready

    def _pipelined(self, chunks: list[torch.Tensor]) -> Iterator[Any]:
        sched = self.scheduler
        stream = side = None
        if self.device.type == "cuda":
            stream, side = sched.stream("loader"), sched.stream("gather")
            if stream is None or stream.device != self.device:
                raise ValueError(
                    f"{type(self).__name__} on {self.device} needs a scheduler on that device, got one on "
                    f"{sched.device}; pass scheduler=dsx.runtime.scheduler.Scheduler(device=...)"
                )
        run = f"{self.label}:{next(self._runs)}"
        todo = iter(enumerate(chunks))
        inflight: deque[tuple[str, Future[Any]]] = deque()

        def submit_next() -> None:
            item = next(todo, None)
            if item is not None:
                label = f"{run}:{item[0]}"
                fut = sched.submit(self._prepare, item[1], stream, side, pool="loader", deadline=label)
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
                    for store in batch.stores:  # Data: one store; HeteroData: one per node and edge type
                        for v in store.values():
                            _record_stream(v, cur)
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
                torch.cuda.current_stream(self.device).wait_stream(side)
