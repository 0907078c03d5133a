"""One scheduler per rank: it owns every side stream and every background thread of dsx.

Streams and thread pools are created here and nowhere else, by name: activation offload's copies run on
the ``"offload"`` and ``"prefetch"`` streams and its file I/O on the ``"io"`` and ``"ssd"`` pools; the GNN
loaders prepare their next batches on the ``"loader"`` pool and stream, and gather their features on the
``"gather"`` stream. So one object sees every transfer of
the rank, and its telemetry tells where a step waited.

Work items may be submitted with the point by which they must be done (a label such as
``"loader:3"``); :meth:`Scheduler.wait` on that label joins them, and the time it blocks is recorded as
exposed stall: the only time the overlap failed to hide.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from dsx.config import SchedulerConfig
from dsx.runtime.events import EventWaiter
from dsx.runtime.telemetry import StepRecord, StepTelemetry

__all__ = ["POOLS", "FutureSet", "Scheduler", "StepSink"]

# The thread pools a scheduler keeps, and how many threads each gets: ``None`` is ``io_workers``. The loader
# pool has one thread, so that a loader's batches are sampled in order from its random generator.
POOLS: dict[str, int | None] = {"io": None, "ssd": None, "loader": 1}


class FutureSet:
    """The futures of one owner still running on a shared pool, each dropped as it ends: what the owner's
    close or drain waits for (the pool itself keeps running for others)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: set[Future[Any]] = set()

    def add(self, fut: Future[Any]) -> Future[Any]:
        with self._lock:
            self._futures.add(fut)
        fut.add_done_callback(self._drop)  # (runs at once if it has already ended)
        return fut

    def _drop(self, fut: Future[Any]) -> None:
        with self._lock:
            self._futures.discard(fut)

    def wait(self) -> None:
        """Block until every future added so far has ended."""
        with self._lock:
            running = list(self._futures)
        for fut in running:
            fut.exception()  # waits; the outcome is for whoever holds the future


class StepSink(Protocol):
    """Receives every ended step (e.g. the DeepSpeed monitor, the Chrome trace file)."""

    def on_step(self, record: StepRecord) -> None: ...

    def close(self) -> None: ...


class Scheduler:
    """Side streams, thread pools and per-step telemetry for one rank.

    Parameters
    ----------
    config
        The ``"dsx"."scheduler"`` section.
    device
        The rank's device; side streams exist only for CUDA devices (on CPU, copies run on the I/O threads).
    """

    def __init__(self, config: SchedulerConfig | None = None, device: torch.device | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.device = device or (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.telemetry = StepTelemetry(keep_events=self.config.enabled and self.config.trace_path is not None)
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._streams: dict[str, Any] = {}
        self._pending: dict[str, list[Future[Any]]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._gates: dict[str, threading.Event] = {}
        self.gate_pauses: dict[str, int] = {}  # how often each gate was closed (shown in logs/tests)
        self.sinks: list[StepSink] = []
        # how I/O threads wait for the side streams' events (CUDA only: on CPU, copies run on the threads)
        self.waiter = EventWaiter(self.config.event_wait) if self.device.type == "cuda" else None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (a closed scheduler takes no work)."""
        return self._closed

    # ------------------------------------------------------------------------------------------ streams
    def stream(self, name: str) -> torch.cuda.Stream | None:
        """A named side stream on this rank's GPU (created once), or None on CPU."""
        if self.device.type != "cuda":
            return None
        with self._lock:
            if name not in self._streams:
                self._streams[name] = torch.cuda.Stream(device=self.device)
            return self._streams[name]

    # -------------------------------------------------------------------------------------------- pools
    def executor(self, pool: str) -> ThreadPoolExecutor:
        """The named thread pool (one of :data:`POOLS`), started on first use."""
        if pool not in POOLS:
            raise ValueError(f"dsx scheduler: unknown pool {pool!r}; the pools are {sorted(POOLS)}")
        with self._lock:
            if self._closed:
                raise RuntimeError("dsx scheduler is closed; submit work before engine.dsx.close()")
            if pool not in self._pools:
                workers = POOLS[pool] or self.config.io_workers
                self._pools[pool] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"dsx-{pool}")
            return self._pools[pool]

    # -------------------------------------------------------------------------------------------- gates
    def gate(self, name: str) -> threading.Event:
        """A named gate (open by default); I/O workers ``gate(name).wait()`` before using that device."""
        return self._gates.setdefault(name, _open_event())

    @contextmanager
    def paused(self, name: str) -> Iterator[None]:
        """Close gate ``name`` for the duration (e.g. DeepSpeed's optimizer swap on the shared SSD).

        Items already past the gate finish; new ones wait. The paused interval is recorded as a
        ``gate:<name>`` event in the telemetry.
        """
        g = self.gate(name)
        g.clear()
        self.gate_pauses[name] = self.gate_pauses.get(name, 0) + 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            g.set()
            self.telemetry.add_event(f"gate:{name}", "paused", t0, time.perf_counter())

    # --------------------------------------------------------------------------------------------- work
    def submit(
        self,
        fn: Callable[..., Any],
        *args: Any,
        pool: str = "io",
        deadline: str | None = None,
        **kwargs: Any,
    ) -> Future[Any]:
        """Run ``fn`` on a thread of ``pool``; if ``deadline`` is given, :meth:`wait` on it joins this item."""
        fut = self.executor(pool).submit(fn, *args, **kwargs)
        if deadline is not None:
            with self._lock:
                self._pending.setdefault(deadline, []).append(fut)
        return fut

    def wait(self, deadline: str) -> None:
        """Block until every item due at ``deadline`` is done; the blocked time counts as stall.

        A worker's exception is re-raised here, on the calling thread."""
        with self._lock:
            futs = self._pending.pop(deadline, [])
        if not futs:
            return
        t0 = time.perf_counter()
        try:
            for fut in futs:
                fut.result()
        finally:
            self.telemetry.add_stall(t0, time.perf_counter(), deadline)

    def forget(self, deadline: str) -> None:
        """Drop the items due at ``deadline`` without waiting (their consumer went away)."""
        with self._lock:
            self._pending.pop(deadline, None)

    def wait_all(self) -> None:
        with self._lock:
            keys = list(self._pending)
        for key in keys:
            self.wait(key)

    def add_sink(self, sink: StepSink) -> None:
        """Hand every step ended from now on to ``sink``; :meth:`close` closes it."""
        self.sinks.append(sink)

    def end_step(self) -> StepRecord:
        """Close the step (once per optimizer step) and pass its record to the sinks."""
        rec = self.telemetry.end_step()
        for sink in self.sinks:
            sink.on_step(rec)
        return rec

    def close(self) -> None:
        """Finish pending work, stop the threads, then close the sinks (the trace's last write); idempotent."""
        if self._closed:
            return
        try:
            self.wait_all()
        finally:
            with self._lock:
                self._closed = True
                pools = list(self._pools.values())
            for p in pools:
                p.shutdown(wait=True)
            for sink in self.sinks:
                sink.close()


def _open_event() -> threading.Event:
    ev = threading.Event()
    ev.set()
    return ev
