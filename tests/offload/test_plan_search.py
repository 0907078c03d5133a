"""The planner's search: exact on small models, close to exact when greedy, budgets kept or refused clearly,
plans within the tiers, partial layers filling the bound, best effort and the floor."""

from __future__ import annotations

import itertools
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsx.config import ActivationOffloadConfig
from dsx.offload.plan import (
    Action,
    LayerProfile,
    MoveCap,
    PlanError,
    TierBandwidth,
    make_plan,
    movable,
    simulate,
    tier_capacity,
    tier_usage,
)
from dsx.offload.plan.search import _FLOORS
from tests.offload._plans import BW, GiB, _bw, _cfg, _profiles, _sel_profiles, _with_background


@pytest.mark.parametrize("seed", range(8))
def test_exhaustive_is_optimal_and_greedy_is_close(seed: int) -> None:
    rng = random.Random(seed)
    prof = _profiles(rng, 5)
    keep = sum(p.saved_bytes for p in prof)
    cfg = _cfg(memory_budget_gb=keep * rng.uniform(0.3, 0.8) / GiB, prefetch_depth=2)
    bw = _bw(BW, budget=True)
    runs = [
        simulate(prof, list(a), bw, 2) for a in itertools.product([a for a in Action if not a.sel], repeat=5)
    ]
    feasible = [t for t, _, peak in runs if peak <= cfg.memory_budget_gb * GiB]
    if not feasible:  # brute force says no plan fits: the planner must say so too
        with pytest.raises(PlanError):
            make_plan(prof, BW, cfg)
        return
    best = min(feasible)
    exact = make_plan(prof, BW, cfg)
    assert exact.predicted_step_s == pytest.approx(best)
    greedy = make_plan(prof, BW, cfg, exhaustive_limit=0)
    assert greedy.peak_bytes <= cfg.memory_budget_gb * GiB
    assert greedy.predicted_step_s <= best * 1.15
    # the plan says which search chose it
    assert (exact.search, greedy.search) == ("exhaustive", "local")


def test_no_budget_hides_only() -> None:
    rng = random.Random(7)
    prof = _profiles(rng, 12)
    plan = make_plan(prof, BW, _cfg())
    assert plan.predicted_step_s <= plan.bound["baseline_step_s"] * 1.005 + 1e-12
    assert plan.peak_bytes < plan.bound["keep_all_bytes"]
    assert any(a in (Action.HOST, Action.SSD) for a in plan.actions)
    assert "hideable writes" in plan.describe() and "fraction" not in plan.describe()


@pytest.mark.parametrize("seed", range(6))
def test_a_no_budget_plan_lowers_the_peak_or_keeps_everything(seed: int) -> None:
    """Never worse than doing nothing: a hide-only plan that moves bytes predicts a lower activation peak
    than keeping every layer, and one that cannot lower it (a single layer, whose read is issued before the
    peak it would lower) keeps everything."""
    rng = random.Random(seed)
    for prof in (_profiles(rng, 5), _hide_only_profiles(rng, 4), _profiles(rng, 1)):
        plan = make_plan(prof, BW, _cfg())
        if any(a != Action.KEEP for a in plan.actions):
            assert plan.peak_bytes < plan.bound["keep_all_bytes"], [a.value for a in plan.actions]
        else:
            assert not plan.move_caps and plan.peak_bytes == plan.bound["keep_all_bytes"]
    one = make_plan(_profiles(rng, 1), BW, _cfg())
    assert one.actions == [Action.KEEP] and "keeping everything (0.00 GiB lower)" in one.describe()


def test_impossible_budget_is_a_clear_error() -> None:
    prof = _profiles(random.Random(1), 4)
    with pytest.raises(PlanError, match=r"cannot be met: the most frugal plan found keeps"):
        make_plan(prof, [], ActivationOffloadConfig(tiers=["host"], memory_budget_gb=1e-6))


@pytest.mark.parametrize(
    ("policy", "tiers", "expect"),
    [
        ("none", ["host", "ssd"], "keep"),
        ("recompute_all", ["host", "ssd"], "recompute"),
        # the runtime's rule: every layer to the last tier of ``tiers``, at prefetch_depth or 1
        ("offload_all", ["host", "ssd"], "ssd"),
        ("offload_all", ["ssd", "host"], "host"),
        ("offload_all", ["host"], "host"),
    ],
)
def test_fixed_policies(policy: str, tiers: list[str], expect: str) -> None:
    prof = _profiles(random.Random(2), 6)
    plan = make_plan(prof, BW, ActivationOffloadConfig(tiers=tiers, policy=policy))
    assert {a.value for a in plan.actions} == {expect}
    if policy == "offload_all":
        assert plan.prefetch_depth == 1
        assert (
            make_plan(
                prof, BW, ActivationOffloadConfig(tiers=tiers, policy=policy, prefetch_depth=3)
            ).prefetch_depth
            == 3
        )
        # no bandwidth for the last tier: the model cannot time what the runtime would do
        with pytest.raises(ValueError, match="last tier"):
            make_plan(
                prof,
                [b for b in BW if b.tier != tiers[-1]],
                ActivationOffloadConfig(tiers=tiers, policy=policy),
            )


