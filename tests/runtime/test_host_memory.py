"""Host buffers: page-aligned ones, and large ones pinned in place (their pages faulted in on threads of their
own, then registered; a mapping that forked children do not get). On CPU: the memory check that runs before
any page is touched, the fallback when CUDA refuses the pages, the fork behaviour, the page filling; on the
GPU machine: copies to and from a pinned buffer, asynchronous, its registration given back exactly once, and
a pool pinned in place under a low locked-memory limit."""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import os
import resource
import signal
import weakref

import pytest
import torch

from dsx.config import DsxConfigError
from dsx.offload.store import HostPool
from dsx.runtime import host_memory, pinning
from dsx.runtime.host_memory import (
    PAGE,
    HostMemoryError,
    PinnedBuffer,
    available_host_bytes,
    page_aligned_empty,
    touch_pages,
    unforked_empty,
)


def test_a_page_aligned_buffer_starts_on_a_page() -> None:
    for n in (1, 4095, 4097, 3 << 20):
        buf = page_aligned_empty(n)
        assert buf.data_ptr() % PAGE == 0 and buf.numel() == n and buf.dtype == torch.uint8


def test_touch_pages_zeroes_the_buffer_on_threads_of_its_own() -> None:
    before = torch.get_num_threads()
    buf = torch.randint(1, 256, (5 << 20 | 123,), dtype=torch.uint8)  # not a whole number of pages
    try:
        torch.set_num_threads(1)
        assert touch_pages(buf, threads=3) is buf
        assert torch.get_num_threads() == 1  # torch's own settings are left as they were
    finally:
        torch.set_num_threads(before)
    assert int(buf.count_nonzero()) == 0
    with pytest.raises(ValueError, match="contiguous"):
        touch_pages(torch.ones(8, 8, dtype=torch.uint8).t())


def test_a_mapping_that_forked_children_do_not_get() -> None:
    mapping, t = unforked_empty(3 * PAGE)
    assert t.data_ptr() % PAGE == 0 and t.numel() == 3 * PAGE
    t.fill_(7)
    pid = os.fork()
    if pid == 0:  # the child: reading the range faults, as nothing is mapped there
        faulthandler.disable()  # (the fault is the expected outcome: no dump of it)
        int(t[PAGE])
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGSEGV, signal.SIGBUS), status
    assert int(t.sum()) == 7 * 3 * PAGE  # the parent's is as it was
    alive = weakref.ref(mapping)
    view = t[PAGE : 2 * PAGE]
    del mapping, t
    gc.collect()
    assert alive() is not None and int(view.sum()) == 7 * PAGE  # a view keeps the mapping
    del view
    gc.collect()
    assert alive() is None  # unmapped with the last tensor over it


def test_the_mapping_is_private_and_the_touching_threads_stay_on_a_node_the_process_may_use() -> None:
    _, t = unforked_empty(2 * PAGE)
    start = f"{t.data_ptr():x}-"
    line = next(x for x in open("/proc/self/maps") if x.startswith(start))
    assert line.split()[1] == "rw-p", line  # private, not shared memory (which a default mmap() would be)
    cpus = host_memory._node_cpus()
    assert cpus is None or (cpus and cpus <= os.sched_getaffinity(0))


def test_available_memory_is_the_least_of_the_host_and_its_cgroups() -> None:
    with open("/proc/meminfo") as f:
        meminfo = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    avail, room = available_host_bytes(), host_memory._cgroup_room()
    assert avail is not None and 0 < avail <= meminfo * 1.05  # (memory moves between the two reads)
    if room is not None:
        assert avail <= room * 1.05 + (64 << 20)


def test_a_pool_of_nothing_pins_nothing_and_a_slot_that_cannot_be_made_is_not_taken() -> None:
    pool = HostPool(0, pin=True)
    pool.allocate()  # no pool asked for: nothing to pin, on a GPU or not
    assert pool._pinned is None and pool.alloc(1) is None
    big = HostPool(2 * available_host_bytes(), pin=True)
    with pytest.raises(HostMemoryError):
        big.alloc(4096)  # (the first slot makes the buffer, lazily)
    assert big.arena.used == 0


def test_memory_the_host_does_not_have_is_a_clear_error_before_any_page_is_touched() -> None:
    avail = available_host_bytes()
    assert avail is not None and avail > 0  # Linux: /proc/meminfo says
    with pytest.raises(HostMemoryError, match=r"only [0-9.]+ GiB are available to this process"):
        PinnedBuffer(2 * avail)  # touching that many pages would end in the out-of-memory killer
    with pytest.raises(DsxConfigError, match=r"host_pool_gb.*only [0-9.]+ GiB are available"):
        HostPool(2 * avail, pin=True).allocate()


