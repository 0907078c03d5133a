"""The planner: exact on small models, close to exact when greedy, budgets kept or refused clearly."""

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
    PlanError,
    TierBandwidth,
    make_plan,
    movable,
    simulate,
    tier_capacity,
    tier_usage,
    write_barrier,
    write_barrier_fixed,
)
from dsx.runtime.bandwidth import measure_file_bandwidth, measure_host_bandwidth, measure_tier_bandwidth

GiB = 1 << 30
BW = [TierBandwidth("host", 20e9, 20e9), TierBandwidth("ssd", 2e9, 1.5e9)]


def _profiles(rng: random.Random, n: int) -> list[LayerProfile]:
    return [
        LayerProfile(i, f"L{i}", rng.randint(1, 16) << 26, rng.uniform(0.004, 0.02), rng.uniform(0.008, 0.04))
        for i in range(n)
    ]


def _cfg(**kw) -> ActivationOffloadConfig:
    return ActivationOffloadConfig(tiers=["host", "ssd"], **kw)


def test_simulate_hand_case() -> None:
    # Two layers, 1 GiB each, host 1 GiB/s: layer 0's write (1 s) hides behind layer 1's forward (2 s); its
    # read, issued when layer 1's backward starts (depth 1), hides behind that backward (3 s).
    p = [LayerProfile(0, "a", GiB, 1.0, 3.0), LayerProfile(1, "b", GiB, 2.0, 3.0)]
    bw = {"host": TierBandwidth("host", GiB, GiB)}
    t, stall, peak = simulate(p, [Action.HOST, Action.KEEP], bw, 1)
    assert t == pytest.approx(9.0) and stall == 0.0 and peak == 2 * GiB  # both resident at backward start
    # The last layer's write starts when forward ends (t=3, done at 4) and its read only after that (done at
    # 5): nothing hides it, 2 s exposed.
    t, stall, _ = simulate(p, [Action.KEEP, Action.HOST], bw, 1)
    assert stall == pytest.approx(2.0) and t == pytest.approx(11.0)
    t, _, peak = simulate(p, [Action.RECOMPUTE, Action.KEEP], bw, 1)
    assert t == pytest.approx(10.0) and peak == GiB  # layer 0 rematerialises only after layer 1's backward


@pytest.mark.parametrize("seed", range(8))
def test_exhaustive_is_optimal_and_greedy_is_close(seed: int) -> None:
    rng = random.Random(seed)
    prof = _profiles(rng, 5)
    keep = sum(p.saved_bytes for p in prof)
    cfg = _cfg(memory_budget_gb=keep * rng.uniform(0.3, 0.8) / GiB, prefetch_depth=2)
    bw = {b.tier: b for b in BW}
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


def test_no_budget_hides_only() -> None:
    rng = random.Random(7)
    prof = _profiles(rng, 12)
    plan = make_plan(prof, BW, _cfg())
    assert plan.predicted_step_s <= plan.bound["baseline_step_s"] * 1.005 + 1e-12
    assert plan.peak_bytes < plan.bound["keep_all_bytes"]
    assert any(a in (Action.HOST, Action.SSD) for a in plan.actions)
    assert "hideable writes" in plan.describe() and "fraction" not in plan.describe()


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


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 9), seed=st.integers(0, 10**6), frac=st.floats(0.2, 1.0))
def test_budget_always_respected(n: int, seed: int, frac: float) -> None:
    prof = _profiles(random.Random(seed), n)
    budget = sum(p.saved_bytes for p in prof) * frac / GiB
    try:
        plan = make_plan(prof, BW, _cfg(memory_budget_gb=budget))
    except PlanError:
        return
    assert plan.peak_bytes <= budget * GiB + 1
    assert plan.predicted_step_s >= sum(p.fwd_s + p.bwd_s for p in prof) - 1e-9


