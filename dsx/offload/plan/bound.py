"""A lower bound on the step time of any per-layer plan at each activation budget, from measurements alone.

The planner's frontier (:func:`~dsx.offload.plan.search.make_plan` at each budget) is what its cost model
predicts; this is what no plan of per-layer and per-module keep / move / recompute choices can beat on the
same kernels and links, every assumption not measured taken in the plan's favour. A measured step under it
would mean the bound is wrong; a target under it is out of reach for such plans. ``benchmarks/plan_frontier.py``
draws it beside the frontier.

Its inputs are a benchmark run's rows by config name (``"none"``: no offload, required; ``"recompute"``,
``"save_on_cpu"``, ``"megatron_selective"`` where measured), each with ``step_s`` and ``activation_peak_gb``
(GB of 10^9 bytes, as ``benchmarks/bench_offload.py`` reports them), the layers' profiles and the tiers'
bandwidths.
"""

from __future__ import annotations

from typing import Any

from dsx.offload.plan.types import LayerProfile
from dsx.runtime.bandwidth import TierBandwidth

__all__ = ["bound_step_s", "lower_bound"]

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
    rc, soc = measured.get("recompute"), measured.get("save_on_cpu")
    c, bw = out["cost_s_per_gb"][cheapest], out["write_GBps"]
    if rc is not None:
        added = max(0.0, rc["step_s"] / speedup - t_none)
        removed = out["no_offload_peak_gb"] - rc["activation_peak_gb"]
        out["speedup"] = speedup
        out["window_s_for_speedup"] = max(0.0, removed - added * (1 + c * bw) / c) / bw if bw else None
    for key, w in out["windows"].items():
        w["curve"] = [{"budget_gb": g, "step_s": bound_step_s(out, key, g)}
                      for g in (out["no_offload_peak_gb"] * k / 40 for k in range(41))]  # fmt: skip
        if rc is not None:
            t = bound_step_s(out, key, rc["activation_peak_gb"])
            w["at_recompute_peak"] = {"step_s": t, "max_x_recompute": rc["step_s"] / t}
        if soc is not None:
            t = bound_step_s(out, key, soc["activation_peak_gb"])
            w["at_save_on_cpu_peak"] = {"step_s": t, "max_x_save_on_cpu": soc["step_s"] / t}
    return out


def bound_step_s(bound: dict[str, Any], window: str, budget_gb: float) -> float:
    """:func:`lower_bound`'s step time at ``budget_gb`` of activation peak, with its ``window``."""
    c, bw = bound["cost_s_per_gb"][bound["cheapest"]], bound["write_GBps"]
    left_gb = bound["no_offload_peak_gb"] - budget_gb - bound["windows"][window]["movable_gb"]
    return bound["no_offload_step_s"] + c * max(0.0, left_gb) / (1 + c * bw)