def test_a_pool_whose_pages_cuda_refuses_falls_back_to_pin_memory(monkeypatch, caplog) -> None:
    def refuse(ptr: int, nbytes: int) -> None:  # what a driver that will not pin these pages answers
        raise pinning.PinningError(f"cudaHostRegister could not pin {nbytes} bytes in place: out of memory")

    monkeypatch.setattr(pinning, "register", refuse)
    with pytest.raises(pinning.PinningError, match="could not pin"):
        PinnedBuffer(8 << 20)
    pool = HostPool(8 << 20, pin=True)
    with caplog.at_level(logging.WARNING, logger="dsx"):
        if torch.cuda.is_available():  # the fallback pins it
            pool.allocate()
            assert pool._buf is not None and pool._buf.is_pinned() and pool._pinned is None
        else:  # the fallback is what runs, and with no GPU to pin for it fails as pin_memory=True does
            with pytest.raises(DsxConfigError, match="host_pool_gb"):
                pool.allocate()
    assert "cannot be pinned in place" in caplog.text and "pin_memory=True instead" in caplog.text
    # the fallback pins a power of two: a pool of 9 MiB takes 16, which 12 MiB available cannot hold
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 12 << 20)
    with pytest.raises(DsxConfigError, match=r"host_pool_gb.*would pin 0.02 GiB.*power of two"):
        HostPool(9 << 20, pin=True).allocate()


@contextlib.contextmanager
def _memlock(soft: int):
    before = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (min(soft, before[1]), before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, before)


@pytest.mark.gpu
def test_a_pool_over_the_locked_memory_limit_is_pinned_in_place() -> None:
    # dsx does not check the limit, because NVIDIA's driver pins past it: a check would only force the slow
    # fallback. Should a driver apply it, this fails with its PinningError.
    with _memlock(1 << 20):
        pb = PinnedBuffer(64 << 20)
    assert pinning.is_registered(pb.tensor.data_ptr()) and pb.tensor.is_pinned()
    pb.close()


@pytest.mark.gpu
def test_a_pinned_buffer_copies_asynchronously_and_unpins_once() -> None:
    n = 64 << 20
    pb = PinnedBuffer(n)
    ptr = pb.tensor.data_ptr()
    assert ptr % PAGE == 0 and pb.tensor.numel() == n and int(pb.tensor.count_nonzero()) == 0
    assert pinning.is_registered(ptr) and pb.tensor.is_pinned() and pb.tensor[n // 2 :].is_pinned()
    src = torch.randint(0, 256, (n // 2,), dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # queued behind a sleep: the host must not wait for it
        torch.cuda._sleep(1_000_000_000)
        pb.tensor[n // 2 :].copy_(src, non_blocking=True)
        back = pb.tensor[n // 2 :].to("cuda", non_blocking=True)
    assert not side.query(), "the copy into the pinned buffer waited on the host: it is not pinned"
    side.synchronize()
    assert torch.equal(back, src) and torch.equal(pb.tensor[n // 2 :].cuda(), src)
    view = pb.tensor[n // 2 : n // 2 + 16]
    pb.close()
    assert pb.closed and not pinning.is_registered(ptr) and not pb.tensor.is_pinned()
    pb.close()  # a second close does nothing
    assert torch.equal(view.cuda(), src[:16])  # a view that outlives it is still host memory
    again = PinnedBuffer(1 << 20)  # garbage collection unpins too
    p2 = again.tensor.data_ptr()
    assert pinning.is_registered(p2)
    del again
    gc.collect()
    assert not pinning.is_registered(p2)


@pytest.mark.gpu
def test_a_child_forked_beside_a_pinned_buffer_gets_none_of_it() -> None:
    pb = PinnedBuffer(1 << 30)
    pb.tensor[:PAGE].fill_(5)
    start = f"{pb.tensor.data_ptr():x}-".encode()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: is the pool's range mapped here?
        with open("/proc/self/maps", "rb") as f:
            os.write(w, b"mapped" if any(x.startswith(start) for x in f) else b"absent")
        os._exit(0)
    os.close(w)
    seen = os.read(r, 16)
    os.close(r)
    os.waitpid(pid, 0)
    assert seen == b"absent", "a forked child has the pinned pool's pages (copied, or shared copy-on-write)"
    assert int(pb.tensor[:PAGE].sum()) == 5 * PAGE and pb.tensor.is_pinned()
    pb.close()
