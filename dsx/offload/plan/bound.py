"""A lower bound on the step time of any per-layer plan at each activation budget, from measurements alone.

The planner's frontier (:func:`~dsx.offload.plan.search.make_plan` at each budget) is what its cost model
predicts; this is what no plan of per-layer and per-module keep / move / recompute choices can beat on the
same kernels and links, every assumption not measured taken in the plan's favour. A measured step under it
would mean the bound is wrong; a target under it is out of reach for such plans. ``benchmarks/plan_frontier.py``
draws it beside the frontier.

Two bounds, both valid, and the larger one reported as ``"timeline"``: the aggregate one (``"until_peak"``:
one peak, every write until it) and one on the profiled memory timeline, which checks every point the cost
model checks (each layer's forward, the gap after it, each layer's backward) with each point's own window
for writes and, in the backward, the reads still owed.

Its inputs are a benchmark run's rows by config name (``"none"``: no offload, required; ``"recompute"``,
``"save_on_cpu"``, ``"megatron_selective"`` where measured), each with ``step_s`` and ``activation_peak_gb``
(GB of 10^9 bytes, as ``benchmarks/bench_offload.py`` reports them), the layers' profiles and the tiers'
bandwidths.
"""

from __future__ import annotations

import itertools
from typing import Any

from dsx.offload.plan.cost import footprints
from dsx.offload.plan.types import LayerProfile
from dsx.runtime.bandwidth import TierBandwidth

__all__ = ["bound_step_s", "lower_bound", "timeline_bound", "timeline_extra_s"]

GB = 1e9  # the unit the measured rows report memory in


