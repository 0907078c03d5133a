"""Host threads waiting for points on a CUDA stream.

dsx's I/O threads wait on the host for the device-to-host copies whose bytes they then use: an SSD write
starts once its copy to the host slot ends, a write under ``verify`` checksums the slot, and an SSD read's
staging slot is reused once its copy to the device ends. (Host-tier writes without ``verify`` need no thread:
the threads queueing the GPU's work query their events, ``Mover.poll_writes``, and wait for one only at the
write barrier and at close.) How the I/O threads (and those two waits) wait is
``"dsx"."scheduler"."event_wait"``:

``"spin"``
    ``cudaEventSynchronize`` on a default event: the thread polls the driver at full speed, the GIL released,
    for as long as the copy runs; it sees the end at once, and keeps one CPU core busy per waiting thread
    (3.7 busy cores with four waiters in ``benchmarks/diag_event_wait.py`` on the H100 machine).
``"poll"``
    ``cudaEventQuery`` with a sleep between queries growing from 20 µs to 0.5 ms: a finished copy is seen at
    most 0.5 ms late, and the threads use almost no CPU; but each query takes the GIL, which the thread
    queueing the GPU's work then waits for (with four waiters, a pure-Python loop on that thread ran 1.5x
    as long in the same diagnostic, kernel launches 1.16x).
``"auto"``
    ``"spin"`` (see ``docs/scheduler.md`` for the measurements behind the choice).

Two ways to sleep until the copy ends were measured and are not offered, because with either the thread that
queues the forward's work waited for the copies on the side stream, which is what the side stream is there to
avoid (``tests/test_offload_gpu.py::test_gpu_host_reads_wait_for_their_writes_on_the_gpu`` fails with them):
events made with ``cudaEventBlockingSync`` (stop 18, ``docs/logs/s18-blocking-events-diag.log``), and a host
function queued on the stream (``cuLaunchHostFunc``) posting a semaphore that the waiting thread sleeps on (stop
19); the latter also delayed the stream by ~0.2 ms per function.
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
