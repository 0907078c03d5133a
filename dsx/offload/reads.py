"""The read half of :class:`~dsx.offload.transfer.Mover`: a moved storage back to the device in backward.

Host-tier reads of unverified entries are queued on the thread that fetches, the others on I/O threads; the
consumer waits on a CUDA event, and on the host only when the data are not yet on their way back (that wait is
recorded as stall). A verified entry's bytes are checksummed on the prefetch stream right after their copy
back, and the I/O thread compares that with the checksum taken when they were written before it hands them
over: a corrupt read is an :class:`~dsx.offload.entry.OffloadIntegrityError` naming layer, tier, file and
offset, and no gradient is computed from unverified bytes. How long the compute stream itself waits for a read,
for its copy or idle while the host waits for it, is timed with CUDA events and recorded as GPU wait. On CPU
the same code runs with the compute device being the CPU and plain (unpinned) host buffers.

A read's device buffer comes from one of two caching-allocator pools (config ``read_pool``). The allocator
keeps one pool per stream: buffers allocated on the prefetch stream cannot reuse the blocks forward's moved
activations gave back to the compute stream, nor can the compute stream reuse theirs after backward, so a
tight budget fragments (memory reserved but unallocated runs out). ``"compute"`` allocates on the compute
stream where the read is issued, and the copy waits for the work queued there so far (the block may be in use
by it): one pool, but no copy starts before the GPU reaches the point of issue. ``"prefetch"`` lets the copy
start at once, a lead as large as the host's run-ahead.
"""

from __future__ import annotations

import copy
import time
from concurrent import futures
from concurrent.futures import Future
from typing import Any

import torch

from dsx.offload.align import align_up, aligned_empty
from dsx.offload.checksum import checksum, mismatch
from dsx.offload.entry import Entry, OffloadIntegrityError
from dsx.runtime.streams import current_stream, on_stream

__all__ = ["ReadPath"]


