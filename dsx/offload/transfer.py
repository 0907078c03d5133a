"""Moves one storage device → host (→ SSD) during forward and back during backward, asynchronously.

On CUDA, pack records an event on the compute stream; the device→host copy waits on it on the scheduler's
``"offload"`` side stream. The threads that queue the GPU's work see each copy end (an event query, in queue
order, at the layer hooks: :meth:`Mover.poll_writes`) and drop the device reference there (the memory goes
back to the caching allocator). A host-tier write without ``verify`` needs nothing more. An SSD write, or one
under ``verify``, needs the bytes on the host: an I/O thread waits for the copy's event (and drops the
device reference too, if no poll has yet) and writes the host slot to the file (or checksums it); the device
bytes do not wait for that thread (with every thread in a slow file write, they would: stop 22). On CPU the
I/O thread copies and drops the reference itself.
Reads go the other way (host-tier ones without ``verify`` queued on the thread that fetches, the others on I/O
threads); the consumer waits on a CUDA event, and on the host only when the data are not yet on their way
back (that wait is recorded as stall). A released entry's slots go back once its write and any read queued
from them have run on the GPU. How long the compute stream itself waits for a read's copy is timed with CUDA
events and recorded as GPU wait. On CPU the same code runs with the compute device being the CPU and plain
(unpinned) host buffers.

A read's device buffer comes from one of two caching-allocator pools (config ``read_pool``). The allocator
keeps one pool per stream: buffers allocated on the prefetch stream cannot reuse the blocks forward's moved
activations gave back to the compute stream, nor can the compute stream reuse theirs after backward, so a
tight budget fragments (an H100 run ran out of memory with 20.6 GiB reserved but unallocated). ``"compute"``
allocates on the compute stream where the read is issued, and the copy waits for the work queued there so
far (the block may be in use by it): one pool, but no copy starts before the GPU reaches the point of
issue. ``"prefetch"`` lets the copy start at once, a lead as large as the host's run-ahead.
"""

from __future__ import annotations

import copy
import errno
import heapq
import itertools
import logging
import threading
import time
import zlib
from collections import deque
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from dsx.offload.store import HostPool, SsdFile, SsdFull, align_up
from dsx.runtime.scheduler import Scheduler

__all__ = ["Entry", "Mover", "OffloadIntegrityError"]

logger = logging.getLogger("dsx.offload")


class OffloadIntegrityError(RuntimeError):
    """Data read back from a tier differs from what was written (``verify: true``)."""


@dataclass(eq=False)
class Entry:
    """One moved storage."""

    layer: int
    nbytes: int
    tier: str  # where it will live once written: "host" or "ssd"
    name: str
    refs: int = 0
    # the device bytes, alive until the device→host copy is seen to end (by an I/O thread, or poll_writes())
    src: torch.Tensor | None = None
    host: tuple[int, torch.Tensor] | None = None  # (arena offset, aligned slot)
    ssd_off: int | None = None
    crc: int | None = None
    written: Future[Any] | None = None  # an I/O thread's write (None for an inline one)
    fetched: Future[Any] | None = None
    consumed: bool = False  # a consumer waited for the read (its stream is ordered after the copy)
    released: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    # set once the device bytes are given back (the copy to the host was seen to end, or an I/O thread's
    # failed); an SSD entry is set before its file write, which needs only the host slot
    off_device: threading.Event = field(default_factory=threading.Event)
    copied: Any = None  # CUDA: the event after the device-to-host copy on the offload stream
    # written without an I/O thread (CUDA, host tier, no verify): poll_writes() also finishes the write
    inline: bool = False
    # released after a read was issued (CUDA): the slots go back once that read's copy has run (poll_writes)
    frees_after_read: bool = False


