"""The planner's search: an action per layer, the least predicted step time under the memory budget.

Exhaustive over all c^n assignments when c^n <= ``exhaustive_limit``, c being the number of actions (keep,
recompute and one per tier; with ``recompute_modules`` also the ``+sel`` forms; with profiled layer inputs
also ``recompute+<tier>``: 9 with two tiers) — small models, and the tests' ground truth; otherwise a local
search from each uniform plan: passes that give each layer in turn its best action with the others fixed,
until a pass changes nothing, ordered by (memory over budget, step time, peak memory) — so it first reaches
the budget, then shortens the step. With no budget the order is (time over baseline, peak memory, step
time). When no plan the search considers meets the budget, the best-effort plan is the one of them with the
lowest peak (then the shortest step). Ties in all of these go to the plan with the fewest bytes on the SSD.
Every prefetch depth 1..``MAX_DEPTH`` is searched. A hide-only plan is then filled up to the bound with parts
of layers (``move_caps``), each of which must lower the predicted peak.

Plans come from :mod:`~dsx.offload.plan.cost`'s model; the search takes seconds for a few dozen layers and
grows about as n^3 (``Plan.search_s`` records it; docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from dsx.config import ActivationOffloadConfig
from dsx.offload.plan.barrier import write_barrier
from dsx.offload.plan.cost import (
    _greedy,
    _held,
    _over_capacity,
    _overflow,
    _sizes,
    _split,
    movable,
    simulate,
    tier_capacity,
    tier_usage,
)
from dsx.offload.plan.types import GB, Action, LayerProfile, MoveCap, Plan, PlanError, check_profiles
from dsx.runtime.bandwidth import TierBandwidth

__all__ = ["MAX_DEPTH", "floor_bytes", "make_plan", "planned_bandwidths"]

# Deepest prefetch the search tries. A layer's read must be issued this many layers ahead when it takes
# longer than one layer's backward: a large layer's read over the host link can outlast several layers'
# backward, and at too shallow a depth no whole layer could be hidden.
MAX_DEPTH = 8


def _choices(
    cfg: ActivationOffloadConfig, bw: dict[str, TierBandwidth], profiles: list[LayerProfile]
) -> list[Action]:
    tiers = [t for t in cfg.tiers if t in bw]
    out = [Action.KEEP, Action.RECOMPUTE, *(Action(t) for t in tiers)]
    if any(p.sel_saved_bytes is not None for p in profiles):
        out += [Action(f"{a.value}+sel") for a in out if a != Action.RECOMPUTE]
    if any(p.input_bytes for p in profiles):
        out += [Action(f"recompute+{t}") for t in tiers]
    return out


def _usable(a: Action, p: LayerProfile) -> bool:
    if p.recompute_only:  # its inputs cannot move either: the non-reentrant checkpoint holds them itself
        return a == Action.RECOMPUTE
    if a.recomputed and a.moved and not p.input_bytes:  # no input to move: that is plain recompute
        return False
    return not a.sel or p.sel_saved_bytes is not None


def _fit(a: Action, p: LayerProfile) -> Action:
    """``a`` where the layer can take it, else the nearest it can: drop ``+sel``; recompute if it must."""
    if _usable(a, p):
        return a
    return Action.RECOMPUTE if p.recompute_only else a.base


def _depth(profiles: list[LayerProfile], bw: dict[str, TierBandwidth]) -> int:
    """Enough layers in flight that one layer's read fits in the backward time of those ahead of it."""
    if not bw or not profiles:
        return 1
    slowest = min(b.read_Bps for b in bw.values())
    read_s = max(p.saved_bytes for p in profiles) / slowest
    bwd = sorted(p.bwd_s for p in profiles)[len(profiles) // 2] or 1e-9
    return int(min(MAX_DEPTH, max(1, -(-read_s // bwd))))


def make_plan(
    profiles: list[LayerProfile],
    bandwidths: list[TierBandwidth],
    cfg: ActivationOffloadConfig,
    *,
    exhaustive_limit: int = 4**7,
    best_effort: bool = False,
    outside_s: float = 0.0,
    outside_peak_bytes: int = 0,
) -> Plan:
    """Pick an action per layer: least predicted step time under ``cfg.memory_budget_gb``.

    With no budget, offload only what the bound hides: the plan that saves the most memory among those
    predicted no slower than keeping everything (within 0.5%), and keep everything where no such plan
    lowers the predicted activation peak (the runtime then checks the measured peak: ``Calibration``).

    Raises
    ------
    PlanError
        If no plan the search considers meets the budget (policy ``auto``); the message gives the lowest
        peak the planner reaches (as ``floor_bytes``: the most frugal uniform plan's or the lowest-peak
        plan's the search considered, if lower). With ``best_effort`` the plan of lowest peak among those
        considered is returned instead, with ``over_budget`` set (training then measures whether the
        model's estimate was pessimistic).
    ValueError
        If a profile's time or byte count is NaN, infinite or negative (naming the layer and the field), or
        policy ``offload_all`` has no bandwidth for its tier (the last of ``cfg.tiers``, as the runtime).

    Policies ``none``, ``recompute_all`` and ``offload_all`` give the runtime's fixed plans (``offload_all``:
    every layer to the last tier of ``cfg.tiers``, at ``cfg.prefetch_depth`` or 1), with ``over_budget`` set
    where a budget is given and their predicted peak exceeds it.

    ``outside_s`` (the step's time outside the layers: ``Profiler.outside_s``) does not enter the
    search; it is carried into ``Plan.predicted_total_step_s`` and the printed plan. ``outside_peak_bytes`` (the
    step's peak after the layers' backward: ``Profiler.outside_peak``) is carried the same way into
    ``Plan.predicted_step_peak_bytes``: the search plans the layers against the budget whatever it is.

    Notes
    -----
    Cost grows about as n^3 in the number of layers (``Plan.search_s``; figures in docs/performance.md).
    """
    t_start = time.perf_counter()
    check_profiles(profiles)
    bw = planned_bandwidths(bandwidths, cfg)
    n = len(profiles)
    depth = cfg.prefetch_depth or _depth(profiles, bw)
    # doing nothing: every layer kept, but those profiled only as recomputed (they cannot be kept)
    keep_all = [_fit(Action.KEEP, p) for p in profiles]
    base_t, _, keep_peak = simulate(profiles, keep_all, bw, depth)
    budget_bytes = None if cfg.memory_budget_gb is None else int(cfg.memory_budget_gb * GB)
    search = ""
    if cfg.policy == "none":
        actions = keep_all
    elif cfg.policy == "recompute_all":
        actions = [Action.RECOMPUTE] * n
    elif cfg.policy == "offload_all":
        # the runtime's rule (ActivationOffload): every layer to the last tier, at prefetch_depth or 1
        last = Action(cfg.tiers[-1])
        if last.value not in bw:
            raise ValueError(
                f"policy 'offload_all' moves every layer to the last tier, {last.value!r}, and no bandwidth "
                f"was given for it (bandwidths measured: {sorted(bw) or 'none'})"
            )
        depth = cfg.prefetch_depth or 1
        actions = [last] * n
        if cfg.recompute_modules:
            actions = [
                Action(f"{last.value}+sel") if p.sel_saved_bytes is not None else last for p in profiles
            ]
    else:
        # The prefetch depth trades stall (too shallow) against memory (too deep): search it too.
        depths = [cfg.prefetch_depth] if cfg.prefetch_depth else list(range(1, min(n, MAX_DEPTH) + 1))
        found = {d: _search(profiles, bw, cfg, d, base_t, exhaustive_limit) for d in depths}
        search = "exhaustive" if all(f.exhaustive for f in found.values()) else "local"
        budget = None if cfg.memory_budget_gb is None else cfg.memory_budget_gb * GB
        fits = [d for d in depths if budget is None or found[d].peak <= budget]
        if fits:
            depth = min(fits, key=lambda d: found[d].score)
            actions = found[depth].actions
        else:
            # no plan considered meets the budget: the lowest peak among them (what best effort installs)
            depth = min(depths, key=lambda d: found[d].lowest[0])
            actions = found[depth].lowest[1]
            if not best_effort:
                choices, capacity = _choices(cfg, bw, profiles), tier_capacity(cfg)
                uniform = min(_floor(profiles, bw, choices, d, capacity) for d in depths)
                floor = min(uniform, found[depth].lowest[0][1])
                raise PlanError(
                    f"memory_budget_gb={cfg.memory_budget_gb} cannot be met: the most frugal plan found "
                    f"keeps {floor / GB:.2f} GiB of activations (raise the budget, add a tier, or lower the "
                    "micro-batch)"
                )
    t_fwd = sum(p.fwd_s for p in profiles)
    t_bwd = sum(p.bwd_s for p in profiles)
    # every moved byte, to either tier, crosses the device's link first (_forward): the host tier's, or the
    # SSD tier's where there is no host tier
    link = bw.get("host") or bw.get("ssd")
    hide_w = link.write_Bps * t_fwd if link else 0.0
    hide_r = link.read_Bps * t_bwd if link else 0.0
    caps: dict[int, int] = {}
    if cfg.policy == "auto" and cfg.memory_budget_gb is None and bw:
        # Fill no further than the bound (past it, writes spilling into backward are the model's guess, not
        # measured), at each prefetch depth: a partial layer's read may need a deeper one than the whole-layer
        # plan chose. _fill_bound only keeps parts whose plan stays within the limit and that lower the peak
        # of the plan they fill (by a 64th of their layer); a fill is kept only if it peaks lower than the
        # whole-layer plan.
        whole_peak = simulate(profiles, actions, bw, depth)[2]
        room = int(min(hide_w, hide_r) - sum(_split(profiles, actions, None)[0]))
        fills = [
            (*_fill_bound(profiles, actions, bw, d, base_t * 1.005, room, tier_capacity(cfg)), d)
            for d in depths
        ]
        # bytes moved are not memory saved: the fill that lowers the peak most, then moves least, then the
        # shallowest (moving the last layers fills the bound too, but their reads land before the peak)
        fills = [(simulate(profiles, f[0], bw, f[2], f[1])[2], *f) for f in fills if f[1]]
        fills = [f for f in fills if f[0] < whole_peak]
        if fills:
            _, actions, caps, depth = min(fills, key=lambda f: (f[0], sum(f[2].values()), f[3]))
        # Never worse than doing nothing: a hide-only plan that lowers no peak would move bytes (and take
        # the link, and the risk of a stall the model did not see) for nothing; keep every layer instead.
        if actions != keep_all and simulate(profiles, actions, bw, depth, caps)[2] >= keep_peak:
            actions, caps = keep_all, {}
    t, stall, peak = simulate(profiles, actions, bw, depth, caps)
    planned = sum(_split(profiles, actions, caps)[0])
    usage, capacity = tier_usage(profiles, actions, bw, caps), tier_capacity(cfg)
    bound = {
        "hideable_write_bytes": hide_w,
        "hideable_read_bytes": hide_r,
        "planned_bytes": planned,
        "fraction_of_bound": planned / min(hide_w, hide_r) if min(hide_w, hide_r) > 0 else 0.0,
        "baseline_step_s": base_t,
        "keep_all_bytes": keep_peak,  # the predicted activation peak of keeping every layer
        "budget_bytes": budget_bytes,
        "tiers": {k: {"write_Bps": v.write_Bps, "read_Bps": v.read_Bps} for k, v in bw.items()},
        "tier_bytes": {k: usage[k] for k in bw},
        "tier_capacity_bytes": {k: capacity[k] for k in bw},
    }
    over = budget_bytes is not None and peak > budget_bytes
    barrier = cfg.resolved("write_barrier") == "on"
    fwd_barrier, bwd_barrier = write_barrier(profiles, actions, bw, caps) if barrier else ([], [])
    return Plan(actions, depth, t, bound, profiles, peak, stall, over_budget=over, move_caps=caps,
                search_s=time.perf_counter() - t_start, search=search, write_barrier=fwd_barrier,
                write_barrier_bwd=bwd_barrier, outside_s=outside_s,
                outside_peak_bytes=outside_peak_bytes)  # fmt: skip


def planned_bandwidths(
    bandwidths: list[TierBandwidth], cfg: ActivationOffloadConfig
) -> dict[str, TierBandwidth]:
    """The configured tiers with a measured bandwidth; without a budget each moved tensor also costs
    ``moved_tensor_host_us``. (A hide-only plan's many tensors made the step slower than the model saw by about
    their hooks' host time. Under a budget the charge is left out: there it steers plans from moving layers
    toward recomputing them, and no measurement has shown those plans faster.)"""
    per_tensor = cfg.moved_tensor_host_us * 1e-6 if cfg.memory_budget_gb is None else 0.0
    return {
        b.tier: dataclasses.replace(b, per_tensor_s=per_tensor)
        for b in bandwidths
        if b.tier in cfg.tiers and b.write_Bps > 0 and b.read_Bps > 0
    }


def _floor(
    profiles: list[LayerProfile],
    bw: dict[str, TierBandwidth],
    choices: list[Action],
    depth: int,
    capacity: dict[str, int],
) -> int:
    """The peak of the most frugal uniform plan (every layer the same action, where it can take it) that
    its tiers can hold."""
    plans = ([_fit(a, p) for p in profiles] for a in choices)
    return min(
        simulate(profiles, plan, bw, depth)[2]
        for plan in plans
        if not _over_capacity(tier_usage(profiles, plan, bw), capacity)
    )


def floor_bytes(
    profiles: list[LayerProfile], bandwidths: list[TierBandwidth], cfg: ActivationOffloadConfig
) -> int:
    """The lowest activation peak the planner reaches, over prefetch depths 1..``MAX_DEPTH`` (or
    ``cfg.prefetch_depth``): the lower of the most frugal uniform plan's peak and the peak of the lowest-peak
    plan policy ``auto``'s search considers (``make_plan`` under a zero budget, best effort). Where the search
    is exhaustive no plan peaks lower, so budgets below it have no plan; the local search may miss lower ones.
    """
    check_profiles(profiles)
    bw = planned_bandwidths(bandwidths, cfg)
    choices = _choices(cfg, bw, profiles)
    depths = [cfg.prefetch_depth] if cfg.prefetch_depth else range(1, min(len(profiles), MAX_DEPTH) + 1)
    uniform = min(_floor(profiles, bw, choices, d, tier_capacity(cfg)) for d in depths)
    lowest = make_plan(
        profiles,
        bandwidths,
        cfg.model_copy(update={"policy": "auto", "memory_budget_gb": 0.0}),
        best_effort=True,
    )
    return min(uniform, lowest.peak_bytes)


def _fill_bound(
    profiles: list[LayerProfile],
    actions: list[Action],
    bw: dict[str, TierBandwidth],
    depth: int,
    limit_s: float,
    room: int,
    capacity: dict[str, int],
) -> tuple[list[Action], dict[int, int]]:
    """Hide-only plans move whole layers, so they stop short of the bound by up to one layer (a megatron-core
    layer can be most of the bound). Move part of more kept layers, one at a time: each time the kept layer
    whose part lowers the predicted peak most, with the fewest bytes that reach that peak, up to the ``room``
    left under the bound, while the step stays within ``limit_s`` (a grid, then a bisection, on the byte
    count) and the tier within ``capacity``, until no layer lowers the peak by a 64th of what it saves. A part
    may also be only the layer's larger storages (a :class:`MoveCap` floor): the same bytes in fewer tensors
    cost less host time, which the model charges per tensor. A part that lowers no peak is not moved, however
    much of the bound is left: its bytes would cost hooks, events and link time for nothing (and moving part
    of a layer can hold the link while another layer's write would have ended)."""
    actions, caps = list(actions), {}
    tier = next(iter(bw))
    room = min(room, capacity[tier] - tier_usage(profiles, actions, bw)[tier])
    cur_peak = simulate(profiles, actions, bw, depth)[2]
    while room >= 1 << 20:
        best: tuple[tuple[int, float, int], MoveCap, int, Action] | None = None
        for i, a in enumerate(actions):
            if a.base != Action.KEEP:
                continue
            act = Action(f"{tier}+sel") if a.sel else Action(tier)
            cand = [*actions[:i], act, *actions[i + 1 :]]
            sizes = _sizes(profiles[i], act)
            worth = max(1 << 20, profiles[i].stored(act) // 64)
            # the floors that change what moves: every storage, or only those of the largest few sizes (a floor
            # whose storages together could not lower the peak by the part's worth is not tried)
            floors = [0, *sorted({n for n in sizes if n >= 1 << 20}, reverse=True)[:_FLOORS]]
            floors = [f for f in floors if not f or sum(n for n in sizes if n >= f) >= worth]
            for floor in floors:
                found = _part(
                    profiles, cand, i, act, floor, caps, bw, depth, limit_s, cur_peak, room, capacity
                )
                if found is None:
                    continue
                cap, (t, peak) = found
                # a partial layer must lower the peak by a 64th of what the layer saves (and a MiB): moving bytes
                # that lower nothing, or next to nothing, costs the layer's hooks, its copy events and the link
                key = (peak, t, int(cap))
                if cur_peak - peak >= worth and (best is None or key < best[0]):
                    best = (key, cap, i, act)
        if best is None:
            break
        (cur_peak, _, moved), cap, i, act = best
        actions[i], caps[i] = act, cap
        room -= moved
    return actions, caps


# how many of a layer's largest storage sizes the fill tries as a part's floor
_FLOORS = 3


def _part(
    profiles: list[LayerProfile],
    cand: list[Action],
    i: int,
    act: Action,
    floor: int,
    caps: dict[int, int],
    bw: dict[str, TierBandwidth],
    depth: int,
    limit_s: float,
    cur_peak: int,
    room: int,
    capacity: dict[str, int],
) -> tuple[MoveCap, tuple[float, int]] | None:
    """The cap of layer ``i``'s part (its storages of at least ``floor`` bytes) that peaks lowest within the
    step limit, the peak so far and the capacity, with the fewest bytes reaching that peak; and its (step,
    peak). None if no part of at least a MiB fits."""

    sizes = _sizes(profiles[i], act)
    seen: dict[object, tuple[bool, float, int]] = {}

    def fits(cap: int) -> tuple[bool, float, int]:
        """(within the limits, step time, peak) with layer i capped; once per set of storages the cap moves
        (caps between two storage sums move the same ones)."""
        key = tuple(_greedy(sizes, cap, floor)) if sizes else cap
        if key not in seen:
            trial = {**caps, i: MoveCap(cap, floor)}
            t, _, peak = simulate(profiles, cand, bw, depth, trial)
            ok = t <= limit_s and peak <= cur_peak
            seen[key] = (ok and not _over_capacity(tier_usage(profiles, cand, bw, trial), capacity), t, peak)
        return seen[key]

    def moves(cap_mib: int) -> int:
        return movable(profiles[i], act, MoveCap(cap_mib << 20, floor))

    # The peak is not monotone in the cap (a larger part can hold the link until its read lands before the
    # peak): caps on a grid, doubling from a MiB and in 16ths, what the runtime moves under each (in whole
    # MiB, so that a cap is exactly the bytes it moves)
    top = min(moves(profiles[i].stored(act) >> 20), room) >> 20
    grid = {1 << k for k in range(top.bit_length())} | {top * k // 16 for k in range(1, 17)}
    caps_tried = sorted({moves(m) for m in grid if m} - {0})
    found, below = None, 0
    for prev, c in zip([0, *caps_tried], caps_tried):
        ok, t, peak = fits(c)
        # ascending: the fewest bytes win a tie
        if ok and (found is None or (peak, t) < (found[2], found[1])):
            found, below = (c, t, peak), prev
    if found is None or found[0] < 1 << 20:  # only storages under a MiB (norm statistics)
        return None
    cap, t, peak = found
    # the fewest bytes between the grid point below and the one found that reach its peak
    lo, hi = below, cap
    while hi - lo > max(1 << 20, hi // 256):
        mid = (lo + hi) // 2
        ok_mid, _, peak_mid = fits(mid)
        if ok_mid and peak_mid <= peak:
            hi = mid
        else:
            lo = mid
    lean = moves(-(-hi >> 20))
    if lean < cap and lean >= 1 << 20 and (f := fits(lean))[0] and f[2] <= peak:
        cap, t, peak = lean, f[1], f[2]
    return MoveCap(cap, floor), (t, peak)


def _nearer(
    actions: list[Action], score: Callable[[list[Action]], tuple[float, ...]], choices: list[Action]
) -> list[Action]:
    """``actions`` with each SSD layer moved to the host where that scores no worse (``score`` ranks the SSD's
    bytes last, so a tie is a gain)."""
    cur_plan, cur = list(actions), score(actions)
    for i, a in enumerate(actions):
        if a.tier is Action.SSD:
            near = Action(a.value.replace("ssd", "host"))
            if near in choices:
                cand_plan = [*cur_plan[:i], near, *cur_plan[i + 1 :]]
                cand = score(cand_plan)
                if cand <= cur:
                    cur_plan, cur = cand_plan, cand
    return cur_plan


@dataclass
class _Found:
    """One depth's search: its best plan, that plan's score and peak, and the lowest-peak plan it considered,
    ranked by (over a tier's capacity, peak, step time, bytes on the SSD) (with a budget only; the best-effort
    plan)."""

    actions: list[Action]
    score: tuple[float, ...]
    peak: int
    lowest: tuple[tuple[float, ...], list[Action]] | None
    exhaustive: bool


def _search(
    profiles: list[LayerProfile],
    bw: dict[str, TierBandwidth],
    cfg: ActivationOffloadConfig,
    depth: int,
    base_t: float,
    exhaustive_limit: int,
) -> _Found:
    choices = _choices(cfg, bw, profiles)
    n = len(profiles)
    budget = None if cfg.memory_budget_gb is None else cfg.memory_budget_gb * GB
    capacity = tier_capacity(cfg)
    roomy = min(capacity.values())
    held: dict[tuple[int, Action], int] = {}
    lowest: tuple[tuple[float, ...], list[Action]] | None = None

    def on_ssd(actions: list[Action]) -> int:
        return sum(held[i, a] for i, a in enumerate(actions) if a.tier is Action.SSD)

    def score(actions: list[Action]) -> tuple[float, ...]:
        nonlocal lowest
        # first what no tier can hold (the mover would leave those bytes on the device, over the plan); a
        # tier never holds more than all moved bytes, so most plans skip the second forward pass
        moved = 0
        for i, a in enumerate(actions):
            if a.moved:
                if (i, a) not in held:
                    held[i, a] = _held(profiles[i], a, None)
                moved += held[i, a]
        full = _over_capacity(tier_usage(profiles, actions, bw), capacity) if moved > roomy else 0
        if budget is None:  # hide only: no slower than baseline, then least memory, then least time
            t, _, peak = simulate(profiles, actions, bw, depth)
            return (full, max(0.0, t - base_t * 1.005), peak, t)
        t, over, peak = _overflow(profiles, actions, bw, depth, budget)
        if lowest is None or (full, peak, t) <= lowest[0][:3]:
            rank = (full, peak, t, on_ssd(actions))
            if lowest is None or rank < lowest[0]:
                lowest = (rank, list(actions))
        return (full, over, t, peak)

    # Last, among plans alike in everything else, the fewest bytes on the SSD: where the link hides both tiers'
    # transfers, a layer sent to the SSD ties with it sent to the host, and the drive would take wear, and the
    # risk of running slower than measured, for nothing. (Not in the descent's score: there it would turn ties
    # into steps and lengthen the search.)
    def ranked(actions: list[Action]) -> tuple[float, ...]:
        return (*score(actions), on_ssd(actions))

    exhaustive = len(choices) ** n <= exhaustive_limit
    if exhaustive:
        plans = (list(c) for c in itertools.product(choices, repeat=n))
        best = min((c for c in plans if all(map(_usable, c, profiles))), key=ranked)
    else:
        # Descend from every uniform plan (keep all, recompute all, all to one tier) and keep the best end
        # point: from "keep all" alone a tight budget can leave the descent in a local minimum. Each pass
        # gives every layer in turn its best action with the others fixed, until a pass changes nothing: a
        # local minimum over single-layer changes, like steepest descent, in a few passes rather than one
        # evaluation of all n x c changes per step (far slower on a few dozen layers).
        ends = []
        starts = {tuple(_fit(start, p) for p in profiles) for start in choices}
        # in a fixed order: the plans considered, and so the lowest-peak one among ties, do not depend on
        # the set's (hash-seeded) order
        for start_plan in sorted(starts, key=lambda s: [a.value for a in s]):
            cur_plan = list(start_plan)
            cur = score(cur_plan)
            changed = True
            while changed:
                changed = False
                for i in range(n):
                    for a in choices:
                        if a == cur_plan[i] or not _usable(a, profiles[i]):
                            continue
                        cand = score([*cur_plan[:i], a, *cur_plan[i + 1 :]])
                        if cand < cur:
                            cur, cur_plan[i], changed = cand, a, True
            ends.append((cur, cur_plan))
        best = min(ends, key=lambda e: (e[0], on_ssd(e[1]), [a.value for a in e[1]]))[1]
        # the descent changes one layer at a time and only for a strictly better score, so an SSD layer whose
        # host twin ties with it stays where the descent started it: offer each one the host, in the best plan
        # and in the lowest-peak one
        best = _nearer(best, ranked, choices)
        if lowest is not None:

            def low_rank(actions: list[Action]) -> tuple[float, ...]:  # the lowest-peak plan's order
                full, _, t, peak = score(actions)
                return (full, peak, t, on_ssd(actions))

            near = _nearer(lowest[1], low_rank, choices)
            lowest = min(lowest, (low_rank(near), near), key=lambda e: e[0])
    sc = score(best)
    return _Found(best, sc, int(sc[3] if budget is not None else sc[2]), lowest, exhaustive)
