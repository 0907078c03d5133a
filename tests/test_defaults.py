"""dsx.defaults: the process defaults of each config section, validated as the config file is."""

from __future__ import annotations

import pytest

import dsx
from dsx import defaults
from dsx.config import DsxConfig, DsxConfigError, RGNNConfig


@pytest.fixture(autouse=True)
def _fresh_defaults():
    defaults.reset()
    yield
    defaults.reset()


def test_get_gives_the_built_in_defaults() -> None:
    for name in defaults.SECTIONS:
        assert defaults.get(name) == getattr(DsxConfig(), name)
    assert dsx.defaults is defaults


def test_set_changes_keys_for_the_process_and_restore_undoes_it() -> None:
    token = defaults.set("rgnn", precision="bf16", fusion=False)
    assert defaults.get("rgnn").precision == "bf16" and defaults.get("rgnn").fusion is False
    later = defaults.set("rgnn", backend="interpreter")  # later changes keep the earlier ones
    assert defaults.get("rgnn").precision == "bf16" and defaults.get("rgnn").backend == "interpreter"
    token.restore()  # undoes its own keys only: the later call's stays until that call is undone
    assert defaults.get("rgnn") == RGNNConfig(backend="interpreter")
    later.restore()
    assert defaults.get("rgnn") == RGNNConfig()


def test_set_as_a_context_manager_and_its_other_forms() -> None:
    with defaults.set("unified", max_gather_sms=32):
        assert defaults.get("unified").max_gather_sms == 32
        with defaults.set({"unified": {"sort_indices": False}, "rgnn": {"precision": "tf32"}}):
            assert defaults.get("unified").max_gather_sms == 32 and not defaults.get("unified").sort_indices
            assert defaults.get("rgnn").precision == "tf32"
        assert defaults.get("unified").sort_indices and defaults.get("rgnn").precision == "fp32"
    assert defaults.get("unified").max_gather_sms == 16
    with defaults.set("rgnn", RGNNConfig(precision="bf16")):  # a whole section replaces the old one
        assert defaults.get("rgnn") == RGNNConfig(precision="bf16")


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("rgnn",), {"precison": "bf16"}, r"dsx\.rgnn\.precison: unknown key"),
        (("rgnn",), {"precision": "fp8"}, r"dsx\.rgnn\.precision: value \"fp8\" is not allowed"),
        (("offload",), {"enabled": True}, r"dsx\.offload: unknown section"),
        (("scheduler",), {"io_workers": 0}, r"dsx\.scheduler\.io_workers: value 0 .*>= 1"),
    ],
)
def test_bad_values_fail_loudly_and_change_nothing(args, kwargs, message) -> None:
    before = {name: defaults.get(name) for name in defaults.SECTIONS}
    with pytest.raises(DsxConfigError, match=message):
        defaults.set(*args, **kwargs)
    assert {name: defaults.get(name) for name in defaults.SECTIONS} == before


def test_scheduler_is_the_installed_one_then_the_process_one() -> None:
    from dsx.runtime.scheduler import Scheduler

    own = defaults.scheduler()
    assert defaults.scheduler() is own
    engine_sched = Scheduler()
    cfg = DsxConfig.model_validate(
        {"rgnn": {"enabled": True, "precision": "bf16"}, "unified": {"max_gather_sms": 4}}
    )
    token = defaults.install(cfg, engine_sched)
    assert defaults.scheduler() is engine_sched
    assert defaults.get("rgnn").precision == "bf16"
    assert (
        defaults.get("unified").max_gather_sms == 16
    )  # a section the config does not enable is not installed
    token.restore()
    assert defaults.scheduler() is own and defaults.get("rgnn").precision == "fp32"
    engine_sched.close()


def test_engines_may_close_in_any_order() -> None:
    from dsx.runtime.scheduler import Scheduler

    a_sched, b_sched = Scheduler(), Scheduler()
    a = defaults.install(DsxConfig.model_validate({"rgnn": {"enabled": True, "precision": "tf32"}}), a_sched)
    b = defaults.install(DsxConfig.model_validate({"rgnn": {"enabled": True, "precision": "bf16"}}), b_sched)
    assert defaults.get("rgnn").precision == "bf16" and defaults.scheduler() is b_sched
    a.restore()  # the older engine closes first: the newer one's sections and scheduler stay
    assert defaults.get("rgnn").precision == "bf16" and defaults.scheduler() is b_sched
    a_sched.close()
    b.restore()
    assert defaults.get("rgnn").precision == "fp32"
    own = defaults.scheduler()
    assert own is not a_sched and own is not b_sched and not own.closed
    b_sched.close()


def test_a_set_undone_while_an_engine_lives_leaves_the_engine_alone() -> None:
    from dsx.runtime.scheduler import Scheduler

    token = defaults.set("unified", max_gather_sms=8)
    sched = Scheduler()
    engine = defaults.install(
        DsxConfig.model_validate({"unified": {"enabled": True, "max_gather_sms": 2}}), sched
    )
    token.restore()
    assert defaults.get("unified").max_gather_sms == 2 and defaults.scheduler() is sched
    engine.restore()
    assert defaults.get("unified").max_gather_sms == 16  # the set was undone, the engine is gone
    sched.close()


def test_the_engines_scheduler_section_is_installed_with_its_scheduler() -> None:
    from dsx.config import SchedulerConfig
    from dsx.runtime.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(io_workers=3))  # not "enabled": no telemetry sinks, but it runs
    with defaults.install(DsxConfig(), sched):
        assert defaults.get("scheduler").io_workers == 3
    assert defaults.get("scheduler").io_workers == 4
    sched.close()


def test_sets_undone_out_of_order_leave_nothing_behind() -> None:
    x = defaults.set("rgnn", precision="bf16")
    y = defaults.set("rgnn", fusion=False)
    x.restore()
    assert defaults.get("rgnn").precision == "fp32" and defaults.get("rgnn").fusion is False
    y.restore()
    assert defaults.get("rgnn") == RGNNConfig()
    a = defaults.set("rgnn", precision="bf16")
    b = defaults.set("rgnn", precision="tf32")  # a later call changed the same key: it keeps it
    a.restore()
    assert defaults.get("rgnn").precision == "tf32"
    b.restore()
    assert defaults.get("rgnn").precision == "bf16"  # what b found; a's undo already passed
