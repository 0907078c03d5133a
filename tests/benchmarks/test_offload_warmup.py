"""benchmarks/bench_offload.py ends a policy-auto config's warm-up once the plan has settled and run a step, not
after every re-plan the calibration could have made (each step at a long sequence takes tens of seconds). On
CPU the calibration reads no peak, so the step's measured peak is stubbed, as in tests/offload/test_auto.py."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_offload
from dsx.offload import ActivationOffload
from tests.offload._runs import _cfg, _one_gib_budget_run


@pytest.mark.parametrize("over_once", [False, True, None])
def test_settled_once_the_kept_plan_has_run_a_step(tmp_path, over_once: bool | None) -> None:
    """``over_once``: the first planned step measured over the budget or within it; None: no budget (a plan
    that moves nothing is not measured: it is settled as it is installed, and has run a step one step later)."""
    model, batches, _, off, sched = _one_gib_budget_run(tmp_path)
    if over_once is None:  # no budget, and no tensor large enough to move
        off.close()
        cfg = _cfg(tmp_path, ["host"], policy="auto", profile_warmup_steps=0, min_tensor_bytes=1 << 30)
        off = ActivationOffload(model, cfg, sched)
    measured: list[int] = []

    def fake_peak() -> int:  # the first planned step over the budget (then re-planned), or within it
        measured.append(2 << 30 if over_once and not measured else 1 << 20)
        return measured[-1]

    off.calibration.meter.since_mark = fake_peak  # type: ignore[method-assign]
    settled = bench_offload._plan_settled(off)
    seen, plans = [], []
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for x in batches:
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()
            off.end_step()
            plans.append(off.plan)
            seen.append(settled())
    finally:
        off.close()
        sched.close()
    # step 0 profiles; step 1 runs the first plan and measures it; a re-plan runs (and is measured) in step 2
    first_settled = 2 if over_once else 1
    assert over_once is not None or not any(a.moved for a in plans[0].actions)
    assert seen == [False] * first_settled + [True] * (len(batches) - first_settled), (seen, measured)
    assert plans[first_settled] is plans[-1] and (plans[0] is not plans[1]) == bool(
        over_once
    )  # (plans: at each end)
