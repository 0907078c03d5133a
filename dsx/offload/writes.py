"""The write half of :class:`~dsx.offload.transfer.Mover`: one storage device → host (→ SSD) during forward.

On CUDA, pack records an event on the compute stream; the device→host copy waits on it on the scheduler's
``"offload"`` side stream. The threads that queue the GPU's work see each copy end (an event query, in queue
order, at the layer hooks: :meth:`WritePath.poll_writes`) and drop the device reference there (the memory goes
back to the caching allocator). A host-tier write needs nothing more. An SSD write needs the bytes on the host:
an I/O thread waits for the copy's event (and drops the device reference too, if no poll has yet) and writes
the host slot to the file; the device bytes do not wait for that thread (with every thread in a slow file
write, they would stay on the device behind it). On CPU the I/O thread copies and drops the reference itself.

A verified tier's entry (config ``verify``) also gets a checksum of its device bytes
(:mod:`dsx.offload.checksum`), queued on the offload stream before the copy, its 24 bytes copied to the host
with it; the read path checks the bytes that come back against it.
"""

from __future__ import annotations

import errno
import heapq
import time
from concurrent.futures import Future
from typing import Any

import torch

from dsx.offload.align import align_up
from dsx.offload.checksum import checksum
from dsx.offload.entry import Entry
from dsx.offload.store import SsdFull
from dsx.runtime.streams import current_stream, on_stream

__all__ = ["WritePath"]


class WritePath:
    """:class:`~dsx.offload.transfer.Mover`'s writes and the polls that finish them; the state they share
    with the reads and releases is set up in ``Mover.__init__``."""

    def offload(self, storage: torch.UntypedStorage, layer: int, tier: str, name: str) -> Entry | None:
        nbytes = storage.nbytes()
        if tier == "ssd" and (self.ssd is None or layer in self.demoted):
            tier = "host"
        elif tier == "host" and self.overflow_slots and self.ssd is not None and layer not in self.demoted:
            # a write that would leave the pool fewer staging slots than the drive's writes and reads need
            # (sized by the largest tensor seen, so that small ones do not take a large one's room) goes to the
            # drive, staged through that room, so that the tensors after it leave the device too
            size = align_up(max(nbytes, 1))
            self._overflow_size = max(self._overflow_size, size)
            room = self.host.arena.capacity - self.host.arena.used - size
            if room < self.overflow_slots * self._overflow_size:
                tier = "ssd"
        slot = self.host.alloc(nbytes)  # the host slot is the tier (host) or the aligned staging (ssd)
        if slot is None:
            slot = self._alloc_after_staged_writes(nbytes, layer)
        if slot is None:
            self._warn_once(
                "host-full",
                f"dsx activation offload: host pool full ({self.host.arena.capacity} "
                f"bytes, {self.host.arena.used} in use); layer {layer} keeps its activations on the "
                "device. Raise host_pool_gb to offload more (or, while policy auto profiles with profile_mode "
                'recompute+host, add "ssd" to tiers with an ssd_path: the inputs the pool cannot hold go there).',
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
            ready.record(current_stream(self.device))
            side = self.sched.stream("offload")
            with on_stream(side):
                side.wait_event(ready)
                if e.tier in self.verify:  # the checksum of the bytes as they are on the device
                    e.checksum = torch.empty(3, dtype=torch.int64, pin_memory=True)
                    e.checksum.copy_(checksum(src), non_blocking=True)
                slot[1][:nbytes].copy_(src, non_blocking=True)
                # (not blocking=True: with I/O threads asleep in a blocking-sync event's synchronize, the
                # forward's own CUDA calls waited for the copies to end; how the I/O thread waits is
                # scheduler.event_wait)
                copied = torch.cuda.Event()
                copied.record(side)
            e.src, e.copied = src, copied
            # nothing to do on the host once the copy ends but drop src for a host-tier write: no I/O thread
            # waits for it (threads spinning in cudaEventSynchronize slowed the thread queueing the forward's
            # kernels many times over at times, and kept a core busy each)
            e.inline = e.tier == "host"  # (a verified entry's checksum is queued on the GPU with its copy)
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

    def _alloc_after_staged_writes(self, nbytes: int, layer: int) -> tuple[int, torch.Tensor] | None:
        """A host slot once SSD writes still holding their staging give it back, the first staged first (None if
        waiting for all of them could not make the room, and the pool is still full). The wait is a stall
        (``pool-full`` in the telemetry), where keeping the tensor on the device instead would break the plan's
        memory budget: the plan counts each staging slot free once its copy and file write end at the rates it
        measured, and writes that end later leave the pool full."""
        # (not while the drive's gate is shut, as for DeepSpeed's optimizer swap: the writes wait for it, and the
        # thread that shut it may be this one)
        if self.ssd is None or not self.sched.gate(self.ssd_gate).is_set():
            return None
        size = align_up(max(nbytes, 1))
        t0, waited = time.perf_counter(), False
        while True:
            with self._lock:
                staged = [
                    (e.written, e.nbytes)
                    for lst in self._entries.values()
                    for e in lst
                    if e.tier == "ssd"
                    and e.host is not None
                    and e.written is not None
                    and not e.written.done()
                ]
            arena = self.host.arena
            if not staged or arena.capacity - arena.used + sum(align_up(n) for _, n in staged) < size:
                slot = self.host.alloc(nbytes)  # (a write may have ended since the first try)
                break
            waited = True
            # (waits without raising: a failed write re-raises where its entry is read, or at drain)
            staged[0][0].exception()
            slot = self.host.alloc(nbytes)
            if slot is not None:
                break
        if waited:
            self.sched.telemetry.add_stall(t0, time.perf_counter(), f"pool-full:layer{layer}")
        return slot

    def _submit_write(self, e: Entry, copied: Any) -> Future[Any]:
        return self._writes.add(self.sched.submit(self._finish_write, e, copied))

    def _finish_write(self, e: Entry, copied: Any) -> None:
        t0 = time.perf_counter()
        host = e.host[1]
        try:
            if copied is not None:
                self.sched.waiter.wait(copied)
            else:
                if e.tier in self.verify:
                    e.checksum = checksum(e.src)
                host[: e.nbytes].copy_(e.src)
        finally:
            e.src = None  # device memory returns to the allocator now
            e.off_device.set()
        self.sched.telemetry.add_transfer("host", e.nbytes, t0, time.perf_counter(), e.name)
        if e.tier != "ssd":
            return
        self.sched.gate(self.ssd_gate).wait()  # DeepSpeed's optimizer swap on the same drive goes first
        t1 = time.perf_counter()  # (the drive's span alone, as a read's)
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
                if not e.inline:  # an I/O thread writes the host slot to the file; release() or that write
                    # frees the slots
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