def lower_bound(
    measured: dict[str, dict[str, Any]],
    profiles: list[LayerProfile],
    bandwidths: list[TierBandwidth],
    speedup: float = 1.15,
) -> dict[str, Any] | None:
    """A step time no plan of per-layer and per-module choices (keep, move to a tier, recompute the layer or
    its ``recompute_modules``) goes under at each activation budget, on the model's own kernels and the run's
    links: measured inputs, every other assumption in the plan's favour.

    Until the last layer's backward (the first to run) ends, every saved byte is live unless it was moved
    off by then or dropped to be recomputed, so a plan peaking at ``B`` removed at least
    ``R = P_none - B`` bytes by then (``P_none``: no offload's activation peak, which falls there). Moved bytes
    are at most the tiers' write rates summed (``bw``: the copies cost nothing, SSD writes do not share the
    link) times the time up to that point: no offload's ``W0`` plus every second the plan adds (``X``:
    recomputation or stalls carry writes too). Dropped bytes cost at least ``c`` each, the cheapest measured
    cost per byte dropped: a layer's forward per byte it drops, its ``recompute_modules``' per byte they drop,
    the measured full and selective recompute steps per byte their layers drop. So ``X >= c * (R - bw * (W0
    + X))``, that is ``X >= c * (R - bw * W0) / (1 + c * bw)`` (:func:`bound_step_s`).

    Two windows ``W0``: ``"until_peak"``, the no-offload step less the other layers' backward times (the
    bound), and ``"forward"``, the layers' forward times: the design's "hideable bytes = bandwidth x forward
    time", a model, not a bound (copies can go on past the forward). ``window_s_for_speedup`` is the ``W0`` at
    which the bound would allow ``speedup`` times full recompute's throughput at its peak: a peak that late in
    no offload's step, or that speed-up is out of reach.

    The ``"timeline"`` bound (:func:`timeline_bound`) is the larger of ``"until_peak"`` and one that checks
    the profiled footprint at every point of the step; its entry holds the points.

    Returns the cost per GB dropped of each way measured (``cost_s_per_gb``) and the ``cheapest``; per window
    its ``movable_gb`` and the bound's ``curve`` over budgets, and the bound at full recompute's and
    ``save_on_cpu``'s measured peaks where those were measured. None without a no-offload row or profiles.
    """
    none = measured.get("none")
    if none is None or not profiles:
        return None
    t_none, p_none = none["step_s"], none["activation_peak_gb"] * GB
    write_Bps = sum(b.write_Bps for b in bandwidths)
    costs: dict[str, float] = {}
    layer = [p.fwd_s / (p.saved_bytes - p.input_bytes) for p in profiles if p.saved_bytes > p.input_bytes]
    has_sel = [p for p in profiles if p.sel_saved_bytes is not None and p.saved_bytes > p.sel_saved_bytes]
    if layer:
        costs["layer_forward"] = min(layer)
    if has_sel:
        costs["recompute_modules"] = min(
            p.sel_recompute_s / (p.saved_bytes - p.sel_saved_bytes) for p in has_sel
        )
    # the measured strategies: time added per byte their layers drop (not per byte of peak: both fall)
    dropped = {"recompute": sum(max(0, p.saved_bytes - p.input_bytes) for p in profiles),
               "megatron_selective": sum(p.saved_bytes - p.sel_saved_bytes for p in has_sel)}  # fmt: skip
    for cfg, nbytes in dropped.items():
        r = measured.get(cfg)
        if r is not None and nbytes > 0:
            costs[f"measured_{cfg}"] = max(0.0, r["step_s"] - t_none) / nbytes
    if not costs:
        return None
    cheapest = min(costs, key=costs.get)
    # (the last layer's backward, which runs first, is in "until_peak": no offload may peak anywhere in it)
    windows = {"until_peak": max(0.0, t_none - sum(p.bwd_s for p in profiles[:-1])),
               "forward": sum(p.fwd_s for p in profiles)}  # fmt: skip
    out: dict[str, Any] = {
        "kind": "lower bound on measured inputs (per-layer and per-module keep / move / recompute plans)",
        "no_offload_peak_gb": p_none / GB, "no_offload_step_s": t_none, "write_GBps": write_Bps / GB,
        "cost_s_per_gb": {k: v * GB for k, v in costs.items()}, "cheapest": cheapest,
        "windows": {k: {"window_s": w, "movable_gb": write_Bps * w / GB} for k, w in windows.items()},
    }  # fmt: skip
    out["timeline"] = timeline_bound(profiles, bandwidths, t_none, p_none, costs[cheapest])
    out["windows"]["timeline"] = {"kind": "the larger of until_peak and the bound on the memory timeline"}
    rc, soc = measured.get("recompute"), measured.get("save_on_cpu")
    c, bw = out["cost_s_per_gb"][cheapest], out["write_GBps"]
    if rc is not None:
        added = max(0.0, rc["step_s"] / speedup - t_none)
        removed = out["no_offload_peak_gb"] - rc["activation_peak_gb"]
        out["speedup"] = speedup
        out["window_s_for_speedup"] = max(0.0, removed - added * (1 + c * bw) / c) / bw if bw else None
    for key, w in out["windows"].items():
        curve = (
            (g, bound_step_s(out, key, g)) for g in (out["no_offload_peak_gb"] * k / 40 for k in range(41))
        )
        # (below the timeline bound's floor no plan fits: no point there)
        w["curve"] = [{"budget_gb": g, "step_s": t} for g, t in curve if t != float("inf")]
        # (a measured peak below the timeline bound's floor would mean the bound is wrong: None, not a ratio 0)
        for name, row in (("recompute", rc), ("save_on_cpu", soc)):
            if row is not None:
                t = bound_step_s(out, key, row["activation_peak_gb"])
                finite = t != float("inf")
                w[f"at_{name}_peak"] = {"step_s": t if finite else None,
                                        f"max_x_{name}": row["step_s"] / t if finite else None}  # fmt: skip
    return out


