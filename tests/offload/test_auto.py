"""Policy ``auto`` on CPU: the profiling step (kept or recomputed, selective recompute, gradient accumulation),
the plan it installs, partial layers and budget calibration; gradients stay bitwise equal throughout."""

from __future__ import annotations

import copy
import logging
import os
import time

import pytest
import torch

from dsx.config import SchedulerConfig
from dsx.offload import ActivationOffload, reads
from dsx.offload.plan import Action
from dsx.offload.profile import Profiler
from dsx.runtime.scheduler import Scheduler
from tests.offload._offload_models import TinyGPT, assert_same_grads
from tests.offload._runs import (
    _batches,
    _calls_per_step,
    _cfg,
    _one_gib_budget_run,
    _reference,
    _steps,
    _train,
    _train_with_plans,
    slow_ssd_reads,
)


@pytest.mark.parametrize("tiers", [["host"], ["ssd"]])
def test_offload_all_with_recompute_modules_bitwise(tmp_path, tiers):
    model, batches, want = _reference(3, 3)
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(model, _cfg(tmp_path, tiers, recompute_modules=["CoreAttention"]), sched)
    try:
        assert all(type(b.attn.forward).__name__ == "function" for b in model.blocks), "attention not wrapped"
        got = _steps(model, batches, off)
        moved = sched.telemetry.history[0].bytes_by_tier.get(tiers[-1], 0)
    finally:
        off.close()
        sched.close()
    assert moved > 0
    assert all("forward" not in b.attn.__dict__ for b in model.blocks), "close() left the wrapper"
    assert_same_grads(want, got)


def test_auto_profiles_selective_bytes_and_moves_what_it_predicts(tmp_path):
    """The profiled +sel bytes are exactly what the layer moves with its recompute modules recomputed."""
    model, batches, want = _reference(4, 4, make=lambda: TinyGPT(by_keyword=True))
    sched = Scheduler(SchedulerConfig(io_workers=2))
    cfg = _cfg(tmp_path, ["host"], policy="auto", recompute_modules=["CoreAttention"], profile_warmup_steps=0)
    off = ActivationOffload(model, cfg, sched)
    n = len(model.blocks)
    try:
        # step 0 profiles; step 1 moves everything outside attention; step 2 everything; step 3 mixes
        got = _steps(model, batches, off, [[Action.HOST_SEL] * n, [Action.HOST] * n,
                                           [Action.KEEP_SEL, Action.HOST_SEL, Action.KEEP]])  # fmt: skip
        profiles = off.plan.profiles
        hist = sched.telemetry.history
    finally:
        off.close()
        sched.close()
    assert_same_grads(want, got)
    for p in profiles:
        assert p.sel_saved_bytes is not None and 0 < p.sel_saved_bytes < p.saved_bytes
        assert p.sel_recompute_s > 0
    assert hist[1].bytes_by_tier["host"] == sum(p.sel_saved_bytes for p in profiles)
    assert hist[2].bytes_by_tier["host"] == sum(p.saved_bytes for p in profiles)
    assert hist[3].bytes_by_tier["host"] == profiles[1].sel_saved_bytes


@pytest.mark.parametrize("warmup", [1, 2])
def test_outside_time_comes_from_the_last_warm_up_step(tmp_path, warmup):
    """The step's time outside the layers is the last warm-up step's wall time less the profiled layers'
    (the profiled step's synchronizations stretch its own); with one warm-up step, the first step, which pays
    for lazy initialisation, it is the profiled step's. Here the head sleeps 1 s in every step but the
    profiled one, where it sleeps 4 s: a warm-up step's outside time stays under 3 s, allowing 2 s of stretch
    from a loaded two-core machine."""
    model, batches, _ = _reference(5, warmup + 2)
    delay = [1.0]
    model.head.register_forward_hook(lambda *a: time.sleep(delay[0]))
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(
        model, _cfg(tmp_path, ["host"], policy="auto", profile_warmup_steps=warmup), sched
    )

    def slow_profiled_step(step: int) -> None:  # (after step i) the profiled step is step ``warmup``
        delay[0] = 4.0 if step + 1 == warmup else 1.0

    try:
        _steps(model, batches, off, after=slow_profiled_step)
        outside = off.plan.outside_s
        gaps = [p.gap_s for p in off.plan.profiles]
    finally:
        off.close()
        sched.close()
    if warmup == 1:
        assert outside >= 4.0
    else:
        assert 0.5 < outside < 3.0
    # the head runs in the gap after the last layer's forward, timed in the profiled step itself (4 s of sleep);
    # between layers nothing is timed
    assert 4.0 <= gaps[-1] < 5.5 and all(g is None for g in gaps[:-1]), gaps