def test_bandwidth_probes_measure_real_transfers(tmp_path) -> None:
    res = measure_file_bandwidth(tmp_path, mb=8)
    assert res["write_GBps"] > 0 and res["read_GBps"] > 0 and res["bytes"] == 8 << 20
    assert not list(tmp_path.iterdir())
    w, r = measure_host_bandwidth(16)
    assert w > 0 and r > 0
    tiers = measure_tier_bandwidth(["host", "ssd"], tmp_path, mb=8)
    assert [t.tier for t in tiers] == ["host", "ssd"] and all(t.write_Bps > 0 for t in tiers)
    with pytest.raises(OSError, match="not a writable directory"):
        measure_file_bandwidth(tmp_path / "missing")


# ------------------------------------------------------------------- selective recompute (recompute_modules)
def _sel_profiles(rng: random.Random, n: int) -> list[LayerProfile]:
    """Layers whose attention holds most of the saved bytes and is cheap to recompute (long sequences)."""
    out = []
    for p in _profiles(rng, n):
        p.sel_saved_bytes = int(p.saved_bytes * rng.uniform(0.2, 0.4))
        p.sel_recompute_s = p.fwd_s * rng.uniform(0.1, 0.2)
        out.append(p)
    return out


def test_selective_actions_account_bytes_and_time() -> None:
    p = LayerProfile(0, "a", 10 * GiB, 1.0, 2.0, sel_saved_bytes=3 * GiB, sel_recompute_s=0.25)
    assert (p.stored(Action.HOST_SEL), p.transient(Action.HOST_SEL), p.extra_bwd_s(Action.HOST_SEL)) == (
        3 * GiB, 7 * GiB, 0.25,
    )  # fmt: skip
    assert (p.stored(Action.HOST), p.transient(Action.RECOMPUTE), p.extra_bwd_s(Action.RECOMPUTE)) == (
        10 * GiB, 10 * GiB, 1.0,
    )  # fmt: skip
    bw = {"host": TierBandwidth("host", GiB, GiB)}
    t_keep, _, peak_keep = simulate([p], [Action.KEEP], bw, 1)
    t_sel, _, peak_sel = simulate([p], [Action.KEEP_SEL], bw, 1)
    assert t_sel == pytest.approx(t_keep + 0.25) and peak_sel == peak_keep  # re-created in its own backward
    p.bwd_workspace_bytes = 2 * GiB  # the backward's own temporaries come on top, whatever the action
    assert simulate([p], [Action.KEEP], bw, 1)[2] == peak_keep + 2 * GiB
    assert simulate([p], [Action.RECOMPUTE], bw, 1)[2] == 12 * GiB


@pytest.mark.parametrize("seed", range(4))
def test_selective_beats_full_recompute_under_a_tight_budget(seed: int) -> None:
    rng = random.Random(seed)
    prof = _sel_profiles(rng, 6)
    slow = [TierBandwidth("host", 2e8, 2e8)]  # too slow to hide much: offload alone cannot meet the budget
    bw = {b.tier: b for b in slow}
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
    bw = {b.tier: b for b in BW}
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


# ------------------------------------------------------------- memory beyond the saved bytes (CUDA profiles)
def _with_background(rng: random.Random, n: int) -> list[LayerProfile]:
    out = []
    for p in _profiles(rng, n):
        p.fwd_peak_bytes = p.saved_bytes + (rng.randint(0, 8) << 24)
        p.bwd_workspace_bytes = rng.randint(0, 16) << 24
        p.fwd_background_bytes = rng.randint(0, 4) << 24
        p.gap_background_bytes = rng.randint(0, 32) << 24
        p.bwd_background_bytes = rng.randint(0, 32) << 24
        out.append(p)
    return out


def test_keep_all_peak_reproduces_the_measured_points() -> None:
    # with everything kept the model must give back the largest point the profiling step measured
    prof = _with_background(random.Random(3), 6)
    saved = [p.saved_bytes for p in prof]
    points = []
    for i, p in enumerate(prof):
        points.append(p.fwd_background_bytes + sum(saved[:i]) + p.fwd_peak_bytes)
        points.append(p.gap_background_bytes + sum(saved[: i + 1]))
        points.append(p.bwd_background_bytes + sum(saved[: i + 1]) + p.bwd_workspace_bytes)
    _, _, peak = simulate(prof, [Action.KEEP] * 6, {b.tier: b for b in BW}, 2)
    assert peak == max(points)