def timeline_bound(
    profiles: list[LayerProfile],
    bandwidths: list[TierBandwidth],
    t_none: float,
    p_none: float,
    cost_s_per_byte: float,
) -> dict[str, Any]:
    """The inputs of the bound on the profiled memory timeline (:func:`timeline_extra_s`), JSON-ready.

    At each point ``P`` the cost model checks (:func:`~dsx.offload.plan.cost.footprints`: each layer's forward,
    the gap after it, each layer's backward), keeping every layer needs ``F_P``; under budget ``B`` at least
    ``g = F_P - B`` bytes of the layers that have run their forward (not those past their backward) are off
    the device there. Of those, the layers from ``m`` on hold at least ``g - S_<m`` (``S_<m``: what the
    layers before ``m`` save). Each such byte was dropped (``D`` bytes in all, each costing at least ``c``
    when recomputed in the backward) or written since layer ``m``'s forward began: at most ``w x (tau_P -
    start_m + Y)``, ``tau_P`` the time to the end of ``P``'s layer's forward, the gap after it or its backward in
    no offload's step (the gaps as profiled, ``gap_s``; where the last layer's is not, all of the step outside
    the layers, for the head's gap and the backward: in the plan's favour) and
    ``Y`` what the plan adds before ``P``. At the forwards and the gaps that is the forward's stalls ``sigma``
    (recomputation runs in the backward): ``D + w sigma >= A_f - B``; in the backward it may be all the plan
    adds: ``D + w X >= A_b - B``; ``A`` the largest ``F_P - S_<m - w (tau_P - start_m)`` of each kind.

    In the backward, what is off at layer ``j``'s backward and lies in layers ``k..j`` (at least ``g - S_<k``)
    must be back before layer ``k``'s backward starts: recomputed (within ``D``) or read, at most ``r x
    (T_kj + X)``, ``T_kj`` no offload's backward time from layer ``j``'s start to ``k``'s. So ``D + r X >=
    Q - B``, ``Q`` the largest ``F_P - S_<k - r T_kj``. ``w`` and ``r`` are the tiers' rates summed (the SSD's
    do not share the link); the step adds ``X >= sigma + c D``, ``D`` at most every layer's saved bytes less
    its inputs. Below ``floor_gb`` no plan fits: some point needs more off the device than exists.

    The footprints are the profiling step's; where the largest of them (``model_peak_gb``) is above no
    offload's measured peak, every point is lowered by the difference (``shift_gb``), in the plan's favour.
    The bound trusts the other points as profiled: one measured higher than a plan's step would reach there
    raises the bound at budgets where that point binds (tests/offload/test_bound.py checks it against every
    measured run).
    """
    feet = footprints(profiles)
    n = len(profiles)
    outside = max(0.0, t_none - sum(p.fwd_s + p.bwd_s for p in profiles))
    # the gap after each layer's forward where measured (gap_s); else none, and after the last layer all of the
    # step outside the layers
    gaps = [
        p.gap_s if p.gap_s is not None else (outside if i == n - 1 else 0.0) for i, p in enumerate(profiles)
    ]
    # prefix sums: start[m], layer m's forward begins (start[n]: the backward begins); saved_before[m], what
    # layers 0..m-1 save (GB); bwd_upto[m], the backward time of layers 0..m-1
    start = list(itertools.accumulate((p.fwd_s + g for p, g in zip(profiles, gaps)), initial=0.0))
    saved_before = [b / GB for b in itertools.accumulate((p.saved_bytes for p in profiles), initial=0)]
    bwd_upto = list(itertools.accumulate((p.bwd_s for p in profiles), initial=0.0))
    model_peak = max(feet) / GB
    shift = max(0.0, model_peak - p_none / GB)
    # (name, footprint less the shift, write deadline tau, the layers whose bytes may be off: 0..top)
    points: list[tuple[str, float, float, int]] = []
    for i in range(n):
        points.append((f"forward {i}", feet[2 * i] / GB - shift, start[i] + profiles[i].fwd_s, i))
        points.append((f"gap after {i}", feet[2 * i + 1] / GB - shift, start[i + 1], i))
    for k, j in enumerate(range(n - 1, -1, -1)):
        tau = start[n] + bwd_upto[n] - bwd_upto[j]
        points.append((f"backward {j}", feet[2 * n + k] / GB - shift, tau, j))
    w = sum(b.write_Bps for b in bandwidths) / GB
    r = sum(b.read_Bps for b in bandwidths) / GB

    def writes(backward: bool) -> tuple[float, str, int]:
        return max(
            (f - saved_before[m] - w * (tau - start[m]), name, m)
            for name, f, tau, top in points
            if name.startswith("backward") == backward
            for m in range(top + 1)
        )

    fwd_writes, bwd_writes = writes(False), writes(True)
    reads = max(
        (
            (f - saved_before[k] - r * (bwd_upto[top + 1] - bwd_upto[k + 1]), name, k)
            for name, f, _, top in points
            if name.startswith("backward")
            for k in range(top + 1)
        ),
    )
    floor = max((f - saved_before[top + 1], name) for name, f, _, top in points)
    return {
        "model_peak_gb": model_peak,
        "shift_gb": shift,
        "write_need_gb": fwd_writes[0],
        "write_binding": f"{fwd_writes[1]}, layers from {fwd_writes[2]}",
        "backward_write_need_gb": bwd_writes[0],
        "backward_write_binding": f"{bwd_writes[1]}, layers from {bwd_writes[2]}",
        "read_need_gb": reads[0],
        "read_binding": f"{reads[1]}, back by layer {reads[2]}'s backward",
        "floor_gb": floor[0],
        "floor_binding": floor[1],
        "droppable_gb": sum(max(0, p.saved_bytes - p.input_bytes) for p in profiles) / GB,
        "write_GBps": w,
        "read_GBps": r,
        "cost_s_per_gb": cost_s_per_byte * GB,
    }


