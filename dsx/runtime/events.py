"""Host threads waiting for points on a CUDA stream.

dsx's I/O threads wait on the host for the copies whose bytes they then use: an SSD write starts once its copy
to the host slot ends, and a read's staging slot is reused, or its checksum compared, once its copy to the
device ends. (Host-tier writes need no thread: the threads queueing the GPU's work query their events,
``Mover.poll_writes``, and wait for one only at the write barrier and at close.) How the I/O threads (and those
two waits) wait is ``"dsx"."scheduler"."event_wait"``:

``"spin"``
    ``cudaEventSynchronize`` on a default event: the thread polls the driver at full speed, the GIL released,
    for as long as the copy runs; it sees the end at once, and keeps one CPU core busy per waiting thread.
``"poll"``
    ``cudaEventQuery`` with a sleep between queries growing from 20 µs to 0.5 ms: a finished copy is seen at
    most 0.5 ms late, and the threads use almost no CPU; but each query takes the GIL, which the thread
    queueing the GPU's work then waits for, so that thread runs slower.
``"auto"``
    ``"spin"``: the GPU's queue matters more than a core (``docs/scheduler.md`` has the measurements).

Two ways to sleep until the copy ends are not offered, because with either the thread that queues the forward's
work waited for the copies on the side stream, which is what the side stream is there to avoid
(``tests/offload/test_gpu.py::test_gpu_host_reads_wait_for_their_writes_on_the_gpu`` fails with them): events
made with ``cudaEventBlockingSync``, and a host function queued on the stream (``cuLaunchHostFunc``) posting a
semaphore the waiting thread sleeps on, which also delayed the stream at every function.
"""

from __future__ import annotations

import time

import torch

__all__ = ["EVENT_WAIT_MODES", "EventWaiter"]

EVENT_WAIT_MODES = ("auto", "poll", "spin")
_AUTO = "spin"
_POLL_FIRST_S, _POLL_MAX_S = 20e-6, 5e-4


class EventWaiter:
    """Waits on the host for CUDA events, the way ``mode`` says.

    Parameters
    ----------
    mode
        One of :data:`EVENT_WAIT_MODES`.
    """

    def __init__(self, mode: str = "auto") -> None:
        if mode not in EVENT_WAIT_MODES:
            raise ValueError(f"event_wait must be one of {EVENT_WAIT_MODES}, not {mode!r}")
        self.mode = _AUTO if mode == "auto" else mode

    def wait(self, event: torch.cuda.Event) -> None:
        """Return once ``event`` has completed (raises what CUDA raises for a failed stream)."""
        if self.mode == "spin":
            event.synchronize()
            return
        delay = _POLL_FIRST_S
        while not event.query():
            time.sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)
