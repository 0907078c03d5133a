"""What activation offload checks and says when it is set up and as it runs: names that match nothing, the
tier offload_all uses, settings a fixed policy ignores, an unavailable I/O backend, SSD wear."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

import dsx
from dsx.config import ActivationOffloadConfig, DsxConfigError, SchedulerConfig
from dsx.offload import ActivationOffload
from dsx.offload.wear import SECONDS_PER_YEAR, WearWatch, years_of_endurance
from dsx.runtime.scheduler import Scheduler
from tests.offload._offload_models import TinyGPT


def _cfg(tmp_path, **kw):
    (tmp_path / "ssd").mkdir(exist_ok=True)
    base = dict(enabled=True, tiers=["host"], policy="offload_all", host_pool_gb=0.05, min_tensor_bytes=0)
    base.update(io_backend="posix", ssd_path=str(tmp_path / "ssd"), ssd_capacity_gb=0.05)
    base.update(kw)
    return ActivationOffloadConfig(**base)


def _attach(model, cfg):
    sched = Scheduler(SchedulerConfig(io_workers=2))
    try:
        return ActivationOffload(model, cfg, sched), sched
    except BaseException:
        sched.close()
        raise


def test_a_layer_class_that_matches_nothing_is_an_error_beside_one_that_matches(tmp_path):
    with pytest.raises(ValueError, match=r"layer_classes \['Blok'\] match no module of TinyGPT.*'Block'"):
        _attach(TinyGPT(), _cfg(tmp_path, layer_classes=["Block", "Blok"]))


def test_nested_layer_classes_are_an_error(tmp_path):
    # CoreAttention sits inside each Block: as layers of their own, their time would count twice and the
    # planner would plan a part of a layer apart from the layer
    with pytest.raises(
        ValueError, match=r"layer_classes nest: a CoreAttention sits inside a Block.*recompute_modules"
    ):
        _attach(TinyGPT(), _cfg(tmp_path, layer_classes=["Block", "CoreAttention"]))
    off, sched = _attach(TinyGPT(), _cfg(tmp_path, layer_classes=["CoreAttention"]))  # either alone is fine
    off.close()
    sched.close()


def test_dsx_initialize_checks_the_model_before_deepspeed(tmp_path):
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    config["dsx"] = {"activation_offload": {"enabled": True, "layer_classes": ["Blok"]}}
    model = TinyGPT()
    with pytest.raises(DsxConfigError, match=r"layer_classes \['Blok'\] match no module"):
        dsx.initialize(model=model, model_parameters=model.parameters(), config=config)
    config["dsx"] = {"activation_offload": {"enabled": True, "recompute_modules": ["CoreAttn"]}}
    with pytest.raises(DsxConfigError, match=r"recompute_modules \['CoreAttn'\].*'CoreAttention'"):
        dsx.initialize(model=model, model_parameters=model.parameters(), config=config)


@pytest.mark.parametrize(
    ("tiers", "want"), [(["host", "ssd"], "ssd"), (["ssd", "host"], "host"), (["ssd"], "ssd")]
)
def test_offload_all_sends_every_layer_to_the_last_tier(tmp_path, tiers, want):
    off, sched = _attach(TinyGPT(), _cfg(tmp_path, tiers=tiers))
    try:
        assert off.hooks.actions == [want] * 3
        torch.manual_seed(0)
        off.hooks.model(torch.randint(0, 64, (2, 16))).float().pow(2).mean().backward()
        off.mover.drain()
        off.end_step()
        moved = sched.telemetry.history[-1].bytes_by_tier
        assert moved.get(want, 0) > 0 and (want == "host" or moved.get("ssd", 0) == moved.get("host", 0))
    finally:
        off.close()
        sched.close()


def test_a_fixed_policy_names_the_settings_it_ignores(tmp_path, caplog):
    cfg = _cfg(tmp_path, policy="recompute_all", memory_budget_gb=3.0, write_barrier="on")
    with caplog.at_level(logging.WARNING, logger="dsx.offload"):
        off, sched = _attach(TinyGPT(), cfg)
    off.close()
    sched.close()
    line = next(r.getMessage() for r in caplog.records if "ignores" in r.getMessage())
    assert "memory_budget_gb=3.0" in line and "write_barrier='on'" in line and "profile_mode" not in line
    assert "read by policy 'auto', 'offload_all' only" in line  # (write_barrier's readers)
    # offload_all reads write_barrier (its fixed rule): only the budget is named
    caplog.clear()
    cfg = _cfg(tmp_path, policy="offload_all", memory_budget_gb=3.0, write_barrier="off")
    with caplog.at_level(logging.WARNING, logger="dsx.offload"):
        off, sched = _attach(TinyGPT(), cfg)
    assert (off.hooks.write_barrier, off.hooks.write_barrier_bwd) == ([], [])
    off.close()
    sched.close()
    line = next(r.getMessage() for r in caplog.records if "ignores" in r.getMessage())
    assert "memory_budget_gb=3.0" in line and "write_barrier" not in line


@pytest.mark.skipif(importlib.util.find_spec("kvikio") is not None, reason="kvikio is installed here")
def test_an_explicit_backend_that_is_missing_says_what_to_do(tmp_path):
    with pytest.raises(RuntimeError, match=r"io_backend='kvikio' is not available here.*'auto'.*'posix'"):
        _attach(TinyGPT(), _cfg(tmp_path, tiers=["ssd"], io_backend="kvikio"))
    assert not any((tmp_path / "ssd").iterdir())  # its run directory went with the failed start


def test_years_of_endurance():
    # 600 TBW at 1 GB/s: 6e5 s, a week
    assert years_of_endurance(600, 1e9) == pytest.approx(6e5 / SECONDS_PER_YEAR)
    assert years_of_endurance(600, 0) == float("inf")


def test_wear_watch_measures_after_min_steps_and_warns_once(caplog):
    w = WearWatch("/ssd", endurance_tbw=1000, horizon_years=3, ranks_on_drive=4, min_steps=3)
    rate = 5e9  # bytes/s this rank writes: 20 GB/s for the node, 1000 TB in ~0.6 days
    with caplog.at_level(logging.WARNING, logger="dsx.offload"):
        assert w.step(0, now=0.0) is None  # nothing written yet
        assert w.step(int(rate), now=1.0) is None  # the first step with writes starts the measurement
        assert w.step(int(2 * rate), now=2.0) is None
        assert w.step(int(3 * rate), now=3.0) is None
        years = w.step(int(4 * rate), now=4.0)
        w.step(int(5 * rate), now=5.0)
    assert years == pytest.approx(1000e12 / (4 * rate) / SECONDS_PER_YEAR)
    warnings = [r.getMessage() for r in caplog.records if "SSD wear" in r.getMessage()]
    assert len(warnings) == 1 and "20.00 GB/s" in warnings[0] and "4 rank(s)" in warnings[0]


def test_wear_watch_is_quiet_within_the_horizon(caplog):
    w = WearWatch("/ssd", endurance_tbw=1000, horizon_years=3, ranks_on_drive=1, min_steps=1)
    with caplog.at_level(logging.WARNING, logger="dsx.offload"):
        w.step(10, now=0.0)
        years = w.step(10 + 1000, now=1.0)  # 1 kB/s: forever
    assert years > 3 and not [r for r in caplog.records if "SSD wear" in r.getMessage()]


def test_ssd_runs_with_an_endurance_warn_when_it_would_wear_out(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = _cfg(tmp_path, tiers=["ssd"], ssd_endurance_tbw=1e-6, wear_warn_years=3)  # a 1 MB drive
    off, sched = _attach(TinyGPT(), cfg)
    g = torch.Generator().manual_seed(1)
    try:
        with caplog.at_level(logging.WARNING, logger="dsx.offload"):
            for _ in range(13):
                off.hooks.model(torch.randint(0, 64, (2, 16), generator=g)).float().pow(2).mean().backward()
                off.mover.drain()
                off.end_step()
    finally:
        off.close()
        sched.close()
    warnings = [r.getMessage() for r in caplog.records if "SSD wear" in r.getMessage()]
    assert len(warnings) == 1 and "2 rank(s)" in warnings[0] and str(tmp_path / "ssd") in warnings[0]
    assert off.wear.ranks == 2 and off.wear.years < 1e-3


def test_a_constructor_that_fails_late_leaves_no_file_and_no_hook(tmp_path, monkeypatch):
    """A failure after the SSD file exists (here the start-up bandwidth probe) undoes what was set up: no run
    directory stays on the drive, and the model runs as it did."""
    import dsx.offload.controller as controller

    def probe_fails(*args, **kwargs):
        raise OSError("the probe's drive went away")

    monkeypatch.setattr(controller, "measure_tier_bandwidth", probe_fails)
    (tmp_path / "ssd").mkdir()
    model = TinyGPT()
    forwards = [blk.forward for blk in model.blocks]
    hooks_before = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    cfg = ActivationOffloadConfig(enabled=True, tiers=["host", "ssd"], ssd_path=str(tmp_path / "ssd"),
                                  policy="offload_all", host_pool_gb=0.01, ssd_capacity_gb=0.01,
                                  io_backend="posix")  # fmt: skip
    sched = Scheduler(SchedulerConfig(io_workers=2))
    try:
        with pytest.raises(OSError, match="went away"):
            ActivationOffload(model, cfg, sched)
    finally:
        sched.close()
    assert list((tmp_path / "ssd").iterdir()) == []
    assert [blk.forward for blk in model.blocks] == forwards
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == hooks_before
