"""The DeepSpeed glue (dsx.offload.deepspeed) on real engines, the checks it makes before DeepSpeed starts, and
what the controller takes from the process defaults and the scheduler's section."""

from __future__ import annotations

import pytest
import torch

import dsx
import dsx.offload.controller as controller
from dsx.config import ActivationOffloadConfig, DsxConfig, DsxConfigError, SchedulerConfig
from dsx.offload import ActivationOffload
from dsx.offload.deepspeed import _nvme_path
from dsx.runtime.bandwidth import TierBandwidth
from dsx.runtime.scheduler import Scheduler
from tests.offload._offload_models import TinyGPT


def _section(tmp_path, **kw) -> ActivationOffloadConfig:
    (tmp_path / "ssd").mkdir(exist_ok=True)
    base = dict(enabled=True, tiers=["ssd"], ssd_path=str(tmp_path / "ssd"), policy="offload_all",
                host_pool_gb=0.05, ssd_capacity_gb=0.05, min_tensor_bytes=0, io_backend="posix")  # fmt: skip
    return ActivationOffloadConfig(**{**base, **kw})


def _engine(tmp_path, nvme: str | None, **section):
    """A real DeepSpeed engine through dsx.initialize: ZeRO-2 with the optimizer offloaded (to ``nvme`` when
    given: stage 2 keeps it in host memory but records the path, which is what dsx compares drives by), the
    SSD tier in ``tmp_path/ssd``."""
    torch.manual_seed(0)
    model = TinyGPT()
    offload = {"device": "nvme", "nvme_path": nvme} if nvme else {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "offload_optimizer": offload},
        "dsx": {
            "activation_offload": _section(tmp_path, **section).model_dump(),
            "scheduler": {"io_workers": 2},
        },
    }
    engine, _, _, _ = dsx.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _gate_during_steps(engine, steps: int) -> list[bool]:
    """Train ``steps`` steps; whether the scheduler's "ssd" gate was open while DeepSpeed's own step ran (its
    optimizer step is where ZeRO swaps state on the nvme drive)."""
    sched = engine.dsx.scheduler
    seen: list[bool] = []
    inner = engine.optimizer.step

    def step(*args, **kwargs):
        seen.append(sched.gate("ssd").is_set())
        return inner(*args, **kwargs)

    engine.optimizer.step = step
    for _ in range(steps):
        engine.backward(engine(torch.randint(0, 64, (2, 16))).float().pow(2).mean())
        engine.step()
    return seen


def test_ssd_on_zeros_drive_pauses_its_writes_during_the_step(tmp_path) -> None:
    """The SSD tier on the drive of ZeRO's nvme_path (a directory DeepSpeed has not made yet): activation writes
    wait while engine.step() runs (the "ssd" gate is shut inside around_step), and only then."""
    engine = _engine(tmp_path, str(tmp_path / "nvme" / "not-yet"))
    sched = engine.dsx.scheduler
    try:
        assert _nvme_path(engine) == str(tmp_path / "nvme" / "not-yet")
        feature = engine.dsx.features["activation_offload"]
        assert feature.offload.shared_ssd
        assert _gate_during_steps(engine, 2) == [False, False]
        assert sched.gate("ssd").is_set() and sched.gate_pauses["ssd"] == 2
        # after_step ends no scheduler step of its own: the engine ends each one once
        assert feature.offload.step == 2 and sched.telemetry.steps == 2
    finally:
        engine.dsx.close()
    assert not any((tmp_path / "ssd").iterdir())


def test_without_a_shared_drive_the_step_runs_with_the_gate_open(tmp_path) -> None:
    engine = _engine(tmp_path, None)
    try:
        assert not engine.dsx.features["activation_offload"].offload.shared_ssd
        assert _gate_during_steps(engine, 1) == [True] and "ssd" not in engine.dsx.scheduler.gate_pauses
    finally:
        engine.dsx.close()


def test_an_io_backend_this_machine_lacks_fails_before_deepspeed_starts(tmp_path) -> None:
    from dsx.offload.io import describe_backends

    missing = [name for name, info in describe_backends().items() if not info["available"]]
    if not missing:
        pytest.skip("every SSD backend is available here")
    with pytest.raises(
        DsxConfigError, match=rf"dsx\.activation_offload\.io_backend: \"{missing[0]}\" is not available"
    ):
        _engine(tmp_path, None, io_backend=missing[0])
    assert not any((tmp_path / "ssd").iterdir())


def test_a_host_pool_this_machine_cannot_hold_is_a_clear_error_at_start(tmp_path) -> None:
    from dsx.offload.store import HostPool

    pool = HostPool(1 << 62, pin=False)  # a real allocation that fails
    with pytest.raises(DsxConfigError, match=r"dsx\.activation_offload\.host_pool_gb: could not allocate"):
        pool.allocate()


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


@pytest.mark.parametrize(
    ("where", "planned"), [("backward", False), ("recomputation", False), ("backward", True)]
)
def test_out_of_memory_in_a_layers_backward_while_profiling_says_what_to_do(tmp_path, where, planned) -> None:
    """Under DeepSpeed, an out-of-memory error raised in a layer's backward (after its recomputation, outside
    the layer's own wrapper) during policy auto's warm-up step leaves ``engine.backward`` with the note, and one
    raised in the recomputation (noted by the layer's wrapper, then passing through ``engine.backward``) with it
    once; in a planned step it has none; ``close()`` gives the engine its own ``backward`` back, and a closed
    offload notes nothing."""
    engine = _engine(tmp_path, None, tiers=["host"], policy="auto", profile_warmup_steps=1,
                     profile_mode="recompute", memory_budget_gb=1.0)  # fmt: skip
    raising = [False]

    def out_of_memory(*_):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.00 GiB")

    def on_output(module, args, out):  # (with grad: the recomputation, or a kept layer's forward)
        if raising[0] and torch.is_grad_enabled():
            out.register_hook(out_of_memory)

    def on_input(module, args):
        if raising[0] and torch.is_grad_enabled():
            out_of_memory()

    if where == "backward":
        engine.module.blocks[1].fc2.register_forward_hook(on_output)
    else:
        engine.module.blocks[1].attn.register_forward_pre_hook(on_input)
    offload = engine.dsx.features["activation_offload"].offload
    try:
        for step in range(3 if planned else 1):
            raising[0] = step == (2 if planned else 0)
            loss = engine(torch.randint(0, 64, (2, 16))).float().pow(2).mean()
            if not raising[0]:
                engine.backward(loss)
                engine.step()
                continue
            with pytest.raises(torch.OutOfMemoryError) as err:
                engine.backward(loss)
            notes = getattr(err.value, "__notes__", [])
            if planned:
                assert offload.plan is not None and not notes, notes
            else:
                assert len(notes) == 1 and 'profile_mode to "recompute+host"' in notes[0], notes
    finally:
        engine.dsx.close()
    assert "backward" not in vars(engine)
    assert offload.profile_oom_note() is None  # closed: a wrapper left over it by another adds nothing
