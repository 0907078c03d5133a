"""Host buffers that start on a page (4 KiB): what O_DIRECT file I/O needs of its buffers, and where a table that
the GPU reads in place should start, so that its rows sit on PCIe's 128-byte lines (docs/unified.md, "Where the
table starts"). torch's own host allocations start on 64-byte boundaries.

A large pinned buffer is a :class:`PinnedBuffer`: ``torch.empty(..., pin_memory=True)`` goes through
``cudaHostAlloc``, which faults every page in on one thread while it holds the CUDA driver, so that every other
thread's CUDA calls wait too. A :class:`PinnedBuffer` faults its pages in on several threads first, then
registers them in place (``cudaHostRegister``): only the registration holds the driver."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dsx.runtime import pinning

__all__ = [
    "PAGE",
    "HostMemoryError",
    "PinnedBuffer",
    "available_host_bytes",
    "device_table",
    "page_aligned_empty",
    "require_host_bytes",
    "touch_pages",
    "unforked_empty",
]

PAGE = 4096
GiB = 1 << 30


class HostMemoryError(MemoryError):
    """The host has less memory available than a buffer asks for (not a pinning refusal: falling back to
    another way of pinning would not help)."""


def device_table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """A small int64 table made on the host, on ``device`` without a host synchronisation: a copy from
    pageable memory waits for the stream, one from pinned memory is queued like a kernel (what per-batch code,
    a chain of small launches, needs of its lookup tables)."""
    table = torch.tensor(rows, dtype=torch.long)
    if device.type != "cuda":
        return table
    return table.pin_memory().to(device, non_blocking=True)


def page_aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """An uninitialised uint8 host buffer of ``nbytes`` whose first byte starts a page, pinned when ``pin``; at
    most one page more than ``torch.empty`` takes.

    Pinned, it is asked for at ``nbytes`` first: torch's pinned-memory cache rounds a block up to a power of
    two (``pinned_max_round_threshold``), so that one page more would double a buffer whose size is one, and
    its blocks come whole from ``cudaHostAlloc``, which starts them on a page."""
    if pin:
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % PAGE == 0:
            return raw
        del raw
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % PAGE
    return raw[skip : skip + nbytes]


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _stat(path: Path, key: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


def _cgroup_room() -> int | None:
    """What the cgroups this process is in (v2, or v1's memory controller) and their parents still allow it:
    the least over them of the limit less the working set (usage less the inactive file cache, which the
    kernel reclaims before it kills anything). None where no limit is set."""
    room = None
    with contextlib.suppress(OSError):
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        for line in lines:
            _, controllers, rel = line.split(":", 2)
            if controllers == "":  # v2's unified hierarchy
                root, limit, usage, cache = (
                    Path("/sys/fs/cgroup"),
                    "memory.max",
                    "memory.current",
                    "inactive_file",
                )
            elif "memory" in controllers.split(","):
                root = Path("/sys/fs/cgroup/memory")
                limit, usage, cache = "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
            else:
                continue
            group = root / rel.lstrip("/")
            while True:  # a limit may sit on a parent (a job's, over its steps' groups)
                cap, used = _read_int(group / limit), _read_int(group / usage)
                if cap is not None and used is not None:
                    free = max(cap - max(used - _stat(group / "memory.stat", cache), 0), 0)
                    room = free if room is None else min(room, free)
                if group == root or root not in group.parents:
                    break
                group = group.parent
    return room


def available_host_bytes() -> int | None:
    """What a new allocation of this process can have without swapping or an out-of-memory kill: the kernel's
    ``MemAvailable``, or less where a cgroup of the process (v2, or v1's memory controller) caps its memory.
    None where neither says (not Linux). It is this process's view at this moment: ranks of a node that
    allocate at once each see the memory the others are about to take."""
    avail = None
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    room = _cgroup_room()
    if room is not None:
        avail = room if avail is None else min(avail, room)
    return avail


def _node_cpus(device: torch.device | None = None) -> set[int] | None:
    """The CPUs, of those the process may use, of the NUMA node that ``device`` (a GPU) hangs off, else of the
    node of the CPU this thread runs on; None where that is not known. Pages are placed on the node of the CPU
    that first touches them, and a pinned buffer on another socket than its GPU's would cross the socket link
    on every copy."""
    with contextlib.suppress(Exception):  # best effort: a placement, never an error
        node = -1
        if device is not None and device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
            node = int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text())
        if node < 0:
            cpu = ctypes.CDLL(None).sched_getcpu()
            node = int(next(Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node*")).name[4:])
        cpus: set[int] = set()
        for part in Path(f"/sys/devices/system/node/node{node}/cpulist").read_text().strip().split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        return (cpus & os.sched_getaffinity(0)) or None
    return None


def require_host_bytes(nbytes: int, what: str = "cannot pin", why: str = "") -> None:
    """Raise :class:`HostMemoryError` when this process has less memory available than ``nbytes``
    (:func:`available_host_bytes`): before any page is touched, since faulting them in past it would end in the
    out-of-memory killer, with no message. ``what`` and ``why`` say what asked, in the error."""
    avail = available_host_bytes()
    if avail is not None and nbytes > avail:
        raise HostMemoryError(
            f"{what} {nbytes / GiB:.2f} GiB of host memory{why}: only {avail / GiB:.2f} GiB are available to this "
            "process (MemAvailable, or what its cgroup's memory limit leaves); ask for less, or free host memory "
            "(the ranks of a node share it)"
        )


def touch_pages(
    buf: torch.Tensor, threads: int | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """Write zeros over the contiguous ``buf`` on ``threads`` threads of its own (default: up to 8), run on the
    CPUs of ``device``'s NUMA node (else of this thread's) that the process may use, so that the kernel maps
    every page now, on several cores and on that node; returns ``buf``. torch's thread settings are not
    touched."""
    if not buf.is_contiguous():
        raise ValueError("touch_pages needs a contiguous tensor")
    cpus = _node_cpus(device)
    if threads is None:
        threads = min(8, len(cpus or os.sched_getaffinity(0)))
    nbytes, ptr = buf.numel() * buf.element_size(), buf.data_ptr()
    if nbytes == 0:
        return buf
    memset = ctypes.CDLL(None).memset  # ctypes lets go of the GIL for the call: the threads run at once
    memset.argtypes, memset.restype = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t], ctypes.c_void_p
    chunk = -(-nbytes // max(threads, 1) // PAGE) * PAGE or PAGE

    def fill(off: int) -> None:
        if cpus:
            with contextlib.suppress(OSError):  # this thread alone (pid 0), which ends with the pool
                os.sched_setaffinity(0, cpus)
        memset(ptr + off, 0, min(chunk, nbytes - off))

    with ThreadPoolExecutor(max(threads, 1), thread_name_prefix="dsx-touch") as pool:
        list(pool.map(fill, range(0, nbytes, chunk)))
    return buf


def unforked_empty(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A private anonymous mapping of ``nbytes`` that forked children do not get (``MADV_DONTFORK``), and a
    uint8 tensor over it whose storage starts where the mapping does (on a page). Every tensor over it (views
    too) keeps the mapping alive, and it is unmapped when the last one goes; do not ``close()`` it, which would
    unmap it under them."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # (anonymous: no file descriptor)
    mapping.madvise(mmap.MADV_DONTFORK)
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8)


class PinnedBuffer:
    """``nbytes`` of host memory of its own (a private anonymous mapping, so it starts on a page), zeroed and
    pinned in place with ``cudaHostRegister``; its pages placed on ``device``'s NUMA node where that is known.

    Copies between it and a GPU run asynchronously at the link's speed, as from ``pin_memory=True`` memory, and
    ``tensor.is_pinned()`` is true. A forked child does not get the mapping (``MADV_DONTFORK``): the kernel
    would otherwise copy its pinned pages into every child, or leave them copy-on-write, where the parent's
    next write would move its view off the page the GPU reads. :meth:`close` (or garbage collection)
    unregisters the pages once; views of :attr:`tensor` that outlive it stay valid host memory, no longer
    pinned.

    Raises :class:`HostMemoryError` before any page is touched when this process has less memory available
    than ``nbytes`` (:func:`available_host_bytes`), or the mapping cannot be made: faulting the pages in past
    that would end in the out-of-memory killer, with no message. Raises
    :class:`~dsx.runtime.pinning.PinningError` when CUDA refuses the pages. The locked-memory limit
    (``ulimit -l``) is not checked: NVIDIA's driver pins past it (``cudaHostRegister`` as ``pin_memory=True``),
    so a check would only refuse what CUDA accepts.
    """

    def __init__(self, nbytes: int, threads: int | None = None, device: torch.device | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"a pinned buffer needs a positive size, not {nbytes}")
        require_host_bytes(nbytes)
        self._map: mmap.mmap | None
        try:
            self._map, tensor = unforked_empty(nbytes)
        except OSError as exc:  # ENOMEM where the kernel does not overcommit
            raise HostMemoryError(f"cannot map {nbytes / GiB:.2f} GiB of host memory: {exc}") from None
        try:
            touch_pages(tensor, threads, device)
            # (on the buffer's GPU: a rank that has not set its device would otherwise start a context on GPU 0)
            on_gpu = device is not None and device.type == "cuda"
            with torch.cuda.device(device) if on_gpu else contextlib.nullcontext():
                pinning.register(tensor.data_ptr(), nbytes)
        except BaseException:
            # the mapping goes when the last tensor over it does (never closed by hand: a view the error's
            # frames still hold would point at nothing)
            del tensor
            self._map = None
            raise
        self.tensor = tensor
        self._ptr = tensor.data_ptr()
        self._finalizer = weakref.finalize(self, pinning.unregister_at_finalization, self._ptr, tensor)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Unregister the pages (once; a second call does nothing). Raises what unregistering raises, where
        garbage collection and interpreter exit cannot."""
        if self._finalizer.detach() is not None:
            pinning.unregister(self._ptr)