class ReadPath:
    """:class:`~dsx.offload.transfer.Mover`'s reads and the consumer's wait for them; the state they share
    with the writes and releases is set up in ``Mover.__init__``."""

    @property
    def buffer_at_issue(self) -> bool:
        """Whether a read's device buffer is allocated when the read is asked for (``fetch``), not when it runs:
        with ``read_pool="compute"`` on CUDA."""
        return self._cuda and self.read_pool == "compute"

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
                if self.buffer_at_issue:
                    out = torch.empty(e.nbytes, dtype=torch.uint8, device=self.device)
                    issued = torch.cuda.Event()
                    issued.record(current_stream(self.device))
                    dst = (out, issued)
                if self._reads_inline(e):
                    e.fetched = self._read_inline(e, dst)
                else:
                    e.fetched = self.sched.submit(self._read, e, dst)
            return e.fetched

    def _reads_inline(self, e: Entry) -> bool:
        """Whether ``e``'s read needs no host wait: on CUDA, a host-tier entry (never on the SSD) that is not
        verified (its check waits on the host), whose write did not fail. The copy back is then ordered after
        the copy out on the GPU (an event), and is queued on this thread."""
        return (
            self._cuda
            and e.copied is not None
            and e.tier == "host"
            and e.ssd_off is None
            and e.checksum is None
            and not (e.written is not None and e.written.done() and e.written.exception() is not None)
        )

    def _read_inline(self, e: Entry, dst: tuple[torch.Tensor, Any] | None) -> Future[Any]:
        """The read of a host-tier entry queued here, on the thread that fetches (caller holds ``e.lock``).

        An I/O thread would first wait, on the host, for the write to land (``written``) and for the pool's
        earlier tasks, the writes still in flight among them: with the host ahead of the GPU, the consumer
        then waited at unpack while the GPU ran dry. Here the prefetch stream waits on the write's
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
        self,
        buf: torch.Tensor,
        nbytes: int,
        dst: tuple[torch.Tensor, Any] | None,
        after: Any = None,
        check: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Any, int]:
        """Queue ``buf[:nbytes]`` to the device on the prefetch stream, after ``dst``'s issue event and
        ``after`` (events), and with ``check`` (a pinned int64[3]) the checksum of what arrived; the buffer
        (``dst``'s, or one from the prefetch stream's pool), the event after both and its place in the
        stream's order (``wait`` skips waits that an earlier one covers)."""
        side = self.sched.stream("prefetch")
        # (the number and the queueing under one lock: inline reads and I/O threads' reads share the stream)
        with self._read_lock, on_stream(side):
            if dst is None:
                out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            else:  # (no record_stream(side) here: every freed block would wait for all the copies queued
                out, issued = dst  # before its free; only a buffer never read is marked so: _drop_unread)
                side.wait_event(issued)
            if after is not None:
                side.wait_event(after)
            out.copy_(buf[:nbytes], non_blocking=True)
            if check is not None:
                check.copy_(checksum(out), non_blocking=True)
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
                buf = tmp[1] if tmp is not None else aligned_empty(size, self._cuda)
                t_drive = time.perf_counter()
                self.ssd.io.pread(buf, ssd_off).result()
                # the drive's span alone: the copy on to the device, which may wait for the GPU to reach the
                # read's point of issue, is not the drive's time (a wait it causes is the consumer's GPU wait);
                # bytes that then fail their check were still read by the drive
                self.sched.telemetry.add_transfer("ssd_read", e.nbytes, t_drive, time.perf_counter(), e.name)
            else:
                buf = host[1]
            got = None
            if self._cuda:  # (an inline write may still be on its way to the slot: the copy waits for it)
                if e.checksum is not None:
                    got = torch.empty(3, dtype=torch.int64, pin_memory=True)
                after = e.copied if e.inline else None
                out, ev, seq = self._copy_to_device(buf, e.nbytes, dst, after=after, check=got)
                if tmp is not None or got is not None:  # the staging slot is reused right after; the check
                    self.sched.waiter.wait(ev)
            else:
                out, ev, seq = buf[: e.nbytes].clone(), None, 0
                got = checksum(out) if e.checksum is not None else None
            if got is not None and mismatch(e.checksum, got):
                where = f"{self.ssd.path} offset {ssd_off}" if ssd_off is not None else "host pool"
                raise OffloadIntegrityError(
                    f"dsx activation offload: checksum mismatch reading back layer {e.layer} tensor {e.name} "
                    f"({e.nbytes} bytes) from the {tier} tier ({where}); the data are corrupt, refusing to "
                    "compute gradients from them"
                )
        finally:
            if tmp is not None:
                self.host.free(tmp[0], align_up(e.nbytes))
        if tier != "ssd":
            self.sched.telemetry.add_transfer(f"{tier}_read", e.nbytes, t0, time.perf_counter(), e.name)
        return out, ev, seq

    def wait(self, e: Entry) -> torch.Tensor:
        fut = self.fetch(e)
        if not fut.done():
            name = f"unpack:layer{e.layer}"
            # what the host's wait costs the GPU: the time it idles once its queued work ran out
            if self._cuda:
                reached = torch.cuda.Event(enable_timing=True)
                reached.record(current_stream(self.device))
            t0 = time.perf_counter()
            futures.wait([fut])
            self.sched.telemetry.add_stall(t0, time.perf_counter(), name)
            if self._cuda:
                resumed = torch.cuda.Event(enable_timing=True)
                resumed.record(current_stream(self.device))
                self.sched.telemetry.add_gpu_wait(reached, resumed, name)
        exc = fut.exception()
        if exc is not None:
            # raise a copy: raising the future's own exception would add this thread's frames (the autograd
            # graph, the loss) to the traceback the entry keeps, and nothing of that graph would ever be freed
            err = copy.copy(exc)
            err.__cause__, err.__traceback__ = exc.__cause__, None
            raise err
        out, ev, seq = fut.result()
        if ev is not None:
            cur = current_stream(self.device)
            # copies on the prefetch stream end in the order they were queued: once this stream waits for one,
            # every earlier one is covered. A layer's reads are queued in save order and unpacked mostly in
            # reverse, so its first unpack's wait covers the rest (a cross-stream wait per saved tensor left the
            # compute stream idle at each of them, dozens of times a step)
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


class _Dropped(RuntimeError):
    """A read found its entry released (the graph was dropped before the read ran)."""