# each example is a whole budgeted search, whose time grows steeply with the layers: the file's slowest part
@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 7), seed=st.integers(0, 10**6), frac=st.floats(0.2, 1.0))
def test_budget_always_respected(n: int, seed: int, frac: float) -> None:
    prof = _profiles(random.Random(seed), n)
    budget = sum(p.saved_bytes for p in prof) * frac / GiB
    try:
        plan = make_plan(prof, BW, _cfg(memory_budget_gb=budget))
    except PlanError:
        return
    assert plan.peak_bytes <= budget * GiB + 1
    assert plan.predicted_step_s >= sum(p.fwd_s + p.bwd_s for p in prof) - 1e-9


@pytest.mark.parametrize("seed", range(4))
def test_selective_beats_full_recompute_under_a_tight_budget(seed: int) -> None:
    rng = random.Random(seed)
    prof = _sel_profiles(rng, 6)
    slow = [TierBandwidth("host", 2e8, 2e8)]  # too slow to hide much: offload alone cannot meet the budget
    bw = _bw(slow, budget=True)
    full = simulate(prof, [Action.RECOMPUTE] * 6, bw, 1)
    budget = full[2] * 1.3 / GiB  # a little above full recompute's peak
    cfg = ActivationOffloadConfig(tiers=["host"], memory_budget_gb=budget, recompute_modules=["Attn"])
    plan = make_plan(prof, slow, cfg)
    assert plan.peak_bytes <= budget * GiB
    assert any(a.sel for a in plan.actions)
    assert plan.predicted_step_s < full[0]
    without = make_plan(
        [LayerProfile(p.index, p.name, p.saved_bytes, p.fwd_s, p.bwd_s) for p in prof], slow, cfg
    )
    assert not any(a.sel for a in without.actions)
    assert plan.predicted_step_s <= without.predicted_step_s


@pytest.mark.parametrize("seed", range(3))
def test_exhaustive_with_selective_matches_brute_force(seed: int) -> None:
    rng = random.Random(100 + seed)
    prof = _sel_profiles(rng, 4)
    bw = _bw(BW, budget=True)
    runs = [simulate(prof, list(a), bw, 1) for a in itertools.product(list(Action), repeat=4)]
    floor, keep_all = min(r[2] for r in runs), sum(p.saved_bytes for p in prof)
    budget = floor + (keep_all - floor) * rng.uniform(0.05, 0.4)
    cfg = _cfg(memory_budget_gb=budget / GiB, prefetch_depth=1, recompute_modules=["Attn"])
    best = min(t for t, _, peak in runs if peak <= budget)
    assert make_plan(prof, BW, cfg).predicted_step_s == pytest.approx(best)
    greedy = make_plan(prof, BW, cfg, exhaustive_limit=0)
    assert greedy.peak_bytes <= budget and greedy.predicted_step_s <= best * 1.15


def test_offload_all_with_recompute_modules_uses_selective_variant() -> None:
    prof = _sel_profiles(random.Random(3), 3)
    prof[1].sel_saved_bytes = None  # a layer without the sub-module keeps the plain action
    plan = make_plan(prof, BW, _cfg(policy="offload_all", recompute_modules=["Attn"]))
    assert [a.value for a in plan.actions] == ["ssd+sel", "ssd", "ssd+sel"]  # the last tier, as the runtime
    assert "+sel" in plan.describe() and "sub ms" in plan.describe()


# (up to 6 layers: the search tries every plan at each prefetch depth, and 7 or 8 drawn made this test's time
# swing tenfold between runs without checking anything fewer layers do not)
@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 6), seed=st.integers(0, 10**6), frac=st.floats(0.2, 1.0))
def test_budget_respected_with_background(n: int, seed: int, frac: float) -> None:
    prof = _with_background(random.Random(seed), n)
    bw = _bw(BW, budget=True)
    keep_peak = simulate(prof, [Action.KEEP] * n, bw, 1)[2]
    budget = keep_peak * frac / GiB
    try:
        plan = make_plan(prof, BW, _cfg(memory_budget_gb=budget))
    except PlanError:
        return
    assert plan.peak_bytes <= budget * GiB + 1
    # the background is there whatever the plan: no plan can predict less than the largest of it
    floor = max(max(p.gap_background_bytes, p.bwd_background_bytes + p.bwd_workspace_bytes) for p in prof)
    assert plan.peak_bytes >= floor


