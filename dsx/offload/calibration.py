"""Budget calibration of policy ``auto``: the planned step's activation peak, measured, and a re-plan when it
ran over ``memory_budget_gb``; without a budget, keeping every layer when the planned step peaked above what
keeping every layer is predicted to (a hide-only plan must never be worse than doing nothing).

The cost model counts saved bytes, recomputation and what the profiling step measured beyond them
(background, workspaces), but not what it cannot see (allocator rounding, what a recomputed sub-module's
checkpoint frame holds, memory that differs between a kept and a recomputed layer). Measuring the step that
ran is exact (CUDA only: elsewhere there is no peak to read, and nothing is calibrated).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dsx.config import ActivationOffloadConfig
from dsx.offload.plan import Plan, PlanError
from dsx.runtime.process import rank_and_world

__all__ = ["MAX_CALIBRATIONS", "Calibration", "PeakMeter"]

logger = logging.getLogger("dsx.offload")
GB = 1 << 30
MAX_CALIBRATIONS = 2  # re-plans after a planned step measured over the budget (policy auto, CUDA)
# The step's peak after the layers' backward (the gradients' reduction, the optimizer: Plan.outside_peak_bytes) is
# the same for every plan, so a step is measured against it where it is higher than the bar, with this much room
# for the allocator's rounding between the profiled step and a planned one.
TAIL_SLACK = 1.01


class PeakMeter:
    """The activation peak of a step (CUDA), measured as the profiler measured it for the prediction: from the
    model's forward on, above the memory allocated then.

    Measured from the step boundary instead, gradients that the optimizer's ``zero_grad(set_to_none=True)``
    frees before the next forward would be in the base and not in the peak (a plan then ran over its budget
    unseen)."""

    def __init__(self, root: nn.Module, device: torch.device) -> None:
        self._root, self.device = root, device
        self._peak_base: int | None = None  # memory allocated as the measured step's forward started
        self._peak_hook: Any = None

    def mark(self) -> None:
        """Measure the next step: from its model forward's start on."""
        if self.device.type != "cuda":
            return
        self.close()
        self._peak_base = None

        def forward_starts(module: nn.Module, args: Any) -> None:
            self.close()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._peak_base = torch.cuda.memory_allocated(self.device)

        self._peak_hook = self._root.register_forward_pre_hook(forward_starts)

    def since_mark(self) -> int | None:
        """The activation peak since the marked step's forward started; None before it has."""
        if self.device.type != "cuda" or self._peak_base is None:
            return None
        return torch.cuda.max_memory_allocated(self.device) - self._peak_base

    def close(self) -> None:
        """Remove the forward hook a mark left, if its forward has not come yet."""
        if self._peak_hook is not None:
            self._peak_hook.remove()
            self._peak_hook = None


def _bar(limit: float, plan: Plan) -> float:
    """What a planned step's measured peak is held to: ``limit``, or the step's tail after the layers' backward
    where that is higher (with ``TAIL_SLACK``: the same allocations, measured in another step)."""
    tail = plan.outside_peak_bytes
    return limit if tail <= limit else tail * TAIL_SLACK