def test_recomputed_layer_peaks_at_its_rerun_forward_or_its_backward() -> None:
    p = LayerProfile(0, "a", GiB, 0.01, 0.02, fwd_peak_bytes=3 * GiB, bwd_workspace_bytes=GiB // 2,
                     bwd_background_bytes=GiB // 4)  # fmt: skip
    _, _, peak = simulate([p], [Action.RECOMPUTE], {}, 1)
    # backward: background + max(re-run forward peak 3 GiB, saved 1 GiB + workspace 0.5 GiB)
    assert peak == GiB // 4 + 3 * GiB
    p.fwd_peak_bytes = GiB
    _, _, peak = simulate([p], [Action.RECOMPUTE], {}, 1)
    assert peak == GiB // 4 + GiB + GiB // 2


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 8), seed=st.integers(0, 10**6), frac=st.floats(0.2, 1.0))
def test_budget_respected_with_background(n: int, seed: int, frac: float) -> None:
    prof = _with_background(random.Random(seed), n)
    bw = {b.tier: b for b in BW}
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


def _agree_worker(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from dsx.runtime import bandwidth

        # each rank "measures" a different share; the agreed one is the smallest, the same on both ranks
        own = [TierBandwidth("host", 10e9 * (rank + 1), 20e9 / (rank + 1))]
        q.put((rank, [(b.tier, b.write_Bps, b.read_Bps) for b in bandwidth._agree(own, [0, 1])]))
    finally:
        dist.destroy_process_group()


def test_ranks_of_a_node_agree_on_the_smallest_share(caplog) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_agree_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert got[0] == got[1] == [("host", 10e9, 10e9)]


def test_hide_only_fills_the_bound_with_partial_layers() -> None:
    # 4 layers of 4 GiB, 12 ms forward, 20 ms backward, 55 GB/s: the bound (~2.5 GiB of writes) is less
    # than one layer, so whole layers move nothing; parts of layers fill the bound without slowing
    prof = [LayerProfile(i, f"L{i}", 4 * GiB, 0.012, 0.020) for i in range(4)]
    bw = [TierBandwidth("host", 55e9, 55e9)]
    plan = make_plan(prof, bw, ActivationOffloadConfig(tiers=["host"]))
    assert plan.move_caps and all(plan.actions[i] == Action.HOST for i in plan.move_caps)
    assert all(0 < c < 4 * GiB and c % (1 << 20) == 0 for c in plan.move_caps.values())
    assert 0.9 <= plan.bound["fraction_of_bound"] <= 1.0 + 1e-9
    assert plan.bound["planned_bytes"] == sum(plan.move_caps.values())
    assert plan.predicted_step_s <= plan.bound["baseline_step_s"] * 1.005 + 1e-12
    cap = next(iter(plan.move_caps.values()))
    assert f"({cap >> 20}Mi of 4096Mi)" in plan.describe()
    # with a budget no partial layer is made: the search itself moves and recomputes whole layers
    budgeted = make_plan(prof, bw, ActivationOffloadConfig(tiers=["host"], memory_budget_gb=20))
    assert not budgeted.move_caps


@pytest.mark.parametrize("seed", range(4))
def test_partial_layers_are_planned_at_what_their_storages_move(seed: int) -> None:
    # megatron-core-like layers (hidden 2048, micro-batch 8): 64-192 MiB storages around a 2 GiB softmax block
    # and a 1 GiB one, in shuffled order. A storage is not split, so a cap moves the storages that fit in save
    # order; the plan's caps must be exactly that (the runtime then moves what was planned) and the filled
    # plan still reaches the bound, with more layers where each moves less
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
            if done + n <= cap:
                done += n
        assert done == cap
    whole = sum(
        p.saved_bytes for i, p in enumerate(prof) if plan.actions[i].moved and i not in plan.move_caps
    )
    assert plan.bound["planned_bytes"] == whole + sum(plan.move_caps.values())
    assert 0.9 <= plan.bound["fraction_of_bound"] <= 1.0 + 1e-9
    assert plan.predicted_step_s <= plan.bound["baseline_step_s"] * 1.005 + 1e-12


def test_movable_follows_the_runtime_rule() -> None:
    p = LayerProfile(0, "a", 10, 0.01, 0.01, saved_sizes=[3, 5, 1, 1])
    assert [movable(p, Action.HOST, c) for c in range(12)] == [0, 1, 2, 3, 4, 5, 5, 5, 8, 9, 10, 10]
    assert movable(p, Action.HOST_SEL, 4) == 4  # +sel: what it saves differs, so the cap itself
    assert movable(LayerProfile(0, "b", 10, 0.01, 0.01), Action.HOST, 4) == 4  # order unknown


def test_tier_usage_counts_host_bytes_and_the_ssd_backlog_staged_in_the_pool() -> None:
    # two layers of 1 GiB, 1 s forward each, copied to the pool at 8 GiB/s. SSD at 0.5 GiB/s: layer 0's file
    # write runs 1.125-3.125 s, layer 1's 3.125-5.125 s, so after layer 1's forward (2 s) both sit in the pool
    # as staging; at 10 GiB/s only layer 1 does
    p = [LayerProfile(0, "a", GiB, 1.0, 1.0), LayerProfile(1, "b", GiB, 1.0, 1.0)]
    slow = {"ssd": TierBandwidth("ssd", GiB / 2, GiB / 2), "host": TierBandwidth("host", 8 * GiB, 8 * GiB)}
    assert tier_usage(p, [Action.SSD, Action.SSD], slow) == {"host": 2 * GiB, "ssd": 2 * GiB}
    fast = {**slow, "ssd": TierBandwidth("ssd", 10 * GiB, 10 * GiB)}
    assert tier_usage(p, [Action.SSD, Action.SSD], fast) == {"host": GiB, "ssd": 2 * GiB}
    assert tier_usage(p, [Action.HOST, Action.SSD], slow) == {"host": 2 * GiB, "ssd": GiB}
    assert tier_usage(p, [Action.HOST, Action.RECOMPUTE], slow) == {"host": GiB, "ssd": 0}
    assert tier_usage(p, [Action.HOST, Action.HOST], slow, {1: GiB // 4}) == {
        "host": GiB + GiB // 4,
        "ssd": 0,
    }


def test_an_ssd_layer_leaves_the_device_when_its_copy_to_the_pool_ends() -> None:
    """The mover releases an SSD layer's device bytes once they are in the pool, before the file write. Three
    layers of 1 GiB, 1 s forward each, layer 0 to SSD: its copy (8 GiB/s) ends at 1.125 s, the drive (0.5
    GiB/s) writes it 1.125-3.125 s. Without a host tier the link's rate is unmeasured: the model holds the
    layer on the device until the file write ends (1 + 2 s), as before."""
    from dsx.offload.plan import _forward, _timeline

    p = [LayerProfile(i, f"L{i}", GiB, 1.0, 1.0) for i in range(3)]
    acts = [Action.SSD, Action.KEEP, Action.KEEP]
    both = {"host": TierBandwidth("host", 8 * GiB, 8 * GiB), "ssd": TierBandwidth("ssd", GiB / 2, GiB / 2)}
    ssd_only = {"ssd": both["ssd"]}
    _, _, write_done, off_device = _forward(p, acts, both)
    assert off_device[0] == pytest.approx(1.125) and write_done[0] == pytest.approx(3.125)
    _, _, write_done, off_device = _forward(p, acts, ssd_only)
    assert off_device[0] == write_done[0] == pytest.approx(3.0)
    # layer 2's forward starts at 2 s: with the link modelled, layer 0 is off the device by then
    assert write_barrier(p, acts, both)[0] == [-1, -1, 1, 2]
    assert write_barrier(p, acts, ssd_only)[0] == [-1, -1, -1, 2]
    # ... and the footprint after layer 1's forward no longer holds it; the pool stages it until 3.125 s
    feet_both, feet_ssd = _timeline(p, acts, both, 1)[2], _timeline(p, acts, ssd_only, 1)[2]
    assert feet_ssd[3] - feet_both[3] == GiB and feet_ssd[2] == feet_both[2]
    assert tier_usage(p, acts, both) == {"host": GiB, "ssd": GiB}
    # SSD and host layers share the link: layer 1's host copy waits for layer 0's SSD copy
    _, _, _, off_device = _forward(
        p, [Action.SSD, Action.HOST, Action.KEEP], {**both, "host": TierBandwidth("host", GiB / 2, GiB / 2)}
    )
    assert off_device[:2] == pytest.approx([3.0, 5.0])


def test_write_barrier_waits_where_the_model_has_the_writes_done() -> None:
    # three layers of 1 s forward and 1 s backward; layer 0 moves 1 GiB. At 0.5 GiB/s its write runs 1-3 s:
    # no forward starts after it, backward (at 3 s) does. At 4 GiB/s it is done at 1.25 s: layer 2's forward
    # (2 s) waits for it. At 0.25 GiB/s it ends at 5 s: only layer 0's backward start (3 + 1 + 1 s) waits for it
    p = [LayerProfile(i, f"L{i}", GiB, 1.0, 1.0) for i in range(3)]
    acts = [Action.HOST, Action.KEEP, Action.KEEP]

    def host(bps: float) -> dict[str, TierBandwidth]:
        return {"host": TierBandwidth("host", bps, bps)}

    assert write_barrier(p, acts, host(GiB / 2)) == ([-1, -1, -1, 2], [2, 2, 2])
    assert write_barrier(p, acts, host(4 * GiB)) == ([-1, -1, 1, 2], [2, 2, 2])
    assert write_barrier(p, acts, host(GiB / 4)) == ([-1, -1, -1, -1], [2, -1, -1])
    # a later moved layer whose write is not done holds the barrier at the layer before it
    acts = [Action.HOST, Action.HOST, Action.KEEP]
    assert write_barrier(p, acts, host(4 * GiB))[0] == [-1, -1, 0, 2]
    assert write_barrier(p, [Action.KEEP] * 3, {}) == ([-1, 0, 1, 2], [2, 2, 2])
    # make_plan hands them over, monotone in time, one per layer and one for the start of backward
    prof = _profiles(random.Random(3), 7)
    plan = make_plan(prof, BW, _cfg(write_barrier="on"))
    fwd, bwd = plan.write_barrier, plan.write_barrier_bwd
    assert len(fwd) == 8 and fwd == sorted(fwd) and all(k < j for j, k in enumerate(fwd))
    assert len(bwd) == 7 and bwd[::-1] == sorted(bwd) and bwd[-1] >= fwd[-1]
    assert (fwd, bwd) == write_barrier(prof, plan.actions, {t.tier: t for t in BW}, plan.move_caps)
    assert "write barrier on" in plan.describe()


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
    cost up to 9% of the step rate on the H100 (hidden 4096: 0.912x no offload) for memory nobody asked for."""
    prof = _profiles(random.Random(4), 5)
    plan = make_plan(prof, BW, _cfg(write_barrier=setting, memory_budget_gb=budget_gb))
    assert (len(plan.write_barrier), len(plan.write_barrier_bwd)) == ((6, 5) if on else (0, 0))
    assert f"write barrier {'on' if on else 'off'}" in plan.describe()


@pytest.mark.parametrize("n", [1, 2, 5])
def test_fixed_write_barrier_waits_two_layers_back_and_for_all_before_backward(n: int) -> None:
    fwd, bwd = write_barrier_fixed(n)
    assert len(fwd) == n + 1 and bwd == []
    assert fwd[:n] == [j - 2 if j >= 2 else -1 for j in range(n)] and fwd[n] == n - 1
    assert write_barrier_fixed(n, lag=1)[0][:n] == list(range(-1, n - 1))
    with pytest.raises(ValueError, match="lag"):
        write_barrier_fixed(n, lag=0)


def test_write_barrier_setting_rejects_unknown_values() -> None:
    with pytest.raises(ValueError, match="write_barrier"):
        _cfg(write_barrier="sometimes")


@pytest.mark.parametrize("budget_gb", [None, 8.0])
def test_plans_fit_the_tiers_capacity(budget_gb: float | None) -> None:
    """A plan never moves more than ``host_pool_gb`` holds: the mover would leave the rest on the device,
    over the plan's peak (a hidden-4096 run ran out of memory so). The pool binds: a larger one moves more."""
    # 8 layers of 2 GiB, slow enough that most of them hide behind compute at 55 GB/s
    prof = [LayerProfile(i, f"L{i}", 2 * GiB, 0.08, 0.16) for i in range(8)]
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
        usage = tier_usage(prof, plan.actions, {b.tier: b for b in BW}, plan.move_caps)
        assert usage["host"] <= cap["host"] and usage["ssd"] <= cap["ssd"], (plan.actions, usage, cap)


def test_recompute_moving_its_inputs_lowers_the_floor() -> None:
    """A recomputed layer keeps its inputs (what its checkpoint starts from); ``recompute+<tier>`` moves them,
    so a budget under full recompute's peak has a plan, and the moved inputs are all the plan writes."""
    rng = random.Random(11)
    n = 6
    prof = _with_background(rng, n)
    for p in prof:
        p.input_bytes = p.saved_bytes // 8
    bw = {b.tier: b for b in BW}
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


def _timeline_reference(profiles, actions, bw, depth, caps=None):
    """The cost model's footprints written the plain way, O(layers) per point: the reference for the
    planner's prefix-sum version."""
    from dsx.offload.plan import _forward, _split

    n = len(profiles)
    t, free, write_done, off_device = _forward(profiles, actions, bw, caps)
    moved, kept = _split(profiles, actions, caps)

    def held(j, at, window):
        return kept[j] + (moved[j] if moved[j] and (window or off_device[j] > at) else 0)

    feet, clock = [], 0.0
    for i, p in enumerate(profiles):
        feet.append(
            p.fwd_background_bytes + sum(held(j, clock, False) for j in range(i)) + p.fwd_own(actions[i])
        )
        clock += p.fwd_s
        feet.append(
            p.gap_background_bytes + sum(held(j, clock, i == n - 1 and j >= i - depth) for j in range(i + 1))
        )
    for k in free:
        free[k] = max(free[k], t)
    read_done, nxt = {}, n - 1
    for i in range(n - 1, -1, -1):
        while nxt >= max(0, i - depth):
            a = actions[nxt]
            if a.moved:
                tier = a.tier.value
                start = max(t, free[tier], write_done[nxt])
                free[tier] = read_done[nxt] = start + moved[nxt] / bw[tier].read_Bps
            nxt -= 1
        if i in read_done and read_done[i] > t:
            t = read_done[i]
        p = profiles[i]
        feet.append(
            p.bwd_background_bytes
            + sum(held(j, t, j >= i - depth) for j in range(i + 1))
            + p.bwd_own(actions[i])
        )
        t += p.bwd_s + p.extra_bwd_s(actions[i])
    return t, feet


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 10), seed=st.integers(0, 10**6), depth=st.integers(1, 8))
def test_timeline_matches_the_plain_reference(n: int, seed: int, depth: int) -> None:
    from dsx.offload.plan import _timeline

    rng = random.Random(seed)
    prof = _with_background(rng, n)
    for p in prof:
        p.sel_saved_bytes, p.sel_recompute_s = p.saved_bytes // 4, 0.003
        p.input_bytes = p.saved_bytes // 16
    bw = {b.tier: b for b in BW}
    actions = [rng.choice(list(Action)) for _ in range(n)]
    caps = {i: rng.randint(1, 1 << 28) for i in range(n) if actions[i].moved and rng.random() < 0.3}
    t, _, feet = _timeline(prof, actions, bw, depth, caps)
    t_ref, feet_ref = _timeline_reference(prof, actions, bw, depth, caps)
    assert feet == feet_ref and t == pytest.approx(t_ref, rel=1e-12)