def _lowers_no_further(prof: list[LayerProfile], plan, room: int, bw: dict[str, TierBandwidth]) -> int:
    """Each partial layer moves the fewest bytes that give the plan its peak, and no kept layer has a part
    worth moving: more of a partial layer, or part of a kept one, up to the bound and within the step's limit,
    lowers the peak by less than the 64th of the layer the planner asks of a part."""
    limit = plan.bound["baseline_step_s"] * 1.005
    tried = 0
    for i, a in enumerate(plan.actions):
        if i not in plan.move_caps and a.moved:
            continue
        act = a if a.moved else Action("host+sel" if a.sel else "host")
        acts = [*plan.actions[:i], act, *plan.actions[i + 1 :]]
        worth = max(1 << 20, prof[i].stored(act) // 64)
        cap = plan.move_caps.get(i, 0)
        # a partial layer keeps its floor; a kept one may take one of its largest storage sizes as one, as the
        # search does
        largest = sorted({n for n in prof[i].saved_sizes if n >= 1 << 20}, reverse=True)[:_FLOORS]
        floors = [cap.floor] if i in plan.move_caps else [0, *largest]
        for floor in floors:
            for more in (64 << 20, 256 << 20, 1 << 30, 2 << 30):
                if more <= room:
                    caps = {**plan.move_caps, i: MoveCap(cap + more, floor)}
                    t, _, peak = simulate(prof, acts, bw, plan.prefetch_depth, caps)
                    tried += t <= limit
                    assert t > limit or peak > plan.peak_bytes - worth, (i, caps, more)
        if i in plan.move_caps and cap > 64 << 20:  # and less of a partial layer peaks higher
            less = MoveCap(movable(prof[i], act, MoveCap(cap - (64 << 20), cap.floor)), cap.floor)
            caps = {**plan.move_caps, i: less}
            assert simulate(prof, acts, bw, plan.prefetch_depth, caps)[2] > plan.peak_bytes, (i, caps)
    return tried


def test_hide_only_moves_parts_of_layers_that_lower_the_peak() -> None:
    # 4 layers of 4 GiB, 12 ms forward, 20 ms backward, 55 GB/s: the bound (~2.5 GiB of writes) is less
    # than one layer, so whole layers move nothing; a part of a layer lowers the peak without slowing
    prof = [LayerProfile(i, f"L{i}", 4 * GiB, 0.012, 0.020) for i in range(4)]
    bws = [TierBandwidth("host", 55e9, 55e9)]
    plan = make_plan(prof, bws, ActivationOffloadConfig(tiers=["host"]))
    assert plan.move_caps and all(plan.actions[i] == Action.HOST for i in plan.move_caps)
    assert all(0 < c < 4 * GiB and c % (1 << 20) == 0 for c in plan.move_caps.values())
    assert plan.bound["planned_bytes"] == sum(plan.move_caps.values())
    # bytes moved are memory saved: each part lowers the peak by what it moves
    assert plan.bound["keep_all_bytes"] - plan.peak_bytes >= 0.9 * plan.bound["planned_bytes"] > GiB
    assert plan.predicted_step_s <= plan.bound["baseline_step_s"] * 1.005 + 1e-12
    room = int(plan.bound["hideable_write_bytes"] - plan.bound["planned_bytes"])
    assert _lowers_no_further(prof, plan, room, _bw(bws)) >= 1
    cap = next(iter(plan.move_caps.values()))
    assert f"({cap >> 20}Mi of 4096Mi)" in plan.describe()
    # with a budget no partial layer is made: the search itself moves and recomputes whole layers
    budgeted = make_plan(prof, bws, ActivationOffloadConfig(tiers=["host"], memory_budget_gb=20))
    assert not budgeted.move_caps


@pytest.mark.parametrize("seed", range(4))
def test_partial_layers_are_planned_at_what_their_storages_move(seed: int) -> None:
    # megatron-core-like layers (hidden 2048, micro-batch 8): 64-192 MiB storages around a 2 GiB softmax block
    # and a 1 GiB one, in shuffled order. A storage is not split, so a cap moves the storages that fit in save
    # order; the plan's caps must be exactly that (the runtime then moves what was planned), within the bound,
    # and no partial layer moves bytes that lower no peak
    rng = random.Random(seed)
    mib = 1 << 20
    prof = []
    for i in range(6):
        sizes = [64 * mib] * 6 + [192 * mib, 2048 * mib, 1024 * mib, 128 * mib, 16 << 10, 16 << 10]
        rng.shuffle(sizes)
        prof.append(LayerProfile(i, f"L{i}", sum(sizes), 0.012, 0.020, saved_sizes=sizes))
    bw = [TierBandwidth("host", 55e9, 55e9)]
    plan = make_plan(prof, bw, ActivationOffloadConfig(tiers=["host"]))
    assert plan.move_caps
    for i, cap in plan.move_caps.items():
        assert movable(prof[i], plan.actions[i], cap) == cap >= 1 << 20  # achievable exactly, a MiB or more
        done = 0  # and it is the sum of the storages the runtime's rule picks (LayerHooks._pack)
        for n in prof[i].saved_sizes:
            if n >= cap.floor and done + n <= cap:
                done += n
        assert done == cap
    whole = sum(
        p.saved_bytes for i, p in enumerate(prof) if plan.actions[i].moved and i not in plan.move_caps
    )
    assert plan.bound["planned_bytes"] == whole + sum(plan.move_caps.values())
    assert plan.bound["fraction_of_bound"] <= 1.0 + 1e-9
    assert plan.predicted_step_s <= plan.bound["baseline_step_s"] * 1.005 + 1e-12
    room = int(min(plan.bound["hideable_write_bytes"], plan.bound["hideable_read_bytes"]))
    assert _lowers_no_further(prof, plan, room - plan.bound["planned_bytes"], _bw(bw)) >= 1


@pytest.mark.parametrize(
    ("setting", "budget_gb", "on"),
    [
        ("auto", None, False),
        ("auto", 1e3, True),
        ("on", None, True),
        ("off", 1e3, False),
        ("off", None, False),
    ],
)
def test_write_barrier_setting(setting: str, budget_gb: float | None, on: bool) -> None:
    """``auto`` holds the host only where a budget makes memory the point: with none (hide only) the wait
    cost step time (docs/offload.md) for memory nobody asked for."""
    prof = _profiles(random.Random(4), 5)
    plan = make_plan(prof, BW, _cfg(write_barrier=setting, memory_budget_gb=budget_gb))
    assert (len(plan.write_barrier), len(plan.write_barrier_bwd)) == ((6, 5) if on else (0, 0))
    assert f"write barrier {'on' if on else 'off'}" in plan.describe()


def test_write_barrier_setting_rejects_unknown_values() -> None:
    with pytest.raises(ValueError, match="write_barrier"):
        _cfg(write_barrier="sometimes")


@pytest.mark.parametrize("budget_gb", [None, 8.0])
def test_plans_fit_the_tiers_capacity(budget_gb: float | None) -> None:
    """A plan never moves more than ``host_pool_gb`` holds: the mover would leave the rest on the device,
    over the plan's peak, and could run out of memory. The pool binds: a larger one moves more."""
    # 6 layers of 2 GiB, slow enough that most of them hide behind compute at 55 GB/s (the search is
    # exhaustive, 3^n plans a prefetch depth: more layers only lengthen it)
    prof = [LayerProfile(i, f"L{i}", 2 * GiB, 0.08, 0.16) for i in range(6)]
    bw = [TierBandwidth("host", 55e9, 55e9)]
    moved = {}
    for pool in (3.0, 64.0):
        cfg = ActivationOffloadConfig(tiers=["host"], host_pool_gb=pool, memory_budget_gb=budget_gb)
        plan = make_plan(prof, bw, cfg)
        held = plan.bound["tier_bytes"]["host"]
        assert held == tier_usage(prof, plan.actions, {"host": bw[0]}, plan.move_caps)["host"]
        assert 0 < held <= tier_capacity(cfg)["host"] == plan.bound["tier_capacity_bytes"]["host"]
        assert budget_gb is None or plan.peak_bytes <= budget_gb * GiB
        assert f"host holds {held / GiB:.2f} of" in plan.describe()
        moved[pool] = held
    assert moved[64.0] > 4 * GiB > moved[3.0]
    # offload_all asks for every layer: the printed plan says the pool cannot hold it
    cfg = ActivationOffloadConfig(tiers=["host"], host_pool_gb=3.0, policy="offload_all")
    assert "OVER host_pool_gb" in make_plan(prof, bw, cfg).describe()


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 9), seed=st.integers(0, 10**6), pool=st.floats(0.1, 6.0), frac=st.floats(0.3, 1.0))
def test_auto_plans_stay_within_both_tiers(n: int, seed: int, pool: float, frac: float) -> None:
    rng = random.Random(seed)
    prof = _profiles(rng, n)
    keep = sum(p.saved_bytes for p in prof)
    for budget in (None, keep * frac / GiB):
        cfg = _cfg(host_pool_gb=pool, ssd_capacity_gb=pool / 2, memory_budget_gb=budget)
        try:
            plan = make_plan(prof, BW, cfg, exhaustive_limit=0)
        except PlanError:
            continue
        cap = tier_capacity(cfg)
        usage = tier_usage(prof, plan.actions, _bw(BW), plan.move_caps)
        assert usage["host"] <= cap["host"] and usage["ssd"] <= cap["ssd"], (plan.actions, usage, cap)


