"""benchmarks/bench_offload.py ends a policy-auto config's warm-up once the plan has settled and run a step, not
after every re-plan the calibration could have made, and never before ``--warmup`` steps. On CPU the calibration
reads no peak, so the step's measured peak is stubbed, as in tests/offload/test_auto.py."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_offload
from dsx.offload import MAX_CALIBRATIONS, ActivationOffload
from tests.offload._runs import _cfg, _one_gib_budget_run


@pytest.mark.parametrize("floor", [1, 3])
@pytest.mark.parametrize("over_once", [False, True, None])
def test_the_warm_up_ends_once_the_kept_plan_has_run_a_step(
    tmp_path, over_once: bool | None, floor: int
) -> None:
    """``over_once``: the first planned step measured over the budget (then re-planned) or within it; None: no
    budget, and a plan that moves nothing, which is not measured: settled as it is installed, it has run a step
    one step later. ``floor``: ``--warmup``."""
    model, batches, _, off, sched = _one_gib_budget_run(tmp_path)
    if over_once is None:  # no budget, and no tensor large enough to move
        off.close()
        cfg = _cfg(tmp_path, ["host"], policy="auto", profile_warmup_steps=0, min_tensor_bytes=1 << 30)
        off = ActivationOffload(model, cfg, sched)
    measured: list[int] = []

    def fake_peak() -> int:
        measured.append(2 << 30 if over_once and not measured else 1 << 20)
        return measured[-1]

    off.calibration.meter.since_mark = fake_peak  # type: ignore[method-assign]
    # as bench_offload's: the planner's warm-up steps (none here), the profiled step, the re-plans
    ceiling = max(floor, off.cfg.profile_warmup_steps) + 1 + MAX_CALIBRATIONS
    warmup = bench_offload._SettledWarmup(off, floor, ceiling)
    seen, plans = [], []
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step, x in enumerate(batches):
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()
            off.end_step()
            plans.append(off.plan)
            seen.append(warmup.step_ended(step))
    finally:
        off.close()
        sched.close()
    # step 0 profiles; step 1 runs the first plan (measured, under a budget); a re-plan runs in step 2: the
    # measured steps start after the first step the settled plan ran
    settled_after = 3 if over_once else 2
    want = max(settled_after, floor)
    assert seen[want - 1 :] == [want] * (len(batches) - want + 1), (seen, measured)
    assert all(w > i + 1 for i, w in enumerate(seen[: want - 1])), seen  # not over before it settled
    assert plans[want - 1] is plans[-1] and (plans[0] is not plans[1]) == bool(over_once)
    assert over_once is not None or not any(a.moved for a in plans[0].actions)
