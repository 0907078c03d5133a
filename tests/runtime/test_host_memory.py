"""Page-aligned host buffers, and large ones pinned in place: their pages faulted in on several threads, then
registered; on the GPU machine, copies to and from them, and their registration given back exactly once."""

from __future__ import annotations

import gc

import pytest
import torch

from dsx.runtime import pinning
from dsx.runtime.host_memory import PAGE, PinnedBuffer, available_host_bytes, page_aligned_empty, touch_pages


def test_a_page_aligned_buffer_starts_on_a_page() -> None:
    for n in (1, 4095, 4097, 3 << 20):
        buf = page_aligned_empty(n)
        assert buf.data_ptr() % PAGE == 0 and buf.numel() == n and buf.dtype == torch.uint8


def test_touch_pages_zeroes_the_buffer_and_sets_the_thread_count_back() -> None:
    before = torch.get_num_threads()
    buf = torch.randint(1, 256, (5 << 20,), dtype=torch.uint8)
    try:
        torch.set_num_threads(1)
        assert touch_pages(buf, threads=2) is buf
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert int(buf.count_nonzero()) == 0


def test_a_pinned_buffer_larger_than_the_host_has_is_a_clear_error_before_any_page_is_touched() -> None:
    avail = available_host_bytes()
    assert avail is not None and avail > 0  # Linux: /proc/meminfo says
    with pytest.raises(pinning.PinningError, match=r"only [0-9.]+ GiB are available on this host"):
        PinnedBuffer(2 * avail)  # touching that many pages would end in the out-of-memory killer


@pytest.mark.gpu
def test_a_pinned_buffer_copies_asynchronously_and_unpins_once() -> None:
    n = 64 << 20
    pb = PinnedBuffer(n)
    ptr = pb.tensor.data_ptr()
    assert ptr % PAGE == 0 and pb.tensor.numel() == n and int(pb.tensor.count_nonzero()) == 0
    assert pinning.is_registered(ptr) and pb.tensor.is_pinned()
    src = torch.randint(0, 256, (n // 2,), dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # device -> host and back into a slot past the first, both non-blocking
        pb.tensor[:PAGE].fill_(0)
        pb.tensor[n // 2 :].copy_(src, non_blocking=True)
        back = pb.tensor[n // 2 :].to("cuda", non_blocking=True)
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
