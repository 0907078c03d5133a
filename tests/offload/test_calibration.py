"""Budget calibration's last resort: after a planned step measured over its bar with no plan left under it,
full recompute is tried only where it is predicted to peak below the step that ran; otherwise the plan that
ran (and fitted) stays."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from torch import nn

from dsx.config import ActivationOffloadConfig
from dsx.offload.calibration import Calibration
from dsx.offload.plan import Action, Plan, make_plan
from tests.offload._plans import BW, GiB, _cfg, _profiles


def _over_budget_case() -> tuple[Calibration, Plan, Plan, Callable[[ActivationOffloadConfig], Plan]]:
    """A plan that moves every layer to the host, installed under a budget half of full recompute's predicted
    peak (no plan meets it), its calibration started, and full recompute's plan."""
    prof = _profiles(random.Random(3), 6)
    for p in prof:
        p.input_bytes = p.saved_bytes // 8
    every = make_plan(prof, BW, _cfg(policy="recompute_all"))
    cfg = _cfg(policy="auto", memory_budget_gb=0.5 * every.predicted_step_peak_bytes / GiB)
    plan = make_plan(prof, BW, cfg.model_copy(update={"policy": "offload_all"}))
    assert all(not a.recomputed for a in plan.actions)
    calibration = Calibration(cfg, nn.Linear(1, 1), torch.device("cpu"))
    calibration.start(plan)

    def replan(c: ActivationOffloadConfig) -> Plan:
        return make_plan(prof, BW, c)

    return calibration, plan, every, replan


@pytest.mark.parametrize("over", [True, False])
def test_full_recompute_is_tried_only_below_the_measured_peak(over: bool, caplog) -> None:
    calibration, plan, every, replan = _over_budget_case()
    installed: list[Plan] = []
    # the step that ran peaked above full recompute's prediction, or below it
    measured = int(every.predicted_step_peak_bytes * (1.1 if over else 0.9))
    with caplog.at_level("WARNING", logger="dsx.offload"):
        calibration.calibrate(measured, plan, replan, installed.append)
    if over:
        assert [a for p in installed for a in p.actions] == [Action.RECOMPUTE] * len(plan.actions)
        assert calibration.pending and "trying recompute for every layer" in caplog.text
    else:
        assert installed == [] and not calibration.pending
        assert "keeping the current plan" in caplog.text
        assert (
            f"recompute for every layer is predicted at {every.predicted_step_peak_bytes / GiB:.2f} GiB"
            in (caplog.text)
        )