def timeline_extra_s(tl: dict[str, Any], budget_gb: float) -> float:
    """The least time ``X`` any plan under ``budget_gb`` adds to no offload's step by :func:`timeline_bound`'s
    constraints (``inf`` below its ``floor_gb``). With ``D`` bytes dropped, ``X`` is the largest of ``c D``
    plus the forward's stall ``(A_f - B - D) / w``, ``(A_b - B - D) / w``, ``(Q - B - D) / r`` and 0: a maximum
    of lines in ``D``, whose least value over ``0 <= D <= droppable`` lies at an end or where two lines meet."""
    if budget_gb < tl["floor_gb"]:
        return float("inf")
    c, w, r, dmax = tl["cost_s_per_gb"], tl["write_GBps"], tl["read_GBps"], tl["droppable_gb"]
    af, ab, q = (tl[k] - budget_gb for k in ("write_need_gb", "backward_write_need_gb", "read_need_gb"))
    lo = max([0.0] + [need for need, rate in ((af, w), (ab, w), (q, r)) if rate <= 0])  # no rate: drop it all
    if lo > dmax:
        return float("inf")
    # (slope, intercept) of each line; a rate of zero leaves its need to the dropped bytes (lo above)
    lines = [(c, 0.0), (0.0, 0.0)]
    if w > 0:
        lines += [(c - 1 / w, af / w), (-1 / w, ab / w)]
    if r > 0:
        lines.append((-1 / r, q / r))
    ds = [lo, dmax] + [
        (b2 - b1) / (s1 - s2) for i, (s1, b1) in enumerate(lines) for s2, b2 in lines[i + 1 :] if s1 != s2
    ]
    return min(max(s * d + b for s, b in lines) for d in ds if lo <= d <= dmax)


def bound_step_s(bound: dict[str, Any], window: str, budget_gb: float) -> float:
    """:func:`lower_bound`'s step time at ``budget_gb`` of activation peak, with its ``window``
    (``"timeline"``: the larger of ``"until_peak"`` and the bound on the profiled memory timeline)."""
    if window == "timeline":
        tl = bound["timeline"]
        return max(
            bound_step_s(bound, "until_peak", budget_gb),
            bound["no_offload_step_s"] + timeline_extra_s(tl, budget_gb),
        )
    c, bw = bound["cost_s_per_gb"][bound["cheapest"]], bound["write_GBps"]
    left_gb = bound["no_offload_peak_gb"] - budget_gb - bound["windows"][window]["movable_gb"]
    return bound["no_offload_step_s"] + c * max(0.0, left_gb) / (1 + c * bw)
