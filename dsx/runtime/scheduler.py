"""One scheduler per rank: it owns the side streams and the I/O worker threads.

Work items are submitted with the point by which they must be done (a label such as ``"bwd:layer3"``);
the consumer waits on that label. Waiting is recorded as exposed stall time, the only time that the
overlap failed to hide.
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

__all__ = ["Scheduler", "StepSink"]


class StepSink(Protocol):
    """Receives every ended step (e.g. the DeepSpeed monitor, the Chrome trace file)."""

    def on_step(self, record: StepRecord) -> None: ...

    def close(self) -> None: ...


class Scheduler:
    """Side streams, an I/O thread pool and per-step telemetry for one rank.

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
        self._pool = ThreadPoolExecutor(max_workers=self.config.io_workers, thread_name_prefix="dsx-io")
        self._streams: dict[str, Any] = {}
        self._pending: dict[str, list[Future[Any]]] = {}
        self._closed = False
        self._gates: dict[str, threading.Event] = {}
        self.gate_pauses: dict[str, int] = {}  # how often each gate was closed (shown in logs/tests)
        self.sinks: list[StepSink] = []
        # how I/O threads wait for the side streams' events (CUDA only: on CPU, copies run on the threads)
        self.waiter = EventWaiter(self.config.event_wait) if self.device.type == "cuda" else None

    # ------------------------------------------------------------------------------------------ streams
    def stream(self, name: str) -> torch.cuda.Stream | None:
        """A named side stream on this rank's GPU (created once), or None on CPU."""
        if self.device.type != "cuda":
            return None
        if name not in self._streams:
            self._streams[name] = torch.cuda.Stream(device=self.device)
        return self._streams[name]

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
        self, fn: Callable[..., Any], *args: Any, deadline: str | None = None, **kwargs: Any
    ) -> Future[Any]:
        """Run ``fn`` on an I/O thread; if ``deadline`` is given, :meth:`wait` on it joins this item."""
        if self._closed:
            raise RuntimeError("dsx scheduler is closed; submit work before engine.dsx.close()")
        fut = self._pool.submit(fn, *args, **kwargs)
        if deadline is not None:
            self._pending.setdefault(deadline, []).append(fut)
        return fut

    def wait(self, deadline: str) -> None:
        """Block until every item due at ``deadline`` is done; the blocked time counts as stall."""
        futs = self._pending.pop(deadline, [])
        if not futs:
            return
        t0 = time.perf_counter()
        for fut in futs:
            fut.result()  # re-raises the worker's exception here, on the compute thread
        t1 = time.perf_counter()
        self.telemetry.add_stall(t0, t1, deadline)

    def wait_all(self) -> None:
        for key in list(self._pending):
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
        """Finish pending work, stop the I/O threads, then close the sinks (the trace's last write)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_all()
        finally:
            self._pool.shutdown(wait=True)
            for sink in self.sinks:
                sink.close()


def _open_event() -> threading.Event:
    ev = threading.Event()
    ev.set()
    return ev