@pytest.mark.parametrize("floored", [False, True])
def test_partial_moves_move_what_the_plan_counts(tmp_path, floored):
    """A hide-only plan moves part of a layer (its first saved storages, each that still fits under the
    cap, and with a floor only those at least that large): the profile records the storages in save order,
    and plan.movable() predicts the bytes the runtime then moves, for caps that fall between storage sizes."""
    from dsx.offload.plan import MoveCap, movable

    model, batches, want = _reference(12, 3)
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(model, _cfg(tmp_path, ["host"], policy="auto", profile_warmup_steps=0), sched)
    profiles, caps = [], {}

    def partial_moves(step: int) -> None:  # after the profiling step: parts of every layer, to the host
        if step == 0:
            profiles.extend(off.plan.profiles)
            caps.update(
                {
                    # a floor in the middle of the layer's sizes: its smaller storages stay, whatever the cap
                    i: MoveCap(
                        int(p.saved_bytes * f),
                        sorted(p.saved_sizes)[len(p.saved_sizes) // 2] if floored else 0,
                    )
                    for i, (p, f) in enumerate(zip(profiles, (0.31, 0.55, 0.83)))
                }
            )
            off._apply([Action.HOST] * len(profiles), 1, caps)

    try:
        got = _steps(model, batches, off, after=partial_moves)
        moved = [h.bytes_by_tier.get("host", 0) for h in sched.telemetry.history]
    finally:
        off.close()
        sched.close()
    assert_same_grads(want, got)
    for p in profiles:
        assert sum(p.saved_sizes) == p.saved_bytes and len(p.saved_sizes) > 3
    want_moved = sum(movable(p, Action.HOST, caps[i]) for i, p in enumerate(profiles))
    assert 0 < want_moved < sum(caps.values())  # the caps fall between storages: less than the caps moves
    assert moved[1:] == [want_moved, want_moved]


def test_profiler_times_backward_of_keyword_called_layers(tmp_path, monkeypatch):
    """Megatron passes hidden_states by keyword: each layer's backward time must still be its own. Time is a
    clock the test advances by 0.1 s inside each block's backward (hooks that fired back to back, or around
    the wrong layer, would give 0 or 0.2)."""
    from dsx.offload.profile import Profiler

    clock = [1000.0]
    monkeypatch.setattr(Profiler, "_now", lambda self: clock[0])

    def tick(*_):
        clock[0] += 0.1

    torch.manual_seed(5)
    model = TinyGPT(d=128, layers=3, heads=4, seq=64, by_keyword=True)
    for blk in model.blocks:
        blk.attn.register_full_backward_hook(tick)
    sched = Scheduler()
    off = ActivationOffload(model, _cfg(tmp_path, ["host"], policy="none"), sched)
    prof = Profiler(off.layers, off.hooks, off.device)
    try:
        model(torch.randint(0, 64, (8, 64))).float().pow(2).mean().backward()
        profiles = prof.finish()
    finally:
        off.close()
        sched.close()
    assert [p.bwd_s for p in profiles] == pytest.approx([0.1, 0.1, 0.1])


def _test_clock(monkeypatch):
    """The profiler's clock made the test's: ``advance(s)`` is a module hook (or a call) that moves it on by ``s``,
    so that the profiled times are exact on any machine."""
    import dsx.offload.profile as profile

    clock = [1000.0]
    monkeypatch.setattr(profile.Profiler, "_now", lambda self: clock[0])

    def advance(s: float):
        def hook(*_):
            clock[0] += s

        return hook

    return advance


def _two_profiled_steps(model, tmp_path, mode, micro_batches, after_backward=lambda: None):
    """Policy ``auto`` profiling the first of two steps (``profile_mode`` ``mode``), each of ``micro_batches``
    forwards and backwards, then ``after_backward()`` and the optimizer step: the plan it made."""
    sched = Scheduler()
    cfg = _cfg(tmp_path, ["host"], policy="auto", profile_warmup_steps=0, profile_mode=mode)
    off = ActivationOffload(model, cfg, sched)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batches = _batches("gpt", 2 * micro_batches)
        for step in range(2):
            opt.zero_grad()
            for x in batches[step * micro_batches : (step + 1) * micro_batches]:
                model(x).float().pow(2).mean().backward()
            after_backward()
            opt.step()
            off.end_step()
        return off.plan
    finally:
        off.close()
        sched.close()


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_profile_measures_the_step_outside_the_layers(tmp_path, mode, monkeypatch):
    """The printed prediction covers the whole step: the profiling step's time outside the layers (here 0.2 s
    where the optimizer runs) is measured and added; the layers' own time, their recomputation under
    profile_mode recompute included (0.25 s in each attention, which the recomputation runs again), is not
    counted outside. Time is a clock the test advances, so the figures are exact on any machine."""
    advance = _test_clock(monkeypatch)
    torch.manual_seed(11)
    model = TinyGPT(by_keyword=True)
    for b in model.blocks:
        b.attn.register_forward_pre_hook(advance(0.25))
    plan = _two_profiled_steps(model, tmp_path, mode, micro_batches=1, after_backward=advance(0.2))
    assert plan.outside_s == pytest.approx(0.2)
    assert plan.predicted_total_step_s == pytest.approx(plan.predicted_step_s + plan.outside_s)
    assert plan.predicted_step_s >= 0.25 * len(model.blocks)  # each layer's forward, once
    text = plan.describe()
    assert f"predicted step {plan.predicted_total_step_s * 1e3:.1f} ms" in text
    assert f"{plan.outside_s * 1e3:.1f} outside them" in text


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_profile_times_the_gap_after_the_last_forward(tmp_path, mode, monkeypatch):
    """The last layer's gap_s is the time from its forward's end to its own backward: the head's 0.3 s here,
    per micro-batch over the two of a step with gradient accumulation, exactly (the clock is the test's); the
    0.05 s before each layer's forward (host time in a synchronized step) is no gap."""
    advance = _test_clock(monkeypatch)
    torch.manual_seed(12)
    model = TinyGPT(by_keyword=True)
    model.head.register_forward_hook(advance(0.3))
    for b in model.blocks:
        b.register_forward_pre_hook(advance(0.05))
        b.attn.register_forward_pre_hook(advance(0.25))
    gaps = [p.gap_s for p in _two_profiled_steps(model, tmp_path, mode, micro_batches=2).profiles]
    assert gaps[-1] == pytest.approx(0.3) and all(g is None for g in gaps[:-1]), gaps


def test_unknown_recompute_module_is_a_clear_error(tmp_path):
    model = TinyGPT()
    with pytest.raises(ValueError, match=r"recompute_modules \['Nope'\] match no sub-module.*CoreAttention"):
        ActivationOffload(model, _cfg(tmp_path, ["ssd"], recompute_modules=["Nope"]), Scheduler())
    assert not model._forward_pre_hooks and not any(b._forward_pre_hooks for b in model.blocks)
    assert not os.listdir(tmp_path / "ssd"), "a run directory was created before the config was checked"


def test_auto_profiles_after_warmup_steps(tmp_path):
    model, batches, want = _reference(6, 4)
    sched = Scheduler()
    cfg = _cfg(tmp_path, ["host"], policy="auto", profile_warmup_steps=2, write_barrier="on")
    off = ActivationOffload(model, cfg, sched)
    got, plans = _train_with_plans(model, batches, off, sched)
    assert plans[0] is None and plans[1] is None and plans[2] is not None
    assert all(p.saved_bytes > 0 and p.fwd_s > 0 for p in plans[2].profiles)
    # the plan's write barrier is what the hooks wait by
    assert len(plans[2].write_barrier) == len(plans[2].actions) + 1
    assert off.hooks.write_barrier == plans[2].write_barrier
    assert_same_grads(want, got)


def test_auto_replans_when_the_planned_step_peaks_over_the_budget(tmp_path):
    """A planned step measured over memory_budget_gb (the cost model missed bytes) makes the planner plan
    again against the budget lowered by the overshoot; gradients stay bitwise equal throughout. On CPU there
    is no peak to read, so the measurement is stubbed: on the first calibration the step is said to have
    peaked at budget + overshoot, on the second within the budget."""
    model, batches, want, off, sched = _one_gib_budget_run(tmp_path)
    budget = 1 << 30
    measured: list[int] = []

    def fake_peak() -> int:
        keep_all = off.plan.bound["keep_all_bytes"]
        # over the budget by (budget - keep_all / 2): the re-plan must fit keep_all / 2
        measured.append(2 * budget - keep_all // 2 if not measured else budget // 2)
        return measured[-1]

    off.calibration.meter.since_mark = fake_peak  # type: ignore[method-assign]
    got, plans = _train_with_plans(model, batches, off, sched)
    first, second = plans[0], plans[1]
    keep_all = first.bound["keep_all_bytes"]
    assert first.peak_bytes > keep_all // 2  # a 1 GiB budget leaves the tiny model's plan free
    assert second is not first and second.peak_bytes <= keep_all // 2  # planned with the margin
    assert len(measured) == 2 and plans[2] is second and plans[4] is second  # within budget: no more re-plans
    assert_same_grads(want, got)


@pytest.mark.parametrize("layers_over", [False, True])
def test_the_steps_tail_over_the_budget_is_the_bar(tmp_path, caplog, layers_over):
    """Where the step's peak after the layers' backward (the gradients' reduction, the optimizer) is over the
    budget by itself, the controller says so once, with what to do, and plans the layers against that peak (the
    step reaches it anyway); a planned step measured at the tail is not re-planned, one measured over it (the
    layers over the tail) is, against the tail less the overshoot. The tail is a CUDA measurement: on CPU the
    profiler's figure is set, and the step's measured peak stubbed, as in the re-plan test above."""
    model, batches, want, off, sched = _one_gib_budget_run(tmp_path)
    budget = 1 << 30
    tail = 3 * budget
    off.profiler.outside_peak = tail
    measured: list[int] = []

    def fake_peak() -> int:  # the first planned step: at the tail (allocator rounding) or a GiB over it
        measured.append(tail + (budget if layers_over and not measured else 1 << 20))
        return measured[-1]

    off.calibration.meter.since_mark = fake_peak  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="dsx.offload"):
        got, plans = _train_with_plans(model, batches, off, sched)
    first = plans[0]
    assert first.outside_peak_bytes == tail and first.predicted_step_peak_bytes == tail
    assert first.bound["budget_bytes"] == tail  # planned against the tail
    warned = [
        r.getMessage() for r in caplog.records if "no activation plan lowers that part" in r.getMessage()
    ]
    assert len(warned) == 1 and "set memory_budget_gb to at least 3.00" in warned[0]
    if layers_over:  # re-planned against the tail less the GiB over it, then measured at the tail
        assert len(measured) == 2 and plans[1] is not first and plans[4] is plans[1]
        assert plans[1].bound["budget_bytes"] == tail - budget
    else:  # measured once, at the tail: never re-planned
        assert len(measured) == 1 and all(p is first for p in plans)
    assert_same_grads(want, got)


def test_a_tail_under_the_budget_gives_no_slack(tmp_path):
    """The 1 % slack for the tail's rounding applies only where the tail is the bar: with the tail under the
    budget, a step 0.5 % over the budget is re-planned."""
    model, batches, want, off, sched = _one_gib_budget_run(tmp_path)
    budget = 1 << 30
    off.profiler.outside_peak = budget - budget // 1000  # just under the budget
    measured: list[int] = []

    def fake_peak() -> int:
        measured.append(budget + budget // 200 if not measured else budget // 2)
        return measured[-1]

    off.calibration.meter.since_mark = fake_peak  # type: ignore[method-assign]
    got, plans = _train_with_plans(model, batches, off, sched)
    assert plans[0].bound["budget_bytes"] == budget  # (the tail is under it: planned against the budget)
    assert len(measured) == 2 and plans[1] is not plans[0]
    assert_same_grads(want, got)


def test_partial_layer_moves_up_to_its_cap_bitwise(tmp_path):
    """The planner's partial layer: its first saved storages move, up to the cap; the rest stays; same grads."""

    def run(model, batches, caps):
        sched = Scheduler(SchedulerConfig(io_workers=2))
        off = ActivationOffload(model, _cfg(tmp_path, ["host"], policy="none"), sched)
        try:
            off._apply([Action.HOST] + [Action.KEEP] * (len(off.layers) - 1), 1, caps)
            grads = _train(model, batches, off)
            return grads, [r.bytes_by_tier.get("host", 0) for r in sched.telemetry.history]
        finally:
            off.close()
            sched.close()

    sizing, batches, _ = _reference(5, 1)
    whole = run(sizing, batches, None)[1][0]  # what layer 0 moves when it moves everything
    cap = whole // 3
    model, batches, want = _reference(5, 3)
    got, moved = run(model, batches, {0: cap})
    assert whole > 0 and len(moved) == 3 and all(0 < m <= cap for m in moved), (whole, cap, moved)
    assert_same_grads(want, got)


@pytest.mark.parametrize(
    "actions",
    [
        [Action.RECOMPUTE_HOST] * 3,
        [Action.RECOMPUTE_SSD] * 3,
        [Action.RECOMPUTE_HOST, Action.HOST, Action.KEEP],
    ],
    ids=["rh-rh-rh", "rs-rs-rs", "rh-h-k"],
)
def test_recompute_with_its_inputs_moved_bitwise(tmp_path, actions):
    """recompute+<tier>: what the layer's checkpoint keeps (its input hidden state) moves and comes back for
    the recomputation; gradients stay bitwise equal and the inputs are all a recomputed layer moves."""
    model, batches, want = _reference(8, 3)
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(model, _cfg(tmp_path, ["host", "ssd"], policy="recompute_all"), sched)
    try:
        off._apply(actions, 1)
        got = _train(model, batches, off)
        hist = sched.telemetry.history
        tier = actions[0].tier.value  # (an SSD write also counts its staging copy under host)
        moved = [r.bytes_by_tier.get(tier, 0) for r in hist]
        read = [r.bytes_by_tier.get(f"{tier}_read", 0) for r in hist]
    finally:
        off.close()
        sched.close()
    assert moved == read  # everything written came back
    hidden = batches[0].numel() * model.tok.embedding_dim * 4  # one float32 hidden state
    n_rc = sum(a.recomputed and a.moved for a in actions)
    if actions[1] == Action.HOST:  # a layer that moves everything it saves: more than its input
        assert all(m > (n_rc + 1) * hidden for m in moved), (moved, hidden)
    else:
        assert moved == [n_rc * hidden] * len(batches), (moved, hidden)
    assert_same_grads(want, got)


@pytest.mark.parametrize(("budget", "mask"), [(None, False), (1.0, False), (None, True)])
def test_profile_under_recompute_sees_what_keeping_sees(tmp_path, budget, mask):
    """profile_mode recompute (the default with a budget): the warm-up and profiling steps recompute every
    layer (the attention runs twice a step) and the profile counts the same bytes as a step that keeps
    everything: saved, saved with the recompute modules recomputed, inputs; gradients stay bitwise. A mask
    handed to every layer counts in neither (it stays on the device)."""
    runs = {}
    for mode in ("keep", "recompute" if budget is None else "auto"):
        model, batches, want = _reference(9, 4, make=lambda: TinyGPT(by_keyword=True, shared_mask=mask))
        sched = Scheduler(SchedulerConfig(io_workers=2))
        cfg = _cfg(tmp_path, ["host"], policy="auto", recompute_modules=["CoreAttention"],
                   profile_warmup_steps=1, profile_mode=mode, memory_budget_gb=budget if mode != "keep" else None)  # fmt: skip
        off = ActivationOffload(model, cfg, sched)
        got, plans, calls = _calls_per_step(model, batches, off, sched)
        assert_same_grads(want, got)
        runs[mode] = (plans, calls)
    (kp, kcalls), (rp, rcalls) = runs["keep"], runs["recompute" if budget is None else "auto"]
    n = len(kp[1].profiles)
    assert kp[0] is None and rp[0] is None and kp[1] is not None and rp[1] is not None
    assert kcalls[:2] == [n, n] and rcalls[:2] == [2 * n, 2 * n], (kcalls, rcalls)
    hidden = 2 * 16 * 32 * 4
    for a, b in zip(rp[1].profiles, kp[1].profiles):
        assert a.saved_bytes == b.saved_bytes > a.input_bytes
        assert a.sel_saved_bytes == b.sel_saved_bytes and 0 < a.sel_saved_bytes < a.saved_bytes
        assert a.input_bytes == b.input_bytes == hidden
        assert a.fwd_s > 0 and a.bwd_s > 0 and a.sel_recompute_s > 0 and not a.recompute_only


def test_profile_under_recompute_with_the_inputs_on_the_host(tmp_path):
    """profile_mode recompute+host: the warm-up and profiling steps move each layer's input to the host tier (its
    checkpoint's one saved tensor) and read it back for the recomputation, so that they hold no layer's input
    on the device; the profile counts what profile_mode recompute counts, the plan made from it is the same,
    and the gradients stay bitwise equal."""
    runs = {}
    for mode in ("recompute", "recompute+host"):
        model, batches, want = _reference(9, 4, make=lambda: TinyGPT(by_keyword=True))
        sched = Scheduler(SchedulerConfig(io_workers=2))
        cfg = _cfg(tmp_path, ["host"], policy="auto", recompute_modules=["CoreAttention"],
                   profile_warmup_steps=1, profile_mode=mode, memory_budget_gb=1.0)  # fmt: skip
        off = ActivationOffload(model, cfg, sched)
        got, plans, calls = _calls_per_step(model, batches, off, sched)
        assert_same_grads(want, got)
        hist = sched.telemetry.history
        moved = [(r.bytes_by_tier.get("host", 0), r.bytes_by_tier.get("host_read", 0)) for r in hist]
        runs[mode] = (plans, calls, moved, off.hooks.write_barrier)
    (rp, rcalls, rmoved, _), (hp, hcalls, hmoved, barrier) = runs["recompute"], runs["recompute+host"]
    n = len(rp[1].profiles)
    hidden = 2 * 16 * 32 * 4  # one float32 hidden state: what each layer's checkpoint keeps
    assert rcalls[:2] == hcalls[:2] == [2 * n, 2 * n]  # every layer recomputed in both
    assert rmoved[:2] == [(0, 0), (0, 0)]
    assert hmoved[:2] == [(n * hidden, n * hidden)] * 2, hmoved  # each input out and back, nothing else
    assert hmoved[2:] == rmoved[2:] and hp[1].actions == rp[1].actions  # the same plan, run alike
    for a, b in zip(hp[1].profiles, rp[1].profiles):
        assert a.saved_bytes == b.saved_bytes > a.input_bytes == b.input_bytes == hidden
        assert a.saved_sizes == b.saved_sizes and a.sel_saved_bytes == b.sel_saved_bytes > 0
        assert a.fwd_s > 0 and a.bwd_s > 0 and not a.recompute_only
    assert barrier == hp[1].write_barrier  # the plan's barrier replaced the profiling steps' fixed one


def test_profile_inputs_the_host_pool_cannot_hold_go_to_the_ssd_tier(tmp_path, monkeypatch):
    """profile_mode recompute+host with the SSD tier listed: once the host pool would keep fewer staging slots
    than the drive's writes and reads need (one write, the backward's layer and its prefetch: three here), the
    rest go to the drive, staged through that room, not stay on the device: the profiling steps move every
    layer's input, some to each tier, read each back, and no read needs a buffer outside the pool; the profile
    is the one profile_mode recompute measures, the gradients stay bitwise equal, and the plan's steps run as
    the plan says."""
    outside = []
    real = reads.aligned_empty
    monkeypatch.setattr(reads, "aligned_empty", lambda *a: outside.append(a) or real(*a))
    n, hidden = 4, 2 * 16 * 32 * 4  # one float32 hidden state a layer: what each checkpoint keeps
    runs = {}
    for mode in ("recompute", "recompute+host"):
        model, batches, want = _reference(9, 4, make=lambda: TinyGPT(by_keyword=True, layers=n))
        sched = Scheduler(SchedulerConfig(io_workers=2))
        (tmp_path / mode).mkdir()
        cfg = _cfg(tmp_path / mode, ["host", "ssd"], policy="auto", recompute_modules=["CoreAttention"],
                   profile_warmup_steps=1, profile_mode=mode, memory_budget_gb=1.0,
                   host_pool_gb=5 * hidden / 2**30)  # fmt: skip
        off = ActivationOffload(model, cfg, sched)
        got, plans, _ = _calls_per_step(model, batches, off, sched)
        assert_same_grads(want, got)
        hist = sched.telemetry.history
        moved = [
            {t: r.bytes_by_tier.get(t, 0) for t in ("host", "host_read", "ssd", "ssd_read")} for r in hist
        ]
        runs[mode] = (plans, moved, off.mover.overflow_slots)
        off.close()
    (rp, rmoved, _), (hp, hmoved, overflow_after) = runs["recompute"], runs["recompute+host"]
    assert rmoved[:2] == [dict.fromkeys(rmoved[0], 0)] * 2
    # the pool holds two inputs and keeps three slots' room, through which the other two reach the drive
    for step in hmoved[:2]:
        assert step["ssd"] == step["ssd_read"] == 2 * hidden, hmoved
        assert step["host_read"] == 2 * hidden and step["host"] >= 2 * hidden, hmoved
    assert outside == [], "an SSD read of the profiling steps found no staging slot in the pool"
    assert overflow_after == 0  # the plan names each layer's tier
    assert hp[1].actions == rp[1].actions and hmoved[2:] == rmoved[2:]
    for a, b in zip(hp[1].profiles, rp[1].profiles):
        assert a.saved_bytes == b.saved_bytes > a.input_bytes == b.input_bytes == hidden
        assert a.saved_sizes == b.saved_sizes and a.sel_saved_bytes == b.sel_saved_bytes > 0


@pytest.mark.parametrize("warmup", [1, 2])
def test_profile_leaves_out_the_wait_for_a_slow_drive(tmp_path, monkeypatch, warmup):
    """profile_mode recompute+host with the inputs the pool cannot hold on a drive whose reads take 1 s: the
    layers whose inputs come back from it are profiled at their own backward time, not with the wait for the
    read (the plan models the read from the drive's measured rate: counted in the profile too, it would count
    twice), and neither the gap after the last forward nor the time outside the layers takes the waits in:
    with one warm-up step that time comes from the profiled step's wall time, with two from the last warm-up
    step's. The telemetry still records the waits, which the profile leaves out. (Each time is bounded at 0.6 s,
    which a layer's or the head's own time stays under on two loaded cores, and a wait of 1 s, counted, does
    not.)"""
    delay, bound = 1.0, 0.6
    slow_ssd_reads(monkeypatch, delay)
    n, hidden = 4, 2 * 16 * 32 * 4  # one float32 hidden state a layer: what each checkpoint keeps
    model, batches, want = _reference(9, warmup + 2, make=lambda: TinyGPT(by_keyword=True, layers=n))
    sched = Scheduler(SchedulerConfig(io_workers=2))
    cfg = _cfg(tmp_path, ["host", "ssd"], policy="auto", profile_warmup_steps=warmup,
               profile_mode="recompute+host", memory_budget_gb=1.0, host_pool_gb=5 * hidden / 2**30)  # fmt: skip
    off = ActivationOffload(model, cfg, sched)
    try:
        got, plans = _train_with_plans(model, batches, off, sched)
    finally:
        off.close()
    assert_same_grads(want, got)
    for step in sched.telemetry.history[: warmup + 1]:  # the warm-up steps and the profiled one
        assert step.bytes_by_tier.get("ssd_read", 0) == 2 * hidden  # two layers' inputs came from the drive
        # and the backward waited for them (their reads start at the forward's end: the head's time is off it)
        assert step.stall_by.get("unpack", 0.0) >= delay / 2, step.stall_by
    plan = plans[warmup]
    assert plan is not None and plans[warmup - 1] is None
    assert all(p.bwd_s < bound for p in plan.profiles), [p.bwd_s for p in plan.profiles]
    assert plan.profiles[-1].gap_s < bound, plan.profiles[-1].gap_s
    assert plan.outside_s < bound, plan.outside_s


def test_a_drive_full_while_the_profile_overflows_to_it_holds_no_layer_to_the_host_after(tmp_path, caplog):
    """The drive refuses an overflowed input (its tier full): that input stays in the pool, training goes on,
    and once the plan is in force no layer is held to the host tier for it (the plan did not size the pool
    for that)."""
    hidden = 2 * 16 * 32 * 4
    model, batches, want = _reference(9, 4, make=lambda: TinyGPT(by_keyword=True, layers=4))
    sched = Scheduler(SchedulerConfig(io_workers=2))
    cfg = _cfg(tmp_path, ["host", "ssd"], policy="auto", recompute_modules=["CoreAttention"],
               profile_warmup_steps=1, profile_mode="recompute+host", memory_budget_gb=1.0,
               host_pool_gb=5 * hidden / 2**30, ssd_capacity_gb=hidden / 2**30)  # fmt: skip
    off = ActivationOffload(model, cfg, sched)
    demoted = []
    orig_end = off.end_step

    def end_step() -> None:
        demoted.append(set(off.mover.demoted))
        orig_end()

    off.end_step = end_step  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="dsx"):
        got, plans = _train_with_plans(model, batches, off, sched)
    off.close()
    assert_same_grads(want, got)
    assert "SSD tier full" in caplog.text
    assert demoted[0], demoted  # the profiling steps held the refused layer to the host
    assert plans[-1] is not None and all(not d for d in demoted[2:]), demoted


def test_profile_memory_points_subtract_the_inputs_on_the_device_only():
    """What the profiler subtracts from its memory points under recompute+host: at a forward's start no moved
    input (the device was synchronized and the copies freed), in the gap after a layer that layer's own (its
    copy out is still allocated), at a backward's start those asked back. Bytes that did not move (a full pool)
    are always there. With nothing moved it is every input, as profile_mode recompute counts."""

    class Moves:  # the two questions the profiler asks of the layer hooks
        def __init__(self, moved: dict[int, int], back: set[int]) -> None:
            self.moved, self.back = moved, back

        def moved_bytes(self, i: int) -> int:
            return self.moved.get(i, 0)

        def read_back(self, i: int) -> bool:
            return i in self.back

    layers = [torch.nn.Linear(2, 2) for _ in range(3)]
    prof = Profiler(layers, Moves({0: 100, 1: 100, 2: 60}, {1, 2}), torch.device("cpu"), under_recompute=True)
    prof.in_bytes = [100, 100, 100]
    assert prof._saved_upto(2) == 40  # only what layer 2 could not move
    assert prof._saved_upto(1, "gap") == 100 and prof._saved_upto(2, "gap") == 100
    assert prof._saved_upto(2, "b") == 200 and prof._saved_upto(0, "b") == 0
    prof.hooks = Moves({}, set())
    assert [prof._saved_upto(2, at) for at in ("f", "gap", "b")] == [300] * 3


def test_profile_under_recompute_with_frozen_embeddings(tmp_path):
    """A layer whose input needs no grad runs through the non-reentrant checkpoint, where the profile cannot
    count its saved tensors: it is timed, marked recompute_only and recomputed by the plan; the gradients
    of every trainable parameter stay bitwise equal."""

    def train(model, batches, off=None):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        out, plans = [], []
        for x in batches:
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            out.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
            opt.step()
            if off is not None:
                off.end_step()
                plans.append(off.plan)
        return out, plans

    torch.manual_seed(3)
    ref = TinyGPT()
    ref.tok.requires_grad_(False)
    ref.pos.requires_grad_(False)
    model = copy.deepcopy(ref)
    batches = _batches("gpt", 3, seed=5)
    want, _ = train(ref, batches)
    sched = Scheduler()
    cfg = _cfg(tmp_path, ["host"], policy="auto", profile_warmup_steps=0, profile_mode="recompute")
    off = ActivationOffload(model, cfg, sched)
    try:
        got, plans = train(model, batches, off)
    finally:
        off.close()
        sched.close()
    prof = plans[0].profiles
    assert prof[0].recompute_only and prof[0].fwd_s > 0
    assert all(not p.recompute_only and p.saved_bytes > 0 for p in prof[1:])
    assert plans[0].actions[0].recomputed
    assert len(got) == len(want) and all(len(g) > 0 for g in got)
    assert_same_grads(want, got)


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_profile_counts_bytes_per_micro_batch_under_gradient_accumulation(tmp_path, mode):
    """Two micro-batches per step recompute (or save) twice: the profile still counts one micro-batch's
    bytes, the same as a step of one micro-batch; an evaluation forward under no_grad before the first
    micro-batch's backward does not end the count (its recomputation happens after it)."""
    runs = []
    for accumulate in (1, 2, 0):
        torch.manual_seed(10)
        model = TinyGPT(by_keyword=True)
        sched = Scheduler()
        cfg = _cfg(tmp_path, ["host"], policy="auto", recompute_modules=["CoreAttention"],
                   profile_warmup_steps=0, profile_mode=mode)  # fmt: skip
        off = ActivationOffload(model, cfg, sched)
        try:
            if accumulate:
                for x in _batches("gpt", accumulate, seed=3):
                    model(x).float().pow(2).mean().backward()
            else:  # one micro-batch with an evaluation forward between its forward and its backward
                (x,) = _batches("gpt", 1, seed=3)
                loss = model(x).float().pow(2).mean()
                with torch.no_grad():
                    model(x)
                loss.backward()
            off.end_step()
            runs.append(off.plan.profiles)
        finally:
            off.close()
            sched.close()
    for one, *others in zip(*runs):
        for two in others:
            assert one.saved_bytes == two.saved_bytes > 0
            assert one.input_bytes == two.input_bytes > 0
            assert one.sel_saved_bytes == two.sel_saved_bytes > 0


def test_auto_falls_back_to_recomputing_every_layer_when_no_plan_has_the_margin(tmp_path):
    """A planned step measured far over the budget (more than any plan could save): dsx recomputes every
    layer, measures that, and keeps it once it is within the budget; gradients stay bitwise equal. The peak
    is stubbed as in the re-plan test (CPU has none to read)."""
    model, batches, want = _reference(12, 5)
    sched = Scheduler()
    cfg = _cfg(
        tmp_path, ["host"], policy="auto", profile_warmup_steps=0, memory_budget_gb=1.0, host_pool_gb=0.2
    )
    off = ActivationOffload(model, cfg, sched)
    measured: list[int] = []

    def fake_peak() -> int:
        measured.append(50 << 30 if not measured else 1 << 29)  # 49 GiB over, then half the budget
        return measured[-1]

    off.calibration.meter.since_mark = fake_peak  # type: ignore[method-assign]
    got, plans = _train_with_plans(model, batches, off, sched)
    assert not all(a.recomputed for a in plans[0].actions)  # the tiny model's plan recomputes little
    assert all(a.value == "recompute" for a in plans[1].actions), plans[1].actions
    assert len(measured) == 2 and plans[4] is plans[1]
    assert_same_grads(want, got)


@pytest.mark.parametrize("above", [True, False])
def test_a_hide_only_plan_that_peaks_above_keeping_everything_keeps_everything(tmp_path, above):
    """Without a budget, the planned step is measured once: a peak above the predicted peak of keeping every
    layer (what the model did not see: staging, the allocator) installs the keep-everything plan; a peak
    under it keeps the plan. Gradients stay bitwise equal. On CPU there is no peak to read: it is stubbed."""
    model, batches, want = _reference(7, 5)
    sched = Scheduler()
    # (no host time charged per moved tensor: the tiny model's layers take less than that, so no plan would move)
    cfg = _cfg(tmp_path, ["host"], policy="auto", profile_warmup_steps=0, moved_tensor_host_us=0)
    off = ActivationOffload(model, cfg, sched)
    measured: list[int] = []

    def fake_peak() -> int:
        keep_all = off.plan.bound["keep_all_bytes"]
        measured.append(keep_all + 1 if above else off.plan.peak_bytes)
        return measured[-1]

    off.calibration.meter.since_mark = fake_peak  # type: ignore[method-assign]
    got, plans = _train_with_plans(model, batches, off, sched)
    assert any(a.moved for a in plans[0].actions), "the tiny model's hide-only plan moves a layer"
    assert len(measured) == 1  # one measured step, then no more
    if above:
        assert plans[1] is not plans[0] and all(a == Action.KEEP for a in plans[1].actions)
        assert plans[4] is plans[1]
    else:
        assert all(p is plans[0] for p in plans)
    assert_same_grads(want, got)


def test_the_host_pool_goes_back_only_when_nothing_in_it_is_in_use():
    """A keep-everything plan (the fallback above) gives the pool back; a slot still in use keeps it."""
    from dsx.offload.store import HostPool

    pool = HostPool(1 << 20, pin=False)
    pool.allocate()
    off, view = pool.alloc(5000)
    assert view.numel() >= 5000 and not pool.release()  # a slot in use: kept
    pool.free(off, 5000)
    assert pool.release() and pool._buf is None and not pool.release()
    pool.allocate()  # taken again by the next plan that moves bytes
    assert pool.alloc(5000) is not None


def test_ranks_agree_on_the_slowest_layer_and_the_shortest_gap() -> None:
    """Every rank plans from the same profiles: per field the largest (bytes, times), but the gap after a
    layer's forward is the time writes have there, so the shortest; a gap one rank did not measure is left to
    the others."""
    from dsx.offload.agree import _merge
    from dsx.offload.plan import LayerProfile

    a = LayerProfile(0, "L0", 100, 0.010, 0.020, gap_s=0.004, sel_saved_bytes=None)
    b = LayerProfile(0, "L0", 120, 0.012, 0.018, gap_s=0.003, sel_saved_bytes=60)
    merged = _merge([a, b])
    assert (merged.saved_bytes, merged.fwd_s, merged.bwd_s) == (120, 0.012, 0.020)
    assert merged.gap_s == 0.003 and merged.sel_saved_bytes == 60
    assert _merge([a, LayerProfile(0, "L0", 100, 0.01, 0.02)]).gap_s == 0.004


@pytest.mark.parametrize(
    "mode, tiers, where, says",
    [
        ("recompute", ["host"], "forward", 'set activation_offload.profile_mode to "recompute+host"'),
        ("auto", ["host"], "backward", "'auto', which is 'recompute' under memory_budget_gb"),
        ("recompute", ["ssd"], "forward", 'add "host" to activation_offload.tiers and set'),
        ("recompute+host", ["host"], "backward", 'raise activation_offload.host_pool_gb, or add "ssd"'),
    ],
)
def test_out_of_memory_in_the_profiling_steps_says_what_to_do(tmp_path, mode, tiers, where, says):
    """An out-of-memory error in a warm-up or profiling step under recomputation, in a layer's forward or in its
    recomputation in the backward, leaves with one note that says what to change; in a planned step it has none
    (the plan's own figures are logged). An error in a layer's backward is noted by the engine's ``backward``
    (tests/offload/test_deepspeed.py)."""
    model = TinyGPT()
    raising = [True]

    def out_of_memory(module, args):
        # the checkpoint's forward runs without grad, the recomputation in the backward with it
        if raising[0] and torch.is_grad_enabled() == (where == "backward"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.00 GiB")

    model.blocks[1].attn.register_forward_pre_hook(out_of_memory)
    sched = Scheduler()
    cfg = _cfg(
        tmp_path, tiers, policy="auto", profile_warmup_steps=1, profile_mode=mode, memory_budget_gb=1.0
    )
    off = ActivationOffload(model, cfg, sched)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batches = _batches("gpt", 4)
        for step, x in enumerate(batches):
            raising[0] = step in (0, 1, 3)  # the warm-up step, the profiling step, a planned step
            opt.zero_grad()
            try:
                model(x).float().pow(2).mean().backward()
            except torch.OutOfMemoryError as exc:
                notes = getattr(exc, "__notes__", [])
                if step < 2:
                    assert len(notes) == 1 and says in notes[0], notes
                    assert "policy auto's warm-up or profiling steps" in notes[0]
                else:
                    assert off.plan is not None and not notes, notes
            else:
                assert step == 2 or (step == 3 and off.plan.actions[1] == Action.KEEP), step
            opt.step()
            off.end_step()
    finally:
        off.close()
        sched.close()