class Mover:
    """Owns the tiers and the copies; ``tiers`` is the config's ordered list (``"host"``, ``"ssd"``)."""

    def __init__(
        self,
        device: torch.device,
        scheduler: Scheduler,
        host: HostPool,
        ssd: SsdFile | None,
        verify: bool,
        ssd_gate: str = "ssd",
        read_pool: str = "compute",
    ) -> None:
        if read_pool not in ("compute", "prefetch"):
            raise ValueError(f"read_pool must be 'compute' or 'prefetch', got {read_pool!r}")
        self.device, self.sched, self.host, self.ssd, self.verify = device, scheduler, host, ssd, verify
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
        # writes whose copies have not been seen to end (CUDA), in the offload stream's order: (entry, queued)
        self._in_flight: deque[tuple[Entry, float]] = deque()
        self._in_flight_lock = threading.Lock()
        # every I/O thread's write not yet ended, released entries' included: the file closes after them (drain)
        self._writes: set[Future[Any]] = set()
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

    # --------------------------------------------------------------------------------------- write
    def offload(self, storage: torch.UntypedStorage, layer: int, tier: str, name: str) -> Entry | None:
        nbytes = storage.nbytes()
        if tier == "ssd" and (self.ssd is None or layer in self.demoted):
            tier = "host"
        slot = self.host.alloc(nbytes)  # the host slot is the tier (host) or the aligned staging (ssd)
        if slot is None:
            self._warn_once(
                "host-full",
                f"dsx activation offload: host pool full ({self.host.arena.capacity} "
                f"bytes, {self.host.arena.used} in use); layer {layer} keeps its activations on the "
                "device. Raise host_pool_gb to offload more.",
            )
            return None
        e = Entry(layer=layer, nbytes=nbytes, tier=tier, name=name, host=slot)
        if tier == "ssd":
            try:
                e.ssd_off = self.ssd.alloc(nbytes)  # reserve now: ENOSPC / quota surface here, synchronously
            except SsdFull as exc:
                self.demoted.add(layer)
                self._warn_once(
                    "ssd-full",
                    f"dsx activation offload: SSD tier full ({exc}); layer {layer} and "
                    "any other layer that hits this fall back to the host tier; training continues.",
                )
                e.tier = "host"
            except BaseException:  # any other error reserving the file's space: the staging slot goes back
                self.host.free(slot[0], nbytes)
                raise
        src = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))
        t0 = time.perf_counter()
        if self._cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            side = self.sched.stream("offload")
            with torch.cuda.stream(side):
                side.wait_event(ready)
                slot[1][:nbytes].copy_(src, non_blocking=True)
                # (not blocking=True: with I/O threads asleep in a blocking-sync event's synchronize, the
                # forward's own CUDA calls waited for the copies to end, on the H100: stop 18; how the I/O
                # thread waits is scheduler.event_wait)
                copied = torch.cuda.Event()
                copied.record(side)
            e.src, e.copied = src, copied
            # nothing to do on the host once the copy ends but drop src for a host-tier write: no I/O thread
            # waits for it (four threads spinning in cudaEventSynchronize slowed the thread queueing the
            # forward's kernels ~10x at times on the H100, and kept four cores busy per rank: stop 20)
            e.inline = e.tier == "host" and not self.verify
            with self._in_flight_lock:  # (every copy: src goes when it ends, whatever the I/O threads do)
                self._in_flight.append((e, t0))
            if not e.inline:
                e.written = self._submit_write(e, copied)
        else:
            e.src = src
            e.written = self._submit_write(e, None)
        with self._lock:
            self._entries.setdefault(layer, []).append(e)
        return e

    def _submit_write(self, e: Entry, copied: Any) -> Future[Any]:
        fut = self.sched.submit(self._finish_write, e, copied)
        with self._in_flight_lock:
            self._writes.add(fut)
        fut.add_done_callback(self._write_ended)
        return fut

    def _write_ended(self, fut: Future[Any]) -> None:
        with self._in_flight_lock:
            self._writes.discard(fut)

    def _finish_write(self, e: Entry, copied: Any) -> None:
        t0 = time.perf_counter()
        host = e.host[1]
        try:
            if copied is not None:
                self.sched.waiter.wait(copied)
            else:
                host[: e.nbytes].copy_(e.src)
        finally:
            e.src = None  # device memory returns to the allocator now
            e.off_device.set()
        if self.verify:
            e.crc = zlib.crc32(host[: e.nbytes].numpy())
        self.sched.telemetry.add_transfer("host", e.nbytes, t0, time.perf_counter(), e.name)
        if e.tier != "ssd":
            return
        t1 = time.perf_counter()
        self.sched.gate(self.ssd_gate).wait()  # DeepSpeed's optimizer swap on the same drive goes first
        try:
            self.ssd.io.pwrite(host[: align_up(e.nbytes)], e.ssd_off).result()
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # the bytes are still in the host slot: keep them there, demote the layer
            self.demoted.add(e.layer)
            self._warn_once(
                "ssd-full",
                f"dsx activation offload: SSD write failed ({exc}); layer {e.layer} "
                "falls back to the host tier; training continues.",
            )
            self.ssd.free(e.ssd_off, e.nbytes)
            e.ssd_off, e.tier = None, "host"
            return
        self.ssd.bytes_written += align_up(e.nbytes)
        self.sched.telemetry.add_transfer("ssd", e.nbytes, t1, time.perf_counter(), e.name)
        off, _ = e.host
        e.host = None
        self.host.free(off, e.nbytes)

    def poll_writes(self) -> None:
        """Drop the device bytes of the writes whose copies have ended (the memory goes back to the caching
        allocator, on this thread), finish the inline ones among them (give back the slots of those released
        meanwhile); and give back the slots of released entries whose reads have run (``_read_frees``).

        Copies on the offload stream end in the order they were queued, so this stops at the first that has
        not: one ``cudaEventQuery`` when nothing has ended. Called by the layer hooks where they hold no dsx
        lock: each moved tensor's pack, each layer's forward start, the forward's start and end, each unpack
        and layer's backward start, the end of backward and the step's end. Between those (the optimizer's
        step, a run of kept layers) an ended copy's memory waits for the next one; the write barrier waits
        for a copy itself (:meth:`wait_off_device`).
        """
        done: list[tuple[Entry, float]] = []
        try:
            with self._in_flight_lock:
                while self._in_flight and self._in_flight[0][0].copied.query():
                    done.append(self._in_flight.popleft())
        finally:  # (a CUDA error raised by a query: what was taken off the queue is still finished)
            now = time.perf_counter()
            for e, t0 in done:
                e.src = None  # device memory returns to the allocator now
                if not e.inline:  # an I/O thread checksums the host slot or writes it to the file; release()
                    # or that write frees the slots
                    e.off_device.set()
                    continue
                with e.lock:  # (release() decides under this lock whether the slots are still being written)
                    e.off_device.set()
                    released = e.released and not e.frees_after_read
                if released:
                    self._free_slots(e)
                # queued -> seen to end, as an I/O thread's wait measures it (queued -> its wait returns), so
                # the time includes up to one poll's delay
                self.sched.telemetry.add_transfer("host", e.nbytes, t0, now, e.name)
        if self._read_frees:
            read: list[Entry] = []
            with self._in_flight_lock:
                while self._read_frees and self._read_frees[0][3].query():
                    read.append(heapq.heappop(self._read_frees)[2])
            for e in read:
                self._free_slots(e)

    def wait_off_device(self, e: Entry) -> None:
        """Block until ``e``'s device bytes are given back (the write barrier)."""
        if e.copied is not None:
            self.sched.waiter.wait(e.copied)
            self.poll_writes()  # (every earlier copy has ended too: the stream's order)
        # (another thread's poll may have taken it off the queue and not yet dropped src)
        e.off_device.wait()

    # ---------------------------------------------------------------------------------------- read
    def fetch(self, e: Entry) -> Future[Any]:
        """Issue the read of ``e`` (once); call it on the thread that will use the data (compute or autograd).

        With ``read_pool="compute"`` on CUDA the device buffer is allocated here, from the current stream's
        pool, and an event recorded there orders the copy after the work queued so far (the block may be one
        that work still uses). Both happen on this thread, at the point of issue: an I/O thread recording on
        the compute stream would wait for room in its queue while the host runs ahead, and its event would
        land wherever the queue then ends, holding the copy back by as much.
        """
        with e.lock:
            if e.fetched is None:
                dst = None
                if self._cuda and self.read_pool == "compute":
                    out = torch.empty(e.nbytes, dtype=torch.uint8, device=self.device)
                    issued = torch.cuda.Event()
                    issued.record(torch.cuda.current_stream(self.device))
                    dst = (out, issued)
                if self._reads_inline(e):
                    e.fetched = self._read_inline(e, dst)
                else:
                    e.fetched = self.sched.submit(self._read, e, dst)
            return e.fetched

    def _reads_inline(self, e: Entry) -> bool:
        """Whether ``e``'s read needs no host wait: on CUDA, a host-tier entry (never on the SSD) without
        ``verify`` (a checksum needs the bytes on the host first), whose write did not fail. The copy back is
        then ordered after the copy out on the GPU (an event), and is queued on this thread."""
        return (
            self._cuda
            and e.copied is not None
            and e.tier == "host"
            and e.ssd_off is None
            and not self.verify
            and not (e.written is not None and e.written.done() and e.written.exception() is not None)
        )

    def _read_inline(self, e: Entry, dst: tuple[torch.Tensor, Any] | None) -> Future[Any]:
        """The read of a host-tier entry queued here, on the thread that fetches (caller holds ``e.lock``).

        An I/O thread would first wait, on the host, for the write to land (``written``) and for the pool's
        earlier tasks, the writes still in flight among them: with the host ahead of the GPU, the consumer
        then waited at unpack while the GPU ran dry (stop 18). Here the prefetch stream waits on the write's
        event instead and the host goes on.
        """
        fut: Future[Any] = Future()
        if e.released:
            fut.set_exception(_Dropped(e.name))
            return fut
        t0 = time.perf_counter()
        fut.set_result(self._copy_to_device(e.host[1], e.nbytes, dst, after=e.copied))
        self.sched.telemetry.add_transfer("host_read", e.nbytes, t0, time.perf_counter(), e.name)
        return fut

    def _copy_to_device(
        self, buf: torch.Tensor, nbytes: int, dst: tuple[torch.Tensor, Any] | None, after: Any = None
    ) -> tuple[torch.Tensor, Any, int]:
        """Queue ``buf[:nbytes]`` to the device on the prefetch stream, after ``dst``'s issue event and
        ``after`` (events); the buffer (``dst``'s, or one from the prefetch stream's pool), the copy's event
        and its place in the stream's order (``wait`` skips waits that an earlier one covers)."""
        side = self.sched.stream("prefetch")
        # (the number and the queueing under one lock: inline reads and I/O threads' reads share the stream)
        with self._read_lock, torch.cuda.stream(side):
            if dst is None:
                out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            else:  # (no record_stream(side) here: every freed block would wait for all the copies queued
                out, issued = dst  # before its free; only a buffer never read is marked so: _drop_unread)
                side.wait_event(issued)
            if after is not None:
                side.wait_event(after)
            out.copy_(buf[:nbytes], non_blocking=True)
            ev = torch.cuda.Event(enable_timing=True)  # the consumer times its wait against it
            ev.record(side)
            self._read_seq += 1
            return out, ev, self._read_seq

    def _read(self, e: Entry, dst: tuple[torch.Tensor, Any] | None = None) -> tuple[torch.Tensor, Any, int]:
        if e.written is not None:
            e.written.result()  # a failed write re-raises here
        if self._cuda:
            torch.cuda.set_device(self.device)  # I/O threads start on device 0; ranks may own another
        t0 = time.perf_counter()
        tmp = None
        try:
            with e.lock:
                # the graph was dropped before the read ran (release() gives the slots back): nothing will
                # consume it, and the slot it would read may already hold another tensor
                if e.released:
                    raise _Dropped(e.name)
                tier, host, ssd_off = e.tier, e.host, e.ssd_off
            if tier == "ssd":
                size = align_up(e.nbytes)
                tmp = self.host.alloc(size)
                buf = tmp[1] if tmp is not None else _aligned_host(size, self._cuda)
                self.ssd.io.pread(buf, ssd_off).result()
            else:
                buf = host[1]
            if self.verify and zlib.crc32(buf[: e.nbytes].numpy()) != e.crc:
                where = f"{self.ssd.path} offset {e.ssd_off}" if tier == "ssd" else "host pool"
                raise OffloadIntegrityError(
                    f"dsx activation offload: checksum mismatch reading back layer {e.layer} tensor {e.name} "
                    f"({e.nbytes} bytes) from the {tier} tier ({where}); the data are corrupt, refusing to "
                    "compute gradients from them"
                )
            if self._cuda:  # (an inline write may still be on its way to the slot: the copy waits for it)
                out, ev, seq = self._copy_to_device(buf, e.nbytes, dst, after=e.copied if e.inline else None)
                if tmp is not None:  # the staging slot is reused right after
                    self.sched.waiter.wait(ev)
            else:
                out, ev, seq = buf[: e.nbytes].clone(), None, 0
        finally:
            if tmp is not None:
                self.host.free(tmp[0], align_up(e.nbytes))
        self.sched.telemetry.add_transfer(f"{tier}_read", e.nbytes, t0, time.perf_counter(), e.name)
        return out, ev, seq

    def wait(self, e: Entry) -> torch.Tensor:
        fut = self.fetch(e)
        if not fut.done():
            t0 = time.perf_counter()
            futures.wait([fut])
            self.sched.telemetry.add_stall(t0, time.perf_counter(), f"unpack:layer{e.layer}")
        exc = fut.exception()
        if exc is not None:
            # raise a copy: raising the future's own exception would add this thread's frames (the autograd
            # graph, the loss) to the traceback the entry keeps, and nothing of that graph would ever be freed
            err = copy.copy(exc)
            err.__cause__, err.__traceback__ = exc.__cause__, None
            raise err
        out, ev, seq = fut.result()
        if ev is not None:
            cur = torch.cuda.current_stream(self.device)
            # copies on the prefetch stream end in the order they were queued: once this stream waits for one,
            # every earlier one is covered. A layer's reads are queued in save order and unpacked mostly in
            # reverse, so its first unpack's wait covers the rest (on the H100, a cross-stream wait per saved
            # tensor left the compute stream idle ~0.2 ms each, dozens a step: stop 19)
            stream = cur.cuda_stream
            if self._waited.get(stream, 0) < seq:
                reached = torch.cuda.Event(enable_timing=True)
                reached.record(cur)
                cur.wait_event(ev)  # a device-side wait: the host goes on queueing kernels
                self._waited[stream] = seq  # (after the wait is queued: another thread may read it)
                self.device_waits += 1
                self.sched.telemetry.add_gpu_wait(reached, ev, f"unpack:layer{e.layer}")
            if self.read_pool == "prefetch":
                out.record_stream(cur)
        e.consumed = True
        return out

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
        with self._in_flight_lock:
            every = list(self._writes)
        futures.wait(every)
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


class _Dropped(RuntimeError):
    """A read found its entry released (the graph was dropped before the read ran)."""


def _aligned_host(size: int, pin: bool) -> torch.Tensor:
    raw = torch.empty(size + 4096, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % 4096
    return raw[skip : skip + size]
