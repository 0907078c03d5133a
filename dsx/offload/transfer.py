"""Moves one storage device → host (→ SSD) during forward and back during backward, asynchronously.

:class:`Mover` owns the tiers and the copies. Its write path (:mod:`dsx.offload.writes`: copies off the device,
the polls that see them end, the file writes) and its read path (:mod:`dsx.offload.reads`: copies back, the
consumer's wait) are its two halves; here are the entries it holds, their release and the drain at close. A
released entry's slots go back once its write and any read queued from them have run on the GPU.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

import torch

from dsx.offload.entry import Entry, OffloadIntegrityError
from dsx.offload.reads import ReadPath
from dsx.offload.store import HostPool, SsdFile
from dsx.offload.writes import WritePath
from dsx.runtime.scheduler import FutureSet, Scheduler

__all__ = ["Entry", "Mover", "OffloadIntegrityError"]

logger = logging.getLogger("dsx.offload")


class Mover(WritePath, ReadPath):
    """Owns the tiers and the copies; ``tiers`` is the config's ordered list (``"host"``, ``"ssd"``)."""

    def __init__(
        self,
        device: torch.device,
        scheduler: Scheduler,
        host: HostPool,
        ssd: SsdFile | None,
        verify: set[str] | frozenset[str],
        ssd_gate: str = "ssd",
        read_pool: str = "compute",
    ) -> None:
        if read_pool not in ("compute", "prefetch"):
            raise ValueError(f"read_pool must be 'compute' or 'prefetch', got {read_pool!r}")
        self.device, self.sched, self.host, self.ssd = device, scheduler, host, ssd
        self.verify = frozenset(verify)  # the tiers whose read-backs are checked against a checksum
        self.ssd_gate = ssd_gate
        self.read_pool = read_pool  # which stream's allocator pool read buffers come from (config read_pool)
        self._cuda = device.type == "cuda"
        self._entries: dict[int, list[Entry]] = {}
        self._lock = threading.Lock()  # (handle finalizers only queue releases: LayerHooks.release_dead)
        self._warned: set[str] = set()
        self._read_lock = threading.Lock()
        self._read_seq = 0  # reads queued on the prefetch stream so far (CUDA)
        self._waited: dict[int, int] = {}  # consumer stream -> the latest read (its number) it waited for
        self.device_waits = 0  # device-side waits for reads queued so far (fewer than reads: ``wait``)
        self.demoted: set[int] = set()  # layers whose SSD writes failed: host from now on
        # host-tier writes go to the SSD tier once the pool would keep less than this many staging slots of
        # the largest such tensor seen (0: never; policy auto's profiling steps under profile_mode
        # recompute+host, where no plan has sized the pool yet)
        self.overflow_slots = 0
        self._overflow_size = 0  # the largest host-tier write seen while overflowing is on
        # writes whose copies have not been seen to end (CUDA), in the offload stream's order: (entry, queued)
        self._in_flight: deque[tuple[Entry, float]] = deque()
        self._in_flight_lock = threading.Lock()
        # every I/O thread's write not yet ended, released entries' included: the file closes after them (drain)
        self._writes = FutureSet()
        # released entries whose reads may still be queued on the GPU: (read's number, tiebreak, entry, its
        # event), a heap in the prefetch stream's order; poll_writes() frees their slots once the copy ran
        self._read_frees: list[tuple[int, int, Entry, Any]] = []
        self._tiebreak = itertools.count()
        if self._cuda:  # create both side streams here, not lazily from I/O threads
            scheduler.stream("offload")
            scheduler.stream("prefetch")

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg)

    def entries_of(self, layer: int) -> list[Entry]:
        with self._lock:
            return list(self._entries.get(layer, ()))

    # ------------------------------------------------------------------------------------- release
    def release(self, e: Entry) -> None:
        """All handles of ``e`` are gone (the graph was freed): give its slots back once its write, and a read
        queued from them, have run."""
        with e.lock:  # (a read that has not started yet sees released and gives up: _read)
            e.released = True
            fetched, e.fetched = e.fetched, None
            e.frees_after_read = fetched is not None and self._cuda
            # an inline write still copying into the host slot: poll_writes() frees the slots once it ends (an
            # SSD read's staging in a reused slot would be overwritten by the copy)
            in_flight = e.inline and not e.off_device.is_set()
        with self._lock:
            lst = self._entries.get(e.layer)
            if lst is not None and e in lst:
                lst.remove(e)
        if fetched is not None and not e.consumed and self._cuda:
            # read but never used (the graph was dropped): no stream is ordered after the copy yet
            fetched.add_done_callback(self._drop_unread)
        if fetched is not None and self._cuda:
            # the host runs ahead of the GPU: the read's copy back may not have run yet, and a slot given back
            # now could be rewritten from the host first (an SSD read's staging pread) — a wrong gradient.
            # (Device-side writers of the slot are ordered after it: a consumed read's next users wait on the
            # compute stream, which waited for the copy.) Its write has ended by the time the read runs.
            fetched.add_done_callback(lambda f: self._free_after_read(e, f))
            return
        if in_flight:
            return
        if e.written is None or e.written.done():
            self._free_slots(e)
        else:
            e.written.add_done_callback(lambda _: self._free_slots(e))

    def _free_after_read(self, e: Entry, fut: Future[Any]) -> None:
        """Free ``e``'s slots once the read ``fut`` queued has run on the GPU (``poll_writes`` sees its event)."""
        ev = fut.result()[1] if fut.exception() is None else None
        if ev is None:  # nothing was queued (a dropped read, an error): nothing reads the slot
            self._free_slots(e)
            return
        with self._in_flight_lock:
            heapq.heappush(self._read_frees, (fut.result()[2], next(self._tiebreak), e, ev))

    def _free_slots(self, e: Entry) -> None:
        with e.lock:  # (idempotent: the read's and the write's ends may both come here)
            host, e.host = e.host, None
            ssd_off, e.ssd_off = e.ssd_off, None
        if host is not None:
            self.host.free(host[0], e.nbytes)
        if ssd_off is not None:
            self.ssd.free(ssd_off, e.nbytes)

    def _drop_unread(self, fut: Future[Any]) -> None:
        """A read's buffer that nothing consumed goes back to the allocator behind its copy, without a host wait.

        (This runs at once, on the releasing thread, when the read was queued inline: a host synchronize here
        would stall the thread queueing the GPU's work until the copy ended.) A buffer of the prefetch stream's
        pool is reused only by later work on that stream, which the copy precedes; one of the compute stream's
        pool is marked as used by the prefetch stream, so the allocator reuses it once that stream passes
        every copy queued by now (later than needed where those wait on the compute stream: memory held a little
        longer, under a budget, in the rare case of a dropped graph).
        """
        if fut.exception() is None and self.read_pool == "compute":
            fut.result()[0].record_stream(self.sched.stream("prefetch"))

    def drain(self) -> None:
        """Wait for every write queued so far (I/O threads' and inline ones) and finish it; a failed write
        of an entry still held re-raises here. Released entries' file writes are waited for too: the file
        may be closed next, and a write still queued would then run on a closed (or reused) descriptor."""
        with self._lock:
            futs = [e.written for lst in self._entries.values() for e in lst if e.written is not None]
        self._writes.wait()
        for f in futs:
            f.result()
        with self._in_flight_lock:
            queued = [e for e, _ in self._in_flight]
        if queued:
            self.sched.waiter.wait(queued[-1].copied)
        with self._in_flight_lock:  # (reads end in queue order: the last one queued covers the rest)
            last_read = max(self._read_frees)[3] if self._read_frees else None
        if last_read is not None:
            self.sched.waiter.wait(last_read)
        self.poll_writes()
        for e in queued:  # (another thread's poll may still be finishing some)
            e.off_device.wait()
