"""The cached current stream and the cheap stream switch against torch's own, on a GPU."""

from __future__ import annotations

import threading

import pytest
import torch

from dsx.runtime.streams import current_stream, on_stream

pytestmark = pytest.mark.gpu


def _same(a: torch.cuda.Stream, b: torch.cuda.Stream) -> bool:
    return a.cuda_stream == b.cuda_stream and a.device_index == b.device_index


def test_current_stream_follows_every_switch() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    sides = [torch.cuda.Stream() for _ in range(3)]
    assert _same(current_stream(dev), torch.cuda.current_stream(dev))
    for s in sides:
        with torch.cuda.stream(s):
            assert _same(current_stream(dev), s)
            assert _same(current_stream(), s)
            assert _same(current_stream(dev.index), s)
        assert _same(current_stream(dev), torch.cuda.current_stream(dev))
    torch.cuda.set_stream(sides[1])
    try:
        assert _same(current_stream(dev), sides[1])
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream(dev))
    assert _same(current_stream(dev), torch.cuda.default_stream(dev))


def test_current_stream_is_per_thread() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream()
    seen: dict[str, bool] = {}
    inside = threading.Event()
    done = threading.Event()

    def other() -> None:
        torch.cuda.set_device(dev)
        with torch.cuda.stream(side):
            seen["other"] = _same(current_stream(dev), side)
            inside.set()
            done.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    seen["main"] = _same(current_stream(dev), torch.cuda.current_stream(dev))
    seen["main_not_side"] = not _same(current_stream(dev), side)
    done.set()
    t.join()
    assert seen == {"other": True, "main": True, "main_not_side": True}


def test_on_stream_queues_there_and_restores() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    side, outer = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.randn(1 << 20, device=dev)
    with torch.cuda.stream(outer):
        with on_stream(side) as s:
            assert s is side and _same(torch.cuda.current_stream(dev), side)
            side.wait_stream(outer)
            y = x * 2
            done = torch.cuda.Event()
            done.record(side)
        assert _same(torch.cuda.current_stream(dev), outer)
        assert _same(current_stream(dev), outer)
    done.synchronize()
    torch.testing.assert_close(y, x * 2)
    with pytest.raises(ValueError):  # the previous stream comes back when the block raises, too
        with on_stream(side):
            raise ValueError
    assert _same(torch.cuda.current_stream(dev), torch.cuda.default_stream(dev))


@pytest.mark.multigpu
def test_on_stream_of_another_device_restores_the_device() -> None:
    other = torch.cuda.Stream(device=1)
    before = torch.cuda.current_device()
    with on_stream(other):
        assert torch.cuda.current_device() == 1
        assert _same(torch.cuda.current_stream(1), other)
    assert torch.cuda.current_device() == before
