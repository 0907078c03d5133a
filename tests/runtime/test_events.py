"""Host waits for CUDA events (``dsx.runtime.events``): each mode returns only once its event has completed;
the setting fails loudly on an unknown value."""

from __future__ import annotations

import threading

import pytest
import torch

from dsx.config import DsxConfigError, SchedulerConfig, parse_dsx_config
from dsx.runtime.events import EVENT_WAIT_MODES, EventWaiter
from dsx.runtime.scheduler import Scheduler


def test_an_unknown_event_wait_is_a_config_error():
    with pytest.raises(DsxConfigError, match="event_wait"):
        parse_dsx_config({"scheduler": {"event_wait": "busy"}})
    assert parse_dsx_config({"scheduler": {"event_wait": "poll"}}).scheduler.event_wait == "poll"
    with pytest.raises(ValueError, match="event_wait must be one of"):
        EventWaiter("busy")
    assert EventWaiter("auto").mode == "spin"  # the documented default (docs/scheduler.md says why)
    assert set(EVENT_WAIT_MODES) == {"auto", "poll", "spin"}


def test_a_cpu_scheduler_has_no_waiter_whatever_the_setting():
    sched = Scheduler(SchedulerConfig(event_wait="poll"), device=torch.device("cpu"))
    try:
        assert sched.waiter is None  # (on CPU the copies run on the I/O threads themselves)
    finally:
        sched.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["poll", "spin"])
def test_gpu_wait_returns_only_once_the_event_completed(mode):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    waiter = EventWaiter(mode)
    side = torch.cuda.Stream()
    events = []
    with torch.cuda.stream(side):
        for _ in range(6):
            torch.cuda._sleep(20_000_000)  # ~10 ms each
            events.append(torch.cuda.Event())
            events[-1].record(side)
    assert not events[-1].query(), "the stream was done before the waits: the test checked nothing"
    seen: list[bool] = []

    def wait_all(idx: range) -> None:
        for k in idx:
            waiter.wait(events[k])
            seen.append(all(events[j].query() for j in range(k + 1)))

    threads = [threading.Thread(target=wait_all, args=(range(j, 6, 2),)) for j in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [True] * 6
