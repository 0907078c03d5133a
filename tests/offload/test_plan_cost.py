"""The planner's cost model: step time, stall and peak memory of a plan, tier usage, partial moves and write
barriers, on hand-worked cases and against a plain reference."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsx.offload.plan import (
    Action,
    LayerProfile,
    MoveCap,
    TierBandwidth,
    make_plan,
    movable,
    simulate,
    tier_usage,
    write_barrier,
    write_barrier_fixed,
)
from tests.offload._plans import BW, GiB, _bw, _cfg, _profiles, _with_background


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


def test_writes_run_on_through_the_gap_after_the_last_forward() -> None:
    # Layer 0's 1 GiB write (1 GiB/s) starts when its forward ends (0.5 s) and ends at 1.5 s; the forward
    # ends at 1.25 s, with all three layers on the device (the gap's footprint is taken at its start). Without
    # a gap the last layer's backward starts then, with layer 0 still there (its read is not yet issued at
    # depth 1) and half a GiB of workspace on top; with the head's 0.5 s gap it starts at 1.75 s, layer 0
    # gone. The gap is outside the layers' time either way. The write barrier awaited when the model's forward
    # returns (before the head's backward) stays where it was; the one at the last layer's backward start
    # moves with the gap.
    def profiles(gap: float | None) -> list[LayerProfile]:
        return [LayerProfile(0, "a", GiB, 0.5, 1.0), LayerProfile(1, "b", GiB, 0.5, 1.0),
                LayerProfile(2, "c", GiB, 0.25, 1.0, bwd_workspace_bytes=GiB // 2, gap_s=gap)]  # fmt: skip

    bw = {"host": TierBandwidth("host", GiB, GiB)}
    plan = [Action.HOST, Action.KEEP, Action.KEEP]
    t0, stall0, peak0 = simulate(profiles(None), plan, bw, 1)
    t1, stall1, peak1 = simulate(profiles(0.5), plan, bw, 1)
    assert peak0 == 3 * GiB + GiB // 2 and peak1 == 3 * GiB
    assert t0 == t1 == pytest.approx(4.25) and stall0 == stall1 == 0.0
    assert simulate(profiles(0.0), plan, bw, 1) == (t0, stall0, peak0)
    (fwd0, bwd0), (fwd1, bwd1) = (
        write_barrier(profiles(None), plan, bw),
        write_barrier(profiles(0.5), plan, bw),
    )
    assert fwd0[3] == fwd1[3] == -1 and bwd0[2] == -1 and bwd1[2] == 2


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


def test_keep_all_peak_reproduces_the_measured_points() -> None:
    # with everything kept the model must give back the largest point the profiling step measured
    prof = _with_background(random.Random(3), 6)
    saved = [p.saved_bytes for p in prof]
    points = []
    for i, p in enumerate(prof):
        points.append(p.fwd_background_bytes + sum(saved[:i]) + p.fwd_peak_bytes)
        points.append(p.gap_background_bytes + sum(saved[: i + 1]))
        points.append(p.bwd_background_bytes + sum(saved[: i + 1]) + p.bwd_workspace_bytes)
    _, _, peak = simulate(prof, [Action.KEEP] * 6, _bw(BW), 2)
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
    layer on the device until the file write ends (1 + 2 s)."""
    from dsx.offload.plan.cost import _forward, _timeline

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


@pytest.mark.parametrize("n", [1, 2, 5])
def test_fixed_write_barrier_waits_two_layers_back_and_for_all_before_backward(n: int) -> None:
    fwd, bwd = write_barrier_fixed(n)
    assert len(fwd) == n + 1 and bwd == []
    assert fwd[:n] == [j - 2 if j >= 2 else -1 for j in range(n)] and fwd[n] == n - 1
    assert write_barrier_fixed(n, lag=1)[0][:n] == list(range(-1, n - 1))
    with pytest.raises(ValueError, match="lag"):
        write_barrier_fixed(n, lag=0)


def _timeline_reference(profiles, actions, bw, depth, caps=None):
    """The cost model's footprints written the plain way, O(layers) per point: the reference for the
    planner's prefix-sum version."""
    from dsx.offload.plan.cost import _forward, _split

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
        clock += p.gap_s or 0.0
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
    t -= sum(p.gap_s or 0.0 for p in profiles)  # outside the layers' time
    for j, a in enumerate(actions):  # each moved tensor's host time
        if not a.moved:
            continue
        sizes = [] if a.recomputed else (profiles[j].sel_saved_sizes if a.sel else profiles[j].saved_sizes)
        cap = (caps or {}).get(j)
        count = len(sizes) or 1
        if sizes and cap is not None:
            done = count = 0
            for size in sizes:
                if size >= getattr(cap, "floor", 0) and done + size <= cap:
                    done, count = done + size, count + 1
        t += bw[a.tier.value].per_tensor_s * count
    return t, feet


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 10), seed=st.integers(0, 10**6), depth=st.integers(1, 8))
def test_timeline_matches_the_plain_reference(n: int, seed: int, depth: int) -> None:
    from dsx.offload.plan.cost import _timeline

    rng = random.Random(seed)
    prof = _with_background(rng, n)
    for p in prof:
        p.sel_saved_bytes, p.sel_recompute_s = p.saved_bytes // 4, 0.003
        p.input_bytes = p.saved_bytes // 16
        p.gap_s = rng.choice([None, 0.0, rng.uniform(0, 0.05)])
        if rng.random() < 0.7:  # the storages, in save order (a floor and the tensor count need them)
            cuts = sorted(rng.sample(range(1, p.saved_bytes), min(6, p.saved_bytes - 1)))
            p.saved_sizes = [b - a for a, b in zip([0, *cuts], [*cuts, p.saved_bytes])]
    bw = _bw(BW)
    actions = [rng.choice(list(Action)) for _ in range(n)]
    caps = {
        i: MoveCap(rng.randint(1, 1 << 28), rng.choice([0, 0, 1 << 20, 1 << 24]))
        for i in range(n)
        if actions[i].moved and rng.random() < 0.3
    }
    assert all(b.per_tensor_s > 0 for b in bw.values())  # the host time per tensor is in the comparison
    t, _, feet = _timeline(prof, actions, bw, depth, caps)
    t_ref, feet_ref = _timeline_reference(prof, actions, bw, depth, caps)
    assert feet == feet_ref and t == pytest.approx(t_ref, rel=1e-12)


def test_partial_sel_moves_follow_the_sel_storages() -> None:
    # +sel: the runtime moves, in save order, each storage of what the layer saves with its recompute modules
    # recomputed that still fits under the cap; the planner counts exactly that
    from dsx.offload.plan.cost import _split

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
    # without the storages recorded, the cap itself
    bare = LayerProfile(0, "b", 100 * mib, 0.01, 0.02, sel_saved_bytes=40 * mib)
    assert movable(bare, Action.HOST_SEL, 25 * mib + 3) == 25 * mib + 3
