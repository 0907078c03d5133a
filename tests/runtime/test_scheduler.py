"""The scheduler owns the rank's thread pools and streams; waiting on a deadline is recorded as stall."""

from __future__ import annotations

import threading
import time

import pytest

from dsx.config import SchedulerConfig
from dsx.runtime.scheduler import POOLS, Scheduler


def test_pools_are_named_sized_and_made_once() -> None:
    sched = Scheduler(SchedulerConfig(io_workers=3))
    try:
        names = {
            pool: sched.submit(lambda: threading.current_thread().name, pool=pool).result() for pool in POOLS
        }
        assert names["io"].startswith("dsx-io") and names["ssd"].startswith("dsx-ssd")
        assert names["loader"].startswith("dsx-loader")
        assert sched.executor("io") is sched.executor("io")
        assert sched.executor("io")._max_workers == 3 and sched.executor("loader")._max_workers == 1
        with pytest.raises(ValueError, match="unknown pool 'disk'"):
            sched.executor("disk")
        assert sched.stream("offload") is None  # CPU: copies run on the threads
    finally:
        sched.close()


def test_wait_records_the_blocked_time_as_stall_and_reraises() -> None:
    sched = Scheduler(SchedulerConfig())
    try:
        sched.submit(time.sleep, 0.05, deadline="batch:0")
        sched.wait("batch:0")
        rec = sched.end_step()
        assert rec.stall_s >= 0.03 and set(rec.stall_by) == {"batch"}
        sched.submit(lambda: 1 / 0, deadline="batch:1")
        with pytest.raises(ZeroDivisionError):
            sched.wait("batch:1")
        sched.wait("never-submitted")  # nothing due: returns at once
    finally:
        sched.close()


def test_forget_drops_a_deadline_and_close_is_idempotent() -> None:
    sched = Scheduler(SchedulerConfig())
    gate = threading.Event()
    fut = sched.submit(gate.wait, deadline="gone")
    sched.forget("gone")
    gate.set()
    sched.close()  # waits for nothing that was forgotten, but joins the threads
    assert fut.done()
    sched.close()
    with pytest.raises(RuntimeError, match="scheduler is closed"):
        sched.submit(print)