def test_recompute_moving_its_inputs_lowers_the_floor() -> None:
    """A recomputed layer keeps its inputs (what its checkpoint starts from); ``recompute+<tier>`` moves them,
    so a budget under full recompute's peak has a plan, and the moved inputs are all the plan writes."""
    rng = random.Random(11)
    n = 6
    prof = _with_background(rng, n)
    for p in prof:
        p.input_bytes = p.saved_bytes // 8
    bw = _bw(BW, budget=True)
    rc_t, _, rc_peak = simulate(prof, [Action.RECOMPUTE] * n, bw, 1)
    mv_t, _, mv_peak = simulate(prof, [Action.RECOMPUTE_HOST] * n, bw, 1)
    assert mv_peak < rc_peak and mv_t >= rc_t
    # the same model without the inputs counted: full recompute would look cheaper than it is
    bare = [LayerProfile(**{**vars(p), "input_bytes": 0}) for p in prof]
    assert simulate(bare, [Action.RECOMPUTE] * n, bw, 1)[2] < rc_peak
    budget = (rc_peak + mv_peak) / 2 / GiB
    plan = make_plan(prof, BW, _cfg(memory_budget_gb=budget))
    assert plan.peak_bytes <= budget * GiB and not plan.over_budget
    assert any(a.recomputed and a.moved for a in plan.actions)
    assert Action.RECOMPUTE_SSD.tier == Action.SSD and Action.RECOMPUTE_HOST.base == Action.RECOMPUTE
    assert Action.HOST_SEL.tier == Action.HOST and Action.KEEP_SEL.tier is None
    moved = sum(p.input_bytes for p, a in zip(prof, plan.actions) if a.recomputed and a.moved)
    moved += sum(p.stored(a) for p, a in zip(prof, plan.actions) if a.moved and not a.recomputed)
    assert plan.bound["planned_bytes"] == moved
    # with no tier to move them to, the floor is full recompute's
    with pytest.raises(PlanError, match="cannot be met"):
        make_plan(prof, [], _cfg(memory_budget_gb=budget))