# ------------------------------------------------------------------------------- regressions (review fixes)
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
    import dsx.offload.plan as plan_mod

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
        bw = {b.tier: b for b in bws}
        for d in (1, 2, 3):
            acts, caps = fill(prof, whole.actions, bw, d, whole.bound["baseline_step_s"] * 1.005, 1 << 40,
                              tier_capacity(cfg))  # fmt: skip
            assert simulate(prof, acts, bw, d, caps)[2] <= simulate(prof, whole.actions, bw, d)[2]
    assert filled >= 12  # the fills still happen


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
    bw = {b.tier: b for b in bws}
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
        bw = {b.tier: b for b in bws}
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


def test_partial_sel_moves_follow_the_sel_storages() -> None:
    # +sel: the runtime moves, in save order, each storage of what the layer saves with its recompute modules
    # recomputed that still fits under the cap; the planner counts exactly that
    from dsx.offload.plan import _split

    rng = random.Random(17)
    mib = 1 << 20
    prof = []
    for i in range(4):
        sizes = [rng.randint(1, 64) * mib for _ in range(rng.randint(3, 9))]
        sel = [rng.randint(1, 48) * mib for _ in range(rng.randint(3, 7))]
        prof.append(LayerProfile(i, f"L{i}", sum(sizes), 0.01, 0.02, saved_sizes=sizes,
                                 sel_saved_bytes=sum(sel), sel_saved_sizes=sel))  # fmt: skip
    for p in prof:
        for cap in [rng.randint(0, p.sel_saved_bytes) for _ in range(50)]:
            done = 0
            for n in p.sel_saved_sizes:
                if done + n <= cap:
                    done += n
            assert movable(p, Action.HOST_SEL, cap) == movable(p, Action.SSD_SEL, cap) == done
    caps = {i: p.sel_saved_bytes * 11 // 20 for i, p in enumerate(prof)}
    moved = _split(prof, [Action.HOST_SEL] * 4, caps)[0]
    assert moved == [movable(p, Action.HOST_SEL, caps[i]) for i, p in enumerate(prof)]
    assert all(m <= caps[i] for i, m in enumerate(moved)) and moved != list(caps.values())
    # without the storages recorded, the cap itself (as before)
    bare = LayerProfile(0, "b", 100 * mib, 0.01, 0.02, sel_saved_bytes=40 * mib)
    assert movable(bare, Action.HOST_SEL, 25 * mib + 3) == 25 * mib + 3


def test_plans_fit_the_real_pool_with_small_storages() -> None:
    """The pool and the SSD file allocate each storage at its 4 KiB-aligned size: with storages of a few KiB
    (min_tensor_bytes 0) that is up to twice their bytes, past tier_capacity's 1/128 reserve."""
    from dsx.offload.store import HostPool, align_up

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
    prof = _profiles(rng, 5)
    for p in prof:
        p.input_bytes = p.saved_bytes // 8
    bw = {b.tier: b for b in BW}
    keep_peak = simulate(prof, [Action.KEEP] * 5, bw, 1)[2]
    for budget, over in ((keep_peak * 4 / GiB, False), (1e-3, True)):
        plan = make_plan(prof, BW, _cfg(policy=policy, memory_budget_gb=budget), best_effort=True)
        assert plan.over_budget is over and plan.over_budget == (plan.peak_bytes > budget * GiB)
        assert ("OVER BUDGET" in plan.describe()) is over
    assert not make_plan(prof, BW, _cfg(policy=policy)).over_budget  # no budget, nothing to be over


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