class Calibration:
    """At most ``MAX_CALIBRATIONS`` re-plans after planned steps measured over the budget, each on the same
    profiles (no new profiling step); the budget the planner is given is only ever lowered.

    ``pending`` says whether the step just ended is to be measured (its peak goes to :meth:`calibrate`)."""

    def __init__(self, cfg: ActivationOffloadConfig, root: nn.Module, device: torch.device) -> None:
        self.cfg = cfg
        self.meter = PeakMeter(root, device)
        self.model_budget = 0.0  # the budget the planner is given: memory_budget_gb less measured overshoot
        self.keep_all_bytes = 0  # no budget: the predicted peak of keeping every layer, the bar to stay under
        self.left = 0  # re-plans left

    @property
    def pending(self) -> bool:
        return self.left > 0

    def start(self, plan: Plan) -> None:
        """``plan``, the first, is installed: with a budget, or when it moves bytes without one, measure the
        step it runs."""
        if self.cfg.memory_budget_gb is not None:
            # the budget the plan was made against: the controller raises it to the tail where that is higher
            self.model_budget = float(plan.bound["budget_bytes"])
            self.left = MAX_CALIBRATIONS
            self.meter.mark()
        elif any(a.moved for a in plan.actions):
            self.keep_all_bytes = plan.bound["keep_all_bytes"]
            self.left = 1
            self.meter.mark()

    def calibrate(
        self,
        measured: int,
        plan: Plan,
        replan: Callable[[ActivationOffloadConfig], Plan],
        install: Callable[[Plan], None],
    ) -> None:
        """The planned step (``plan``) peaked at ``measured`` bytes above its start: if that is over the
        budget, plan again (``replan``, on ``plan``'s profiles) against a budget lowered by the overshoot and
        ``install`` that plan; measure the next step. Without a budget: if that is over the predicted peak of
        keeping every layer, keep every layer. Where the step's tail after the layers' backward peaks higher than
        the budget (or than keeping every layer), that tail is the bar: no plan goes under it."""
        if self.cfg.memory_budget_gb is None:
            self.left = 0
            if measured > _bar(self.keep_all_bytes, plan):
                if rank_and_world()[0] == 0:
                    logger.warning(
                        "dsx activation offload: the hide-only plan's step peaked at %.2f GiB (predicted %.2f), "
                        "above the %.2f GiB predicted for keeping every layer: keeping every layer (set "
                        "memory_budget_gb to trade speed for memory)",
                        measured / GB,
                        plan.peak_bytes / GB,
                        self.keep_all_bytes / GB,
                    )
                install(replan(self.cfg.model_copy(update={"policy": "none"})))
            return
        budget = self.cfg.memory_budget_gb * GB
        bar = max(budget, plan.outside_peak_bytes)  # what no plan goes under
        self.left -= 1
        if measured <= _bar(budget, plan):
            self.left = 0
            return
        self.model_budget = max(0.0, self.model_budget - (measured - bar))
        cfg = self.cfg.model_copy(update={"memory_budget_gb": self.model_budget / GB})
        try:
            new = replan(cfg)
        except PlanError as exc:
            every = None
            if self.left > 0 and any(not a.recomputed for a in plan.actions):
                # the model has no plan with that margin, but its error runs both ways (a mixed plan can peak
                # over its prediction while full recompute's is overestimated): fall back to recomputing every
                # layer and measure that, unless it is predicted to peak no lower than the step that ran (when
                # the profile moved the layers' inputs to the host, the plan can be below full recompute):
                # that step fitted, full recompute may not
                every = replan(
                    self.cfg.model_copy(update={"policy": "recompute_all", "memory_budget_gb": bar / GB})
                )
            if every is not None and every.predicted_step_peak_bytes < measured:
                logger.warning(
                    "dsx activation offload: the planned step peaked at %.2f GiB, over its bar of %.2f GiB, and "
                    "the model has no plan with a margin for that (%s); trying recompute for every layer "
                    "(predicted %.2f GiB)",
                    measured / GB,
                    bar / GB,
                    exc,
                    every.predicted_step_peak_bytes / GB,
                )
                install(every)
                self.meter.mark()
                return
            self.left = 0
            logger.warning(
                "dsx activation offload: the planned step peaked at %.2f GiB, over its bar of %.2f GiB, and no "
                "plan with a margin for that exists (%s)%s; keeping the current plan",
                measured / GB,
                bar / GB,
                exc,
                ""
                if every is None
                else f", recompute for every layer is predicted at "
                f"{every.predicted_step_peak_bytes / GB:.2f} GiB",
            )
            return
        if rank_and_world()[0] == 0:
            logger.warning(
                "dsx activation offload: the planned step peaked at %.2f GiB against a bar of %.2f GiB (%s; "
                "predicted %.2f GiB); planning again against %.2f GiB",
                measured / GB,
                bar / GB,
                "memory_budget_gb" if bar == budget else "the step's peak after the layers' backward",
                plan.predicted_step_peak_bytes / GB,
                self.model_budget / GB,
            )
        install(new)
        self.meter.mark()