def test_layers_profiled_only_as_recomputed_are_recomputed() -> None:
    prof = _profiles(random.Random(4), 4)
    prof[0].recompute_only = True
    for p in prof:
        p.input_bytes = p.saved_bytes // 8  # recompute+<tier> is a choice for the other layers
    for budget in (None, 1e6):
        plan = make_plan(prof, BW, _cfg(memory_budget_gb=budget))
        assert plan.actions[0] == Action.RECOMPUTE, plan.actions


# ------------------------------------------------------------------------------------- partial layers, floors
def _hide_only_profiles(rng: random.Random, n: int) -> list[LayerProfile]:
    """Layers of 64 MiB-896 MiB whose writes at a few GB/s take about one layer's forward: filling the bound
    with a partial layer can hold the link while a whole layer's write would have ended."""
    mib = 1 << 20
    return [
        LayerProfile(
            i, f"L{i}", rng.randint(1, 14) * 64 * mib, rng.uniform(0.008, 0.02), rng.uniform(0.02, 0.04)
        )
        for i in range(n)
    ]


def test_filling_the_bound_never_raises_the_peak(monkeypatch) -> None:
    import dsx.offload.plan.search as plan_mod

    fill = plan_mod._fill_bound
    filled = 0
    for seed in range(24):
        rng = random.Random(seed)
        prof = _hide_only_profiles(rng, 6)
        bws = [TierBandwidth("host", rng.uniform(4e9, 10e9), 26e9)]
        cfg = ActivationOffloadConfig(tiers=["host"], host_pool_gb=64)
        plan = make_plan(prof, bws, cfg)
        with monkeypatch.context() as m:  # the whole-layer plan the search found, before any partial layer
            m.setattr(plan_mod, "_fill_bound", lambda p, acts, *_: (list(acts), {}))
            whole = make_plan(prof, bws, cfg)
        assert not whole.move_caps
        assert plan.peak_bytes <= whole.peak_bytes, (seed, plan.move_caps)
        assert plan.predicted_step_s <= plan.bound["baseline_step_s"] * 1.005 + 1e-12
        filled += bool(plan.move_caps)
        # and each fill, at every depth, peaks no higher than the plan it started from
        bw = _bw(bws)
        for d in (1, 2, 3):
            acts, caps = fill(prof, whole.actions, bw, d, whole.bound["baseline_step_s"] * 1.005, 1 << 40,
                              tier_capacity(cfg))  # fmt: skip
            assert simulate(prof, acts, bw, d, caps)[2] <= simulate(prof, whole.actions, bw, d)[2]
    assert filled >= 10  # the fills still happen (those that lower the peak)


@pytest.mark.parametrize("tiers", [["host"], ["host", "ssd"], ["ssd"], ["ssd", "host"]])
def test_the_bound_is_the_device_links(tiers: list[str]) -> None:
    # every moved byte crosses the device->host link first (_forward): a second tier adds no write or read
    # rate; without a host tier the SSD's rates are all there is
    rng = random.Random(31)
    prof = _profiles(rng, 10)
    bws = [TierBandwidth("host", rng.uniform(5e9, 20e9), rng.uniform(20e9, 40e9)),
           TierBandwidth("ssd", rng.uniform(1e9, 5e9), rng.uniform(2e9, 6e9))]  # fmt: skip
    plan = make_plan(prof, bws, ActivationOffloadConfig(tiers=tiers, host_pool_gb=64, ssd_capacity_gb=64))
    link = bws[0] if "host" in tiers else bws[1]
    t_fwd, t_bwd = sum(p.fwd_s for p in prof), sum(p.bwd_s for p in prof)
    assert plan.bound["hideable_write_bytes"] == pytest.approx(link.write_Bps * t_fwd)
    assert plan.bound["hideable_read_bytes"] == pytest.approx(link.read_Bps * t_bwd)
    assert plan.predicted_step_s <= plan.bound["baseline_step_s"] * 1.005 + 1e-12
    if plan.move_caps:  # the partial layers fill no further than the link's bound
        assert plan.bound["planned_bytes"] <= min(link.write_Bps * t_fwd, link.read_Bps * t_bwd) + 1


