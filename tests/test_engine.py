"""dsx.initialize: a real DeepSpeed engine, plus the dsx runtime when a section is enabled."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import dsx
from dsx.config import DsxConfigError

BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 0},
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


def test_bad_section_fails_before_deepspeed_starts() -> None:
    with pytest.raises(DsxConfigError, match=r"dsx\.rgnn\.precison: unknown key"):
        dsx.initialize(model=_model(), config={**BASE, "dsx": {"rgnn": {"precison": "tf32"}}})


def test_no_config_is_a_clear_error() -> None:
    with pytest.raises(DsxConfigError, match="no DeepSpeed config"):
        dsx.initialize(model=_model())


def test_scheduler_section_attaches_runtime(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BASE, "dsx": {"scheduler": {"enabled": True, "io_workers": 2}}}))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    model = _model()
    engine, _, _, _ = dsx.initialize(args=args, model=model, model_parameters=model.parameters())
    rt = dsx.runtime_of(engine)
    assert rt is not None and rt.scheduler is not None and rt.config.scheduler.io_workers == 2
    # The runtime's I/O workers really run work and surface its errors on the compute thread.
    fut = rt.scheduler.submit(lambda a, b: a + b, 2, 3, deadline="step0")
    rt.scheduler.wait("step0")
    assert fut.result() == 5
    rt.scheduler.submit(lambda: 1 / 0, deadline="step1")
    with pytest.raises(ZeroDivisionError):
        rt.scheduler.wait("step1")
    x = torch.randn(4, 8)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    rt.close()
    with pytest.raises(RuntimeError, match="scheduler is closed"):
        rt.scheduler.submit(print)


def test_without_dsx_section_no_runtime() -> None:
    model = _model()
    engine, _, _, _ = dsx.initialize(model=model, model_parameters=model.parameters(), config=dict(BASE))
    assert dsx.runtime_of(engine) is None


def test_step_is_wrapped_once_and_the_engine_sections_are_the_defaults_while_attached() -> None:
    from dsx import defaults

    cfg = {**BASE, "dsx": {
        "scheduler": {"enabled": True},
        "rgnn": {"enabled": True, "precision": "bf16"},
        "activation_offload": {"enabled": True, "policy": "recompute_all", "layer_classes": ["Linear"]},
    }}  # fmt: skip
    model = _model()
    before = defaults.get("rgnn")
    engine, _, _, _ = dsx.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rt = dsx.runtime_of(engine)
    # dsx's one wrapper calls DeepSpeed's own step: no feature wraps it a second time
    assert rt._step._inner.__func__ is type(engine).step
    assert defaults.get("rgnn").precision == "bf16" and defaults.scheduler() is rt.scheduler
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
        engine.step()
    assert rt.scheduler.telemetry.steps == 2  # each optimizer step ended exactly once
    rt.close()
    assert engine.step.__func__ is type(engine).step  # DeepSpeed's own bound method again
    assert defaults.get("rgnn") == before and defaults.scheduler() is not rt.scheduler


def test_a_moved_key_says_where_it_went() -> None:
    cfg = {**BASE, "dsx": {"activation_offload": {"io_threads": 8}}}
    with pytest.raises(
        DsxConfigError,
        match=r"activation_offload\.io_threads: this key moved: use dsx\.scheduler\.io_workers",
    ):
        dsx.initialize(model=_model(), config=cfg)


def test_close_restores_the_defaults_even_when_closing_the_scheduler_fails() -> None:
    from dsx import defaults

    class BrokenSink:
        def on_step(self, record) -> None:
            pass

        def close(self) -> None:
            raise OSError("the trace's disk went away")

    model = _model()
    cfg = {**BASE, "dsx": {"scheduler": {"enabled": True}}}
    engine, _, _, _ = dsx.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rt = dsx.runtime_of(engine)
    rt.scheduler.add_sink(BrokenSink())
    with pytest.raises(OSError, match="disk went away"):
        rt.close()
    assert defaults.scheduler() is not rt.scheduler and rt.scheduler.closed
    assert engine.step.__func__ is type(engine).step
