"""Tiers for offloaded activations: a preallocated host arena and a preallocated per-rank SSD file.

Both are carved by :class:`Arena`, a first-fit free list over one preallocated range with 4 KiB-aligned
offsets and sizes, so that steady-state training allocates nothing per step and every SSD transfer can use
O_DIRECT straight from a host slot (the slot *is* the aligned bounce buffer).
"""

from __future__ import annotations

import atexit
import bisect
import errno
import fcntl
import json
import logging
import os
import resource
import shutil
import threading
import uuid

import torch

from dsx.config import DsxConfigError
from dsx.offload.align import ALIGN, align_up, aligned_empty
from dsx.offload.io import IOBackend, select_backend
from dsx.runtime.host_memory import HostMemoryError, PinnedBuffer, require_host_bytes
from dsx.runtime.pinning import PinningError
from dsx.runtime.process import judge, owner_record, owner_tag, parse_owner_tag
from dsx.runtime.scheduler import Scheduler

__all__ = ["Arena", "HostPool", "RunDir", "SsdFile", "SsdFull", "clean_stale_runs"]

logger = logging.getLogger("dsx.offload")

OWNER = "owner.json"  # in each run directory: who made it (dsx.runtime.process.owner_record)


class SsdFull(OSError):
    """The SSD tier cannot take more bytes (real ENOSPC or the ``ssd_capacity_gb`` quota)."""