def _memory_profiles(rng: random.Random, n: int) -> list[LayerProfile]:
    """Layers whose forward peak and backward workspace differ from what they save: the plan with the least
    summed footprint over a budget is not always the one with the lowest peak."""
    mib64 = 64 << 20
    out = []
    for i in range(n):
        s = rng.randint(1, 16) * mib64
        out.append(LayerProfile(i, f"L{i}", s, rng.uniform(0.005, 0.02), rng.uniform(0.01, 0.04),
                                fwd_peak_bytes=s + rng.randint(0, 24) * mib64,
                                bwd_workspace_bytes=rng.randint(0, 24) * mib64,
                                gap_background_bytes=rng.randint(0, 16) * mib64,
                                bwd_background_bytes=rng.randint(0, 16) * mib64,
                                input_bytes=rng.randint(1, 4) * (16 << 20)))  # fmt: skip
    return out


def _lowest_peak(prof: list[LayerProfile], bws: list[TierBandwidth]) -> int:
    """Brute force at depth 1: the lowest peak of any assignment of keep, recompute (host, recompute+host)."""
    bw = _bw(bws, budget=True)
    acts = [Action.KEEP, Action.RECOMPUTE] + ([Action.HOST, Action.RECOMPUTE_HOST] if bw else [])
    return min(simulate(prof, list(c), bw, 1)[2] for c in itertools.product(acts, repeat=len(prof)))


@pytest.mark.parametrize("with_tier", [False, True])
def test_best_effort_installs_the_lowest_peak(with_tier: bool) -> None:
    for seed in range(8):
        rng = random.Random(seed)
        prof = _memory_profiles(rng, 4)
        bws = [TierBandwidth("host", rng.uniform(2e9, 20e9), rng.uniform(2e9, 20e9))] if with_tier else []
        cfg = ActivationOffloadConfig(
            tiers=["host"], host_pool_gb=64, memory_budget_gb=1e-3, prefetch_depth=1
        )
        plan = make_plan(prof, bws, cfg, best_effort=True)  # exhaustive: every plan considered
        assert plan.over_budget and "OVER BUDGET" in plan.describe()
        assert plan.peak_bytes == _lowest_peak(prof, bws), seed
        # the local search: no higher than any plan it starts from (every uniform plan)
        local = make_plan(prof, bws, cfg, best_effort=True, exhaustive_limit=0)
        bw = _bw(bws, budget=True)
        uniform = [Action.KEEP, Action.RECOMPUTE] + ([Action.HOST, Action.RECOMPUTE_HOST] if bws else [])
        assert local.peak_bytes <= min(simulate(prof, [a] * 4, bw, 1)[2] for a in uniform)


def test_floor_is_the_lowest_peak_the_planner_reaches() -> None:
    from dsx.offload.plan import floor_bytes

    for seed in range(8):
        rng = random.Random(100 + seed)
        prof = _memory_profiles(rng, 4)
        bws = [TierBandwidth("host", rng.uniform(2e9, 20e9), rng.uniform(2e9, 20e9))] if seed % 2 else []
        cfg = ActivationOffloadConfig(tiers=["host"], host_pool_gb=64, memory_budget_gb=1.0, prefetch_depth=1)
        floor = floor_bytes(prof, bws, cfg)
        assert floor == _lowest_peak(prof, bws), seed  # exhaustive: no plan peaks lower
        # a budget at the floor has a plan; one just under it gets the error, which names the floor
        at = make_plan(prof, bws, cfg.model_copy(update={"memory_budget_gb": floor / GiB}))
        assert at.peak_bytes <= floor and not at.over_budget
        with pytest.raises(PlanError) as err:
            make_plan(prof, bws, cfg.model_copy(update={"memory_budget_gb": (floor - (1 << 20)) / GiB}))
        assert f"keeps {floor / GiB:.2f} GiB" in str(err.value)


def test_plans_fit_the_real_pool_with_small_storages() -> None:
    """The pool and the SSD file allocate each storage at its 4 KiB-aligned size: with storages of a few KiB
    (min_tensor_bytes 0) that is up to twice their bytes, past tier_capacity's 1/128 reserve."""
    from dsx.offload.align import align_up
    from dsx.offload.store import HostPool

    bws = [TierBandwidth("host", 20e9, 20e9)]
    for seed in range(6):
        rng = random.Random(seed)
        prof = []
        for i in range(6):
            sizes = [rng.randint(1500, 9000) for _ in range(rng.randint(150, 400))]
            fwd, bwd = rng.uniform(0.005, 0.02), rng.uniform(0.01, 0.04)
            prof.append(LayerProfile(i, f"L{i}", sum(sizes), fwd, bwd, saved_sizes=sizes))
        keep = sum(p.saved_bytes for p in prof)
        for budget in (keep * 0.5 / GiB, None):
            cfg = ActivationOffloadConfig(tiers=["host"], host_pool_gb=rng.uniform(3, 6) / 1024,
                                          memory_budget_gb=budget, min_tensor_bytes=0)  # fmt: skip
            try:
                plan = make_plan(prof, bws, cfg)
            except PlanError:
                continue
            pool = HostPool(int(cfg.host_pool_gb * GiB), pin=False)
            aligned = 0
            for i, (p, a) in enumerate(zip(prof, plan.actions)):
                if not a.moved:
                    continue
                cap, done = plan.move_caps.get(i, p.saved_bytes), 0
                for n in p.saved_sizes:  # the runtime's rule (LayerHooks._pack)
                    if done + n <= cap:
                        done += n
                        aligned += align_up(n)
                        assert pool.alloc(n) is not None, (seed, budget, plan.actions)
            held = tier_usage(prof, plan.actions, {"host": bws[0]}, plan.move_caps)["host"]
            assert held == aligned <= tier_capacity(cfg)["host"]
    # a partial move counts the storages it takes, each aligned
    p = LayerProfile(0, "a", 0, 0.01, 0.02, saved_sizes=[5000, 3000, 9000, 100, 4096])
    p.saved_bytes = sum(p.saved_sizes)
    usage = tier_usage([p], [Action.HOST], {"host": bws[0]}, {0: 12100})
    assert usage["host"] == align_up(5000) + align_up(3000) + align_up(100)


