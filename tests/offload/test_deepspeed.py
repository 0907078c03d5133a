"""The DeepSpeed glue (dsx.offload.deepspeed) on a stand-in engine, and what the controller takes from the
process defaults and the scheduler's section."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import dsx
import dsx.offload.controller as controller
from dsx.config import ActivationOffloadConfig, DsxConfig, SchedulerConfig
from dsx.offload import ActivationOffload
from dsx.offload.deepspeed import _nvme_path, attach
from dsx.runtime.bandwidth import TierBandwidth
from dsx.runtime.scheduler import Scheduler
from tests.offload._offload_models import TinyGPT


def _section(tmp_path, **kw) -> ActivationOffloadConfig:
    (tmp_path / "ssd").mkdir(exist_ok=True)
    base = dict(enabled=True, tiers=["ssd"], ssd_path=str(tmp_path / "ssd"), policy="offload_all",
                host_pool_gb=0.05, ssd_capacity_gb=0.05, min_tensor_bytes=0, io_backend="posix")  # fmt: skip
    return ActivationOffloadConfig(**{**base, **kw})


def _engine(model, nvme: str | None):
    """What attach reads of a DeepSpeed engine: the module, the device and ZeRO's offload config."""
    zero = SimpleNamespace(
        offload_optimizer=SimpleNamespace(nvme_path=nvme) if nvme else None, offload_param=None
    )
    return SimpleNamespace(module=model, device="cpu", _config=SimpleNamespace(zero_config=zero))


def _step(feature, model, sched) -> bool:
    """A training step as the engine drives it: forward and backward, the step inside ``around_step``, then
    ``after_step`` and the scheduler's step end (the engine's part); whether the "ssd" gate was open in it."""
    model(torch.randint(0, 64, (2, 16))).float().pow(2).mean().backward()
    with feature.around_step():
        gate_open = sched.gate("ssd").is_set()
    feature.after_step()
    sched.end_step()
    return gate_open


def test_ssd_on_zeros_drive_pauses_its_writes_during_the_step(tmp_path) -> None:
    """The SSD tier on the drive of ZeRO's nvme_path (a directory DeepSpeed has not made yet): activation writes
    wait while engine.step() runs (the "ssd" gate is shut inside around_step), and only then."""
    sched = Scheduler(SchedulerConfig(io_workers=2))
    model = TinyGPT()
    runtime = SimpleNamespace(config=DsxConfig(activation_offload=_section(tmp_path)), scheduler=sched)
    engine = _engine(model, str(tmp_path / "nvme" / "not-yet"))
    assert _nvme_path(engine) == str(tmp_path / "nvme" / "not-yet")
    feature = attach(engine, runtime)
    try:
        assert feature.offload.shared_ssd
        assert [_step(feature, model, sched) for _ in range(2)] == [False, False]
        assert sched.gate("ssd").is_set() and sched.gate_pauses["ssd"] == 2
        # after_step ends no scheduler step of its own: the engine ends each one once
        assert feature.offload.step == 2 and sched.telemetry.steps == 2
    finally:
        feature.close()
        sched.close()
    assert not any((tmp_path / "ssd").iterdir())


def test_without_a_shared_drive_the_step_runs_with_the_gate_open(tmp_path) -> None:
    sched = Scheduler(SchedulerConfig(io_workers=2))
    model = TinyGPT()
    runtime = SimpleNamespace(config=DsxConfig(activation_offload=_section(tmp_path)), scheduler=sched)
    feature = attach(_engine(model, None), runtime)
    try:
        assert not feature.offload.shared_ssd
        assert _step(feature, model, sched) and "ssd" not in sched.gate_pauses
    finally:
        feature.close()
        sched.close()


def test_end_step_is_after_step_and_the_schedulers_step_end(tmp_path) -> None:
    """On a bare module nothing else ends the scheduler's step: end_step does, once per optimizer step."""
    sched = Scheduler(SchedulerConfig(io_workers=2))
    model = TinyGPT()
    off = ActivationOffload(model, _section(tmp_path, tiers=["host"]), sched)
    try:
        for _ in range(3):
            model(torch.randint(0, 64, (2, 16))).float().pow(2).mean().backward()
            off.end_step()
        assert off.step == 3 and sched.telemetry.steps == 3
        off.after_step()
        assert off.step == 4 and sched.telemetry.steps == 3
    finally:
        off.close()
        sched.close()


def test_the_section_and_scheduler_default_to_the_process_defaults(tmp_path) -> None:
    """Without arguments the controller takes dsx.defaults' section and scheduler (here installed as an engine
    installs its own, so that the test closes the scheduler and no I/O thread outlives it)."""
    sched = Scheduler(SchedulerConfig(io_workers=2))
    with dsx.defaults.install(DsxConfig(activation_offload=_section(tmp_path, tiers=["host"])), sched):
        off = ActivationOffload(TinyGPT())
        try:
            assert off.cfg == dsx.defaults.get("activation_offload") and off.cfg.policy == "offload_all"
            assert off.sched is dsx.defaults.scheduler() is sched and off.mover.sched is sched
            assert off.hooks.actions == ["host"] * 3
        finally:
            off.close()
            sched.close()


def test_the_bandwidth_probe_is_the_size_the_scheduler_section_sets(tmp_path, monkeypatch) -> None:
    """Policies auto and offload_all measure each tier at start-up, with scheduler.bandwidth_probe_mb."""
    seen = []

    def probe(tiers, ssd_dir, *, mb):
        seen.append((list(tiers), ssd_dir is not None, mb))
        return [TierBandwidth(t, 1e9, 1e9) for t in tiers]

    monkeypatch.setattr(controller, "measure_tier_bandwidth", probe)
    for policy in ("offload_all", "auto", "recompute_all"):
        sched = Scheduler(SchedulerConfig(io_workers=2, bandwidth_probe_mb=3))
        off = ActivationOffload(TinyGPT(), _section(tmp_path, tiers=["host", "ssd"], policy=policy), sched)
        off.close()
        sched.close()
    assert seen == [(["host", "ssd"], True, 3)] * 2  # (recompute_all has no plan to measure for)
