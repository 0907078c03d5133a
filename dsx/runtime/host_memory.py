"""Host buffers that start on a page (4 KiB): what O_DIRECT file I/O needs of its buffers, and where a table that
the GPU reads in place should start, so that its rows sit on PCIe's 128-byte lines (docs/unified.md, "Where the
table starts"). torch's own host allocations start on 64-byte boundaries.

A large pinned buffer is a :class:`PinnedBuffer`: ``torch.empty(..., pin_memory=True)`` goes through
``cudaHostAlloc``, which faults every page in on one thread and holds the CUDA driver while it does, so that
every other thread's CUDA calls wait as well; tens of GiB take tens of seconds. Faulting the pages in on
several threads first and then registering them in place (``cudaHostRegister``) is several times faster, and
only the registration holds the driver."""

from __future__ import annotations

import os
import weakref

import torch

from dsx.runtime import pinning

__all__ = ["PAGE", "PinnedBuffer", "available_host_bytes", "page_aligned_empty", "touch_pages"]

PAGE = 4096
GiB = 1 << 30


def page_aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """An uninitialised uint8 host buffer of ``nbytes`` whose first byte starts a page, pinned when ``pin``; at
    most one page more than ``torch.empty`` takes."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % PAGE
    return raw[skip : skip + nbytes]


def available_host_bytes() -> int | None:
    """The host memory the kernel says a new allocation can have without swapping (``MemAvailable`` of
    ``/proc/meminfo``); None where it does not say (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def touch_pages(buf: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """Write zeros over ``buf`` with at least ``threads`` intra-op threads (default: up to 8 of the CPUs this
    process may run on), so that the kernel maps every page now and on several cores; returns ``buf``.

    The process's intra-op thread count is raised for the fill alone and set back after it."""
    if threads is None:
        threads = min(8, len(os.sched_getaffinity(0)))
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, threads))
    try:
        return buf.zero_()
    finally:
        torch.set_num_threads(before)


class PinnedBuffer:
    """``nbytes`` of page-aligned host memory, zeroed and pinned in place with ``cudaHostRegister``.

    Copies between it and a GPU run asynchronously at the link's speed, as from ``pin_memory=True`` memory.
    :meth:`close` (or garbage collection) unregisters the pages once; views of :attr:`tensor` that outlive it
    stay valid host memory, no longer pinned. Raises :class:`~dsx.runtime.pinning.PinningError` when CUDA
    refuses to pin the pages (the locked-memory limit, or not enough memory), with what to change.
    """

    def __init__(self, nbytes: int, threads: int | None = None) -> None:
        avail = available_host_bytes()
        if avail is not None and nbytes > avail:
            # faulting the pages in past what the host has would end in the kernel's out-of-memory killer (a
            # SIGKILL, no message), where pin_memory=True returned an error
            raise pinning.PinningError(
                f"cannot pin {nbytes / GiB:.2f} GiB of host memory: only {avail / GiB:.2f} GiB are available "
                "on this host (MemAvailable); ask for less, or free host memory (the ranks of a node share it)"
            )
        self.tensor = touch_pages(page_aligned_empty(nbytes), threads)
        ptr = self.tensor.data_ptr() if nbytes > 0 else None
        if ptr is not None:
            pinning.register(ptr, nbytes)
        self._finalizer = weakref.finalize(self, pinning.unregister_at_finalization, ptr, self.tensor)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Unregister the pages (once; later calls do nothing)."""
        self._finalizer()