@pytest.mark.parametrize("policy", ["none", "recompute_all", "offload_all", "auto"])
def test_over_budget_is_set_for_every_policy(policy: str) -> None:
    rng = random.Random(23)
    # 4 layers: policy auto searches all 6^n plans of its six actions at each prefetch depth, and a fifth
    # layer would only multiply that by 6 for the same check
    prof = _profiles(rng, 4)
    for p in prof:
        p.input_bytes = p.saved_bytes // 8
    bw = _bw(BW, budget=True)
    keep_peak = simulate(prof, [Action.KEEP] * 4, bw, 1)[2]
    for budget, over in ((keep_peak * 4 / GiB, False), (1e-3, True)):
        plan = make_plan(prof, BW, _cfg(policy=policy, memory_budget_gb=budget), best_effort=True)
        assert plan.over_budget is over and plan.over_budget == (plan.peak_bytes > budget * GiB)
        assert ("OVER BUDGET" in plan.describe()) is over
    assert not make_plan(prof, BW, _cfg(policy=policy)).over_budget  # no budget, nothing to be over


def test_the_peak_after_the_layers_backward_is_carried_into_the_prediction() -> None:
    """The step's peak after the layers' backward (gradients' reduction, optimizer) is the same for every plan:
    make_plan plans the layers against the budget it is given, and the predicted step peak is the larger of the
    two; the printed plan gives the tail."""
    rng = random.Random(29)
    prof = _profiles(rng, 5)
    keep = sum(p.saved_bytes for p in prof)
    cfg = _cfg(memory_budget_gb=keep * 0.6 / GiB)
    without = make_plan(prof, BW, cfg)
    low, high = without.peak_bytes // 2, int(keep * 0.6) + (1 << 30)
    for tail in (low, high):
        plan = make_plan(prof, BW, cfg, outside_peak_bytes=tail)
        assert plan.actions == without.actions and plan.peak_bytes == without.peak_bytes
        assert plan.outside_peak_bytes == tail
        assert plan.predicted_step_peak_bytes == max(without.peak_bytes, tail)
        text = plan.describe()
        assert f"after the layers' backward the step peaks at {tail / GiB:.2f} GiB" in text
    assert "after the layers' backward" not in without.describe()


@pytest.mark.parametrize(
    ("field", "value"),
    [("fwd_s", float("nan")), ("bwd_s", -0.01), ("saved_bytes", -1), ("sel_saved_bytes", float("nan")),
     ("sel_recompute_s", float("inf")), ("bwd_workspace_bytes", -(1 << 20)), ("input_bytes", float("nan")),
     ("fwd_peak_bytes", -5), ("gap_background_bytes", float("nan")), ("saved_sizes", [1 << 20, -4])],
)  # fmt: skip
def test_bad_profiles_are_a_clear_error(field: str, value) -> None:
    prof = _profiles(random.Random(29), 4)
    setattr(prof[2], field, value)
    name = field if field != "saved_sizes" else "saved_sizes[1]"
    for policy, budget in (("auto", None), ("auto", 2.0), ("recompute_all", None)):
        with pytest.raises(ValueError, match=rf"layer 2 \('L2'\): {re.escape(name)} is"):
            make_plan(prof, BW, _cfg(policy=policy, memory_budget_gb=budget))
    # the background fields are differences of measured levels: negative is allowed
    ok = _profiles(random.Random(29), 4)
    ok[1].fwd_background_bytes = -(1 << 20)
    make_plan(ok, BW, _cfg())


def _tensors(plan) -> int:
    """How many storages the runtime's rule (``LayerHooks._pack``) moves a step under ``plan``."""
    count = 0
    for i, (p, a) in enumerate(zip(plan.profiles, plan.actions)):
        if a.moved:
            cap = plan.move_caps.get(i)
            floor = getattr(cap, "floor", 0)
            done = 0
            for n in p.saved_sizes:
                if cap is None or (n >= floor and done + n <= cap):
                    done, count = done + n, count + 1
    return count