class Arena:
    """First-fit allocator of aligned ranges in ``[0, capacity)``; thread-safe; O(free blocks) per call."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity - capacity % ALIGN
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []  # sorted (off, len)
        self._lock = threading.Lock()
        self.used = 0
        self.high_water = 0

    def alloc(self, nbytes: int) -> int | None:
        size = align_up(max(nbytes, 1))
        with self._lock:
            for i, (off, ln) in enumerate(self._free):
                if ln >= size:
                    if ln == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, ln - size)
                    self.used += size
                    self.high_water = max(self.high_water, off + size)
                    return off
        return None

    def free(self, off: int, nbytes: int) -> None:
        size = align_up(max(nbytes, 1))
        with self._lock:
            i = bisect.bisect(self._free, (off, 0))
            self._free.insert(i, (off, size))
            # coalesce with the neighbours so that large blocks come back after a step
            if i + 1 < len(self._free) and off + size == self._free[i + 1][0]:
                self._free[i] = (off, size + self._free.pop(i + 1)[1])
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
                po, pl = self._free[i - 1]
                self._free[i - 1] = (po, pl + self._free.pop(i)[1])
            self.used -= size


class HostPool:
    """One preallocated host buffer (pinned when the compute device is CUDA), carved by an :class:`Arena`.

    The buffer is allocated once, on first use, and its start is 4 KiB-aligned so that every slot can be
    handed to O_DIRECT. Pinned memory is what lets the GPU→host copy run at PCIe speed asynchronously on a
    side stream. It is pinned in place (:class:`~dsx.runtime.host_memory.PinnedBuffer`: its pages faulted in
    on several threads, then registered), not with ``pin_memory=True``, whose allocation faults the pages in on
    one thread while it holds the CUDA driver, and so the training thread's kernel launches. Where the pages
    cannot be pinned in place (CUDA refuses them), it falls back to ``pin_memory=True`` and says so.
    """

    def __init__(self, nbytes: int, pin: bool, device: torch.device | None = None) -> None:
        self.arena = Arena(nbytes)
        self._pin = pin
        self._device = device  # the GPU it is pinned for: its pages go on that GPU's NUMA node
        self._buf: torch.Tensor | None = None
        self._pinned: PinnedBuffer | None = None
        # the I/O threads take staging slots while the training thread may release the buffer
        self._lock = threading.Lock()

    def allocate(self) -> None:
        """Allocate (and pin) the buffer now: at start-up a machine that cannot hold it is a
        :class:`~dsx.config.DsxConfigError` naming ``host_pool_gb``, not a failure in the middle of a forward."""
        try:
            with self._lock:
                self._buffer()
        except HostMemoryError as exc:
            raise DsxConfigError(f"dsx.activation_offload.host_pool_gb: {exc}") from None
        except (RuntimeError, MemoryError) as exc:
            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**30:.2f} GiB"
            what = "pin" if self._pin else "allocate"
            raise DsxConfigError(
                f"dsx.activation_offload.host_pool_gb: could not {what} {self.arena.capacity / 2**30:.2f} GiB "
                f"of host memory for the pool ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); lower "
                f"host_pool_gb (the ranks of a node share its memory; locked-memory limit here: {limit})"
            ) from None

    def release(self) -> bool:
        """Give the buffer back (unpinned) when nothing in it is in use: a plan that moves nothing need not
        keep ``host_pool_gb`` locked. Whether it did; :meth:`allocate` takes it again."""
        with self._lock:
            if self._buf is None or self.arena.used:
                return False
            if self._pinned is not None:
                # no slot in use means no copy queued on one (slots are freed behind their copies' events)
                self._pinned.close()
                self._pinned = None
            self._buf = None
            return True

    def _buffer(self) -> torch.Tensor:
        if self._buf is None:
            if not self._pin or self.arena.capacity < ALIGN:  # (no pool: nothing to pin)
                self._buf = aligned_empty(self.arena.capacity)
                return self._buf
            try:
                self._pinned = PinnedBuffer(self.arena.capacity, device=self._device)
                self._buf = self._pinned.tensor
            except PinningError as exc:
                logger.warning(
                    "dsx activation offload: the host pool cannot be pinned in place (%s); pinning it with "
                    "pin_memory=True instead, which holds the CUDA driver while it faults the pages in",
                    str(exc).splitlines()[0],
                )
                # torch's pinned-memory cache rounds the block up to a power of two: that much must be there
                need = 1 << (self.arena.capacity - 1).bit_length()
                require_host_bytes(
                    need, "pin_memory=True would pin", " (torch rounds the pool up to a power of two)"
                )
                self._buf = aligned_empty(self.arena.capacity, True)
        return self._buf

    def alloc(self, nbytes: int) -> tuple[int, torch.Tensor] | None:
        with self._lock:
            off = self.arena.alloc(nbytes)
            if off is None:
                return None
            try:
                return off, self._buffer()[off : off + align_up(max(nbytes, 1))]
            except BaseException:  # the buffer could not be made: the slot is not taken
                self.arena.free(off, nbytes)
                raise

    def free(self, off: int, nbytes: int) -> None:
        self.arena.free(off, nbytes)


# ------------------------------------------------------------------------------------------- run dirs
def _prefix() -> str:
    """The start of this user's run directories' names (another user's are never judged or touched)."""
    return f"dsx-u{os.getuid()}-"


def clean_stale_runs(root: str) -> list[str]:
    """Remove this user's ``root/dsx-u<uid>-*`` run directories that :func:`~dsx.runtime.process.judge` proves
    stale from their ``owner.json`` (their owner ended, here or before a reboot).

    A live run holds a lock on its owner record, so no sweep from any container takes it; directories of
    other machines or other containers' pid namespaces (an ``ssd_path`` on a shared drive) are left alone:
    their pids mean nothing here, and removing a live run's file would lose its activations.
    """
    removed = []
    if not os.path.isdir(root):
        return removed
    kept: list[str] = []
    for name in os.listdir(root):
        d = os.path.join(root, name)
        if not name.startswith(_prefix()) or not os.path.isdir(d):
            continue
        record_path = os.path.join(d, OWNER)
        try:
            with open(record_path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            # no record, or half of one: its owner was killed between making the directory and writing the
            # record (or is doing so now). The name says who that is; a name without it cannot be judged.
            record, record_path = parse_owner_tag(name), d
            if record is None:
                continue
        stale, why = judge(record if isinstance(record, dict) else None, record_path, locked_while_alive=True)
        if stale:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
        elif "runs" not in why:
            kept.append(f"{name} ({why})")
    if kept:
        logger.info("dsx: run dir(s) under %s left alone: %s", root, "; ".join(kept))
    return removed


class RunDir:
    """A private (0700) directory for one run and rank under ``root``, removed at close and at exit."""

    def __init__(self, root: str, rank: int) -> None:
        os.makedirs(root, exist_ok=True)
        stale = clean_stale_runs(root)
        if stale:
            logger.warning("dsx: removed %d leftover offload dir(s) of crashed runs: %s", len(stale), stale)
        # the name carries the owner too: a rank killed before its record is written is still judged
        self.path = os.path.join(root, f"{_prefix()}{owner_tag()}-r{rank}-{uuid.uuid4().hex[:8]}")
        os.mkdir(self.path, 0o700)
        self._lock = -1
        try:
            # the owner record, created exclusively and held locked while the run lives
            self._lock = os.open(os.path.join(self.path, OWNER), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(self._lock, fcntl.LOCK_EX)
            os.write(self._lock, json.dumps(owner_record()).encode())
        except BaseException:  # a constructor that raised is never removed by its caller: undo it here
            self.remove()
            raise
        atexit.register(self.remove)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1
        atexit.unregister(self.remove)


class SsdFile:
    """One file per rank, grown with ``posix_fallocate`` in chunks up to ``capacity`` bytes.

    Opened with O_DIRECT where the filesystem supports it (``direct`` says which, ``direct_reason`` why not).
    Space is reserved before a write is queued, so ENOSPC and the quota both surface synchronously as
    :class:`SsdFull` at the moment a layer tries to offload, never in the middle of a background write.
    Its I/O runs on ``scheduler``'s ``"ssd"`` pool (by default :func:`dsx.defaults.scheduler`'s).
    """

    GROW = 64 << 20

    def __init__(
        self, run_dir: RunDir, capacity: int, backend: str, scheduler: Scheduler | None = None
    ) -> None:
        self.path = os.path.join(run_dir.path, "activations.bin")
        self.arena = Arena(capacity)
        # created exclusively (never a file someone else made), readable by this user only
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        self.direct, self.direct_reason = False, "O_DIRECT unavailable on this platform"
        if hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(self.path, flags | os.O_DIRECT, 0o600)
                self.direct, self.direct_reason = True, "O_DIRECT"
            except OSError as exc:  # tmpfs and some overlay filesystems reject O_DIRECT with EINVAL
                if exc.errno == errno.EEXIST:
                    raise
                self.direct_reason = f"buffered I/O: O_DIRECT open failed ({os.strerror(exc.errno or 0)})"
        if not self.direct:
            # (the refused O_DIRECT open may have created the file already, in this run's private directory)
            self.fd = os.open(self.path, os.O_RDWR if os.path.exists(self.path) else flags, 0o600)
        self._allocated = 0
        self._lock = threading.Lock()
        try:
            self.io: IOBackend = select_backend(backend, self.path, self.fd, scheduler)
        except BaseException:
            os.close(self.fd)
            raise
        self.bytes_written = 0

    def _reserve(self, end: int) -> None:
        with self._lock:
            if end <= self._allocated:
                return
            # grow in chunks (fewer fallocate calls); near a full disk, retry with exactly what is needed
            for new in dict.fromkeys((min(max(end, self._allocated + self.GROW), self.arena.capacity), end)):
                try:
                    os.posix_fallocate(self.fd, self._allocated, new - self._allocated)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        if new != end:
                            continue
                        raise SsdFull(
                            exc.errno,
                            f"dsx SSD tier: {self.path}: {os.strerror(exc.errno)} "
                            f"(needed {end} bytes); free space on the drive or lower "
                            "ssd_capacity_gb",
                        ) from exc
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    os.ftruncate(self.fd, new)  # filesystem without fallocate: sparse file
                self._allocated = new
                return

    def alloc(self, nbytes: int) -> int:
        off = self.arena.alloc(nbytes)
        if off is None:
            raise SsdFull(
                errno.ENOSPC,
                f"dsx SSD tier: ssd_capacity_gb quota ({self.arena.capacity} bytes) "
                f"full; raise ssd_capacity_gb or memory_budget_gb",
            )
        try:
            self._reserve(off + align_up(nbytes))
        except BaseException:
            self.arena.free(off, nbytes)
            raise
        return off

    def free(self, off: int, nbytes: int) -> None:
        self.arena.free(off, nbytes)

    def close(self) -> None:
        self.io.close()
        os.close(self.fd)