def test_the_host_time_of_each_moved_tensor_makes_the_plan_move_fewer_larger_ones() -> None:
    # layers of sixteen 64 MiB storages and one of 1 GiB, 12 ms forward and 20 ms backward at 55 GB/s: what
    # hides behind compute moves as a few large tensors once each costs the host 200 us (2 % of a layer's
    # forward in 64 MiB pieces), and still lowers the peak
    mib = 1 << 20
    sizes = [64 * mib] * 8 + [1024 * mib] + [64 * mib] * 8
    prof = [LayerProfile(i, f"L{i}", sum(sizes), 0.012, 0.020, saved_sizes=list(sizes)) for i in range(6)]
    bws = [TierBandwidth("host", 55e9, 55e9)]
    free = make_plan(prof, bws, ActivationOffloadConfig(tiers=["host"], moved_tensor_host_us=0))
    costly = make_plan(prof, bws, ActivationOffloadConfig(tiers=["host"], moved_tensor_host_us=200))
    assert costly.peak_bytes < costly.bound["keep_all_bytes"]
    assert 0 < _tensors(costly) < _tensors(free) / 4
    assert any(getattr(c, "floor", 0) == 1024 * mib for c in costly.move_caps.values())
    # the plan's step counts each moved tensor's host time, and stays within the hide-only limit
    assert costly.predicted_step_s >= costly.bound["baseline_step_s"] + _tensors(costly) * 200e-6 - 1e-12
    assert costly.predicted_step_s <= costly.bound["baseline_step_s"] * 1.005 + 1e-12
    assert "tensors >= 1024Mi" in costly.describe()


def _tie_case(seed: int) -> tuple[list[LayerProfile], list[TierBandwidth], int]:
    rng = random.Random(seed)
    n = 4 if seed % 2 else 10
    prof = _profiles(rng, n)
    for p in prof:
        p.input_bytes = p.saved_bytes // rng.choice([4, 8, 16])
    bws = [
        TierBandwidth("host", 50e9, 50e9),
        TierBandwidth("ssd", rng.choice([1e9, 3e9]), rng.choice([1e9, 3e9])),
    ]
    return prof, bws, sum(p.saved_bytes for p in prof)


def test_a_tie_with_the_ssd_goes_to_the_host() -> None:
    """A best-effort plan (seed 2's layers under a budget nothing meets) where a host layer's SSD twin ties with
    it in peak and step time: the plan moves layers, none to the SSD."""
    prof, bws, _ = _tie_case(2)
    bw = _bw(bws, budget=True)
    cfg = _cfg(policy="auto", memory_budget_gb=0.01, host_pool_gb=4, ssd_capacity_gb=4, ssd_path="/tmp")
    plan = make_plan(prof, bws, cfg, best_effort=True)
    assert plan.over_budget and not any(a.tier is Action.SSD for a in plan.actions)
    _, _, peak = simulate(prof, plan.actions, bw, plan.prefetch_depth)
    t = simulate(prof, plan.actions, bw, plan.prefetch_depth)[0]
    twins = [
        [*plan.actions[:i], Action(a.value.replace("host", "ssd")), *plan.actions[i + 1 :]]
        for i, a in enumerate(plan.actions)
        if a.tier is Action.HOST
    ]
    tied = [tw for tw in twins if simulate(prof, tw, bw, plan.prefetch_depth)[::2] == (t, peak)]
    assert tied, [a.value for a in plan.actions]


@pytest.mark.parametrize("seed", range(16))
def test_ties_go_to_the_host(seed: int) -> None:
    """Where the link hides both tiers' transfers, a layer sent to the SSD often ties with it sent to the host;
    the planner then picks the host (no drive wear, no risk from a drive slower than measured). No SSD layer of
    a plan, best effort (a budget nothing meets) or within its budget, exhaustive or local search, moves to the
    host at the same or a better rank: peak then step time, or step time then peak, and the host within its
    capacity."""
    prof, bws, keep = _tie_case(seed)
    bw = _bw(bws, budget=True)
    for budget_gb in (0.01, keep * random.Random(seed).uniform(0.2, 0.5) / GiB):
        cfg = _cfg(
            policy="auto",
            memory_budget_gb=budget_gb,
            host_pool_gb=4,
            ssd_capacity_gb=4,
            ssd_path="/tmp",
        )
        plan = make_plan(prof, bws, cfg, best_effort=True)
        t, _, peak = simulate(prof, plan.actions, bw, plan.prefetch_depth)
        for i, a in enumerate(plan.actions):
            if a.tier is not Action.SSD:
                continue
            near = [*plan.actions[:i], Action(a.value.replace("ssd", "host")), *plan.actions[i + 1 :]]
            if tier_usage(prof, near, bw)["host"] > tier_capacity(cfg)["host"]:
                continue
            t2, _, peak2 = simulate(prof, near, bw, plan.prefetch_depth)
            rank, rank2 = ((peak, t), (peak2, t2)) if plan.over_budget else ((t, peak), (t2, peak2))
            assert rank2 > rank, (budget_gb, i, [x.value for x in plan.actions], rank, rank2)
