"""The planner's frontier on measured profiles: its best step time at each activation budget.

Reads a section of ``bench_offload.json`` from a GPU run, takes the per-layer profiles and the tier bandwidths
that run's dsx ``auto`` config measured, and asks the planner (``dsx.offload.plan.make_plan``) for its best plan at each
budget from the lowest any plan reaches up to keeping everything, once with the tiers the run had and once
with none (keep / recompute / selective recompute only: what offload adds is the gap between the two). The
PNG draws both frontiers with the measured points of the same run (no offload, full recompute,
``save_on_cpu``, the dsx configs).

The frontier is the cost model's prediction on measured inputs, not a measurement. The model's step covers
the layers' forward and backward only; the rest of the step (embedding, head, loss, optimizer: the same in
every plan) is taken as the measured no-offload step less the model's keep-everything step and added to every
predicted time (``predicted_step_with_rest_s``), so that the model's full-recompute step can be set beside the
measured one (``predicted_recompute_step_s``) and ratios read against the measurements. The question it
answers: how far from a target the best plan the model knows lands, and what budget would reach it.

Beside it, :func:`dsx.offload.plan.lower_bound`: a step time that no plan of per-layer and per-module keep /
move / recompute choices beats at each budget, from the run's measurements alone (its no-offload row, the
profiles' times and recompute costs, the tiers' write rates), every other assumption in the plan's favour; the
PNG draws it, and no measured point may lie under it.

    python benchmarks/plan_frontier.py benchmarks/results/bench_offload.json --section h2048 --out /tmp/frontier

Each run's frontier is the section of the same name in ``<out>/plan_frontier.json`` (the others kept), and
``plan_frontier.png`` draws every section, a panel each.

``--input-mib``: what a recomputed layer keeps to start from (its input hidden state: micro-batch x sequence
x hidden x 2 bytes in bf16, 64 MiB at 8 x 2048 x 2048), for profiles taken before dsx profiled it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    add_common_args,
    environment,
    is_peer,
    read_sections,
    save_sections_png,
    section_name,
    write_section,
)
from _common import median_runs as _medians

from dsx.config import ActivationOffloadConfig
from dsx.offload.plan import (
    LayerProfile,
    PlanError,
    TierBandwidth,
    bound_step_s,
    floor_bytes,
    lower_bound,
    make_plan,
)

GB = 1e9  # the unit bench_offload reports memory in


def median_runs(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """:func:`_common.median_runs` of the runs that trained and measured a peak."""
    return _medians([r for r in results if "error" not in r and r.get("activation_peak_gb", 0) > 0])


def read_run(path: str, section: str | None) -> tuple[str, dict[str, Any]]:
    """The section of the ``bench_offload`` file at ``path`` named ``section`` (its name and content); with no
    name, the file's only section. Stops, naming the sections there are, where that is not one."""
    f = Path(path)
    sections = read_sections(f.parent, f.stem, "give a bench_offload.json") if f.suffix == ".json" else {}
    if not sections:
        raise SystemExit(f"{path}: no bench_offload result there (a .json file that bench_offload.py wrote)")
    if section is None and len(sections) == 1:
        section = next(iter(sections))
    if section not in sections:
        raise SystemExit(f"{path}: give --section, one of {', '.join(sections)}" if section is None else
                         f"{path}: no section {section!r}; it has {', '.join(sections)}")  # fmt: skip
    return section, sections[section]


def load_run(
    path: str, config: str | None, section: str | None = None
) -> tuple[dict[str, Any], list[LayerProfile], list[TierBandwidth]]:
    """The run (``section`` of the file at ``path``), the profiles and bandwidths of ``config``, or of its first
    dsx config with a profiled plan, preferring one whose profiles measured ``recompute_modules`` (they hold
    every choice a plan has, so that a bound from them holds for every config of the run)."""
    section, run = read_run(path, section)
    return run, *_profiles(run, config, f"{path}, section {section}")


def _profiles(
    run: dict[str, Any], config: str | None, where: str
) -> tuple[list[LayerProfile], list[TierBandwidth]]:
    """:func:`load_run`'s profiles and bandwidths of the run ``run``, read from ``where``."""
    fields = {f.name for f in dataclasses.fields(LayerProfile)}
    # a repeated config: the run its measured figures come from
    rows = list(median_runs(run["results"]).values())
    if config is None:  # (stable: the first of each kind)
        rows.sort(key=lambda r: not any(p.get("sel_saved_bytes") is not None
                                        for p in (r.get("plan") or {}).get("profiles") or []))  # fmt: skip
    for r in rows:
        plan = r.get("plan") or {}
        if plan.get("profiles") and (config is None or r["config"] == config):
            profiles = [LayerProfile(**{k: v for k, v in p.items() if k in fields}) for p in plan["profiles"]]
            tiers = plan["bound"]["tiers"]
            return profiles, [TierBandwidth(t, v["write_Bps"], v["read_Bps"]) for t, v in tiers.items()]
    raise SystemExit(
        f"{where}: no result{f' {config!r}' if config else ''} with a profiled plan (a GPU run of auto)"
    )


def _auto_config(tiers: list[str], pool_gb: float) -> ActivationOffloadConfig:
    """Policy ``auto`` over ``tiers`` (the host tier's settings where there are none), each of ``pool_gb``."""
    return ActivationOffloadConfig(
        tiers=tiers or ["host"], policy="auto", host_pool_gb=pool_gb, ssd_capacity_gb=pool_gb
    )


def _budget_gib(nbytes: float) -> float:
    """``memory_budget_gb`` (GiB) for a budget of ``nbytes``; a hair over, so that a plan at exactly that peak
    fits."""
    return nbytes / 2**30 + 1e-9


def frontier(
    profiles: list[LayerProfile],
    bandwidths: list[TierBandwidth],
    tiers: list[str],
    points: int,
    also_gb: list[float] = (),
    pool_gb: float = 4.0,
) -> list[dict[str, Any]]:
    """Best plan at ``points`` budgets from the floor to keeping everything (denser near the floor, where
    the targets are) and at ``also_gb``, with ``tiers`` (may be empty) of ``pool_gb`` each (the run's
    ``host_pool_gb`` and ``ssd_capacity_gb``: plans stay within them)."""
    cfg = _auto_config(tiers, pool_gb)
    bws = bandwidths if tiers else []
    lo = floor_bytes(profiles, bws, cfg)
    hi = make_plan(profiles, bws, cfg.model_copy(update={"policy": "none"})).peak_bytes
    grid = [lo + (hi - lo) * (k / (points - 1)) ** 2 for k in range(points)]
    out = []
    for budget in sorted({*grid, *(g * GB for g in also_gb if lo <= g * GB <= hi)}):
        try:
            plan = make_plan(profiles, bws, cfg.model_copy(update={"memory_budget_gb": _budget_gib(budget)}))
        except PlanError:
            continue
        out.append({"budget_gb": budget / GB, "predicted_step_s": plan.predicted_step_s,
                    "predicted_peak_gb": plan.peak_bytes / GB, "actions": [a.value for a in plan.actions],
                    "move_bytes": plan.bound["planned_bytes"]})  # fmt: skip
    return out


def exhaustive(
    profiles: list[LayerProfile],
    bandwidths: list[TierBandwidth],
    tiers: list[str],
    pool_gb: float,
    peak_gb: float,
    depths: list[int],
    rest_s: float = 0.0,
) -> dict[str, Any]:
    """The cost model's best whole-layer plan within ``peak_gb`` over every assignment of actions to layers (the
    planner's exhaustive search, up to 10^7 plans a depth) at each prefetch depth in ``depths``, with ``tiers``:
    what the planner's local search, which the runtime uses, is checked against. ``step_with_rest_s`` adds
    ``rest_s``, the step outside the layers; ``exhaustive`` is False where some depth had more plans than that
    and fell back to the local search."""
    cfg = _auto_config(tiers, pool_gb).model_copy(update={"memory_budget_gb": _budget_gib(peak_gb * GB)})
    bandwidths = [b for b in bandwidths if b.tier in cfg.tiers]
    found = []
    for d in depths:
        try:
            found.append(
                make_plan(
                    profiles, bandwidths, cfg.model_copy(update={"prefetch_depth": d}), exhaustive_limit=10**7
                )
            )
        except PlanError:
            continue
    if not found:
        return {"depths": depths, "tiers": cfg.tiers, "step_with_rest_s": float("nan"), "fits": False}
    best = min(found, key=lambda plan: plan.predicted_step_s)
    return {"depths": depths, "tiers": cfg.tiers, "fits": True,
            "exhaustive": all(plan.search == "exhaustive" for plan in found), "step_s": best.predicted_step_s,
            "step_with_rest_s": best.predicted_step_s + rest_s, "actions": [a.value for a in best.actions],
            "prefetch_depth": best.prefetch_depth, "peak_gb": best.peak_bytes / GB}  # fmt: skip


def best_within(front: list[dict[str, Any]], peak_gb: float) -> dict[str, Any] | None:
    fits = [f for f in front if f["predicted_peak_gb"] <= peak_gb]
    return min(fits, key=lambda f: f["predicted_step_s"]) if fits else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("run", help="a bench_offload JSON with a dsx auto result (GPU run)")
    p.add_argument("--section", default=None, type=section_name,
                   help="the run's section of that file (default: its only one); the frontier is the section "
                        "of that name in <out>/<name>.json")  # fmt: skip
    p.add_argument("--config", default=None, help="the result whose profiles to use (default: the first)")
    p.add_argument("--input-mib", type=float, default=0.0,
                   help="a recomputed layer's input, where the profiles lack input_bytes")  # fmt: skip
    p.add_argument("--points", type=int, default=12)
    p.add_argument("--speedup", type=float, default=1.15,
                   help="the speed-up over full recompute at its peak whose budget and bound are reported")  # fmt: skip
    p.add_argument("--name", default="plan_frontier", help="the result file, <out>/<name>.json and .png")
    p.add_argument("--exhaustive-depths", type=int, nargs="+", default=None, metavar="D",
                   help="also try every whole-layer plan (up to 10^7 a depth) at full recompute's measured peak, at "
                        "these prefetch depths: the cost model's best there, beside the planner's local search "
                        "(about 2 minutes a depth for 8 layers of 6 choices: one tier)")  # fmt: skip
    p.add_argument("--exhaustive-tiers", nargs="+", default=None, metavar="TIER",
                   help="--exhaustive-depths: the tiers its plans may use (default: the run's; each tier adds "
                        "three choices a layer)")  # fmt: skip
    add_common_args(p)
    args = p.parse_args(argv)
    if args.quick:
        args.points = 4
    read_sections(args.out, args.name)  # a file whose sections cannot be kept stops the run before its work
    section, run = read_run(args.run, args.section)
    source = f"{Path(args.run).name}, section {section}"
    profiles, bandwidths = _profiles(run, args.config, source)
    for prof in profiles:
        if not prof.input_bytes:
            prof.input_bytes = int(args.input_mib * 2**20)
    tiers = [b.tier for b in bandwidths]
    measured = median_runs(run["results"])
    also = [measured[b]["activation_peak_gb"] for b in ("recompute", "save_on_cpu") if b in measured]
    # the run's pool: bench_offload's --pool-gb (runs from before that option used the default, 4)
    pool = float(run.get("config", {}).get("pool_gb") or 4.0)
    fronts = {"offload": frontier(profiles, bandwidths, tiers, args.points, also, pool),
              "recompute_only": frontier(profiles, bandwidths, [], args.points, also, pool)}  # fmt: skip
    # the model's step covers the layers' forward and backward, not the embedding, head, loss and optimizer:
    # add what the measured no-offload step spends beyond the model's keep-all step, the same in every plan
    keep_model = make_plan(profiles, [], ActivationOffloadConfig(policy="none"))
    rc_model = make_plan(profiles, [], ActivationOffloadConfig(policy="recompute_all"))
    rest = measured["none"]["step_s"] - keep_model.predicted_step_s if "none" in measured else 0.0
    for front in fronts.values():
        for f in front:
            f["predicted_step_with_rest_s"] = f["predicted_step_s"] + rest
    targets: dict[str, Any] = {
        "rest_of_step_s": rest,
        "predicted_keep_all_step_s": keep_model.predicted_step_s + rest,
        "predicted_recompute_step_s": rc_model.predicted_step_s + rest,
    }
    for base in ("recompute", "save_on_cpu"):
        if base not in measured:
            continue
        peak = measured[base]["activation_peak_gb"]
        best = best_within(fronts["offload"], peak)
        only = best_within(fronts["recompute_only"], peak)
        targets[f"at_{base}_peak"] = {
            "measured_peak_gb": peak,
            "measured_step_s": measured[base]["step_s"],
            "predicted_best_step_s": best and best["predicted_step_with_rest_s"],
            "predicted_best_actions": best and best["actions"],
            "predicted_best_recompute_only_step_s": only and only["predicted_step_with_rest_s"],
            f"measured_{base}_over_predicted_best": best and measured[base]["step_s"] / best["predicted_step_with_rest_s"],
        }  # fmt: skip
    if args.exhaustive_depths and "recompute" in measured:
        targets["at_recompute_peak"]["exhaustive"] = exhaustive(
            profiles,
            bandwidths,
            args.exhaustive_tiers or tiers,
            pool,
            measured["recompute"]["activation_peak_gb"],
            args.exhaustive_depths,
            rest,
        )
    if "recompute" in measured:
        goal = measured["recompute"]["step_s"] / args.speedup
        reach = [f for f in fronts["offload"] if f["predicted_step_with_rest_s"] <= goal]
        targets["budget_for_speedup_over_recompute_gb"] = min((f["budget_gb"] for f in reach), default=None)
    bound = lower_bound(measured, profiles, bandwidths, speedup=args.speedup)
    if bound is not None:
        targets["lower_bound"] = {**bound, "windows": {k: {n: v for n, v in w.items() if n != "curve"}
                                                       for k, w in bound["windows"].items()}}  # fmt: skip
    points = {
        k: {"activation_peak_gb": r["activation_peak_gb"], "step_s": r["step_s"]} for k, r in measured.items()
    }
    if bound is not None:
        targets["against_bound_and_peers"] = against(points, bound, fronts["offload"])
    out = {"name": "plan_frontier", "env": environment(), "config": vars(args),
           "source": source,
           "source_env": run.get("env"), "kind": "cost-model prediction on measured profiles",
           "frontiers": fronts, "targets": targets, "lower_bound": bound,
           "measured": points}  # fmt: skip
    _, sections = write_section(out, args.out, args.name, section)
    save_sections_png(sections, _draw, args.out, args.name, size=(14.0, 5.5))
    print(json.dumps(targets, indent=1))
    return out


def against(
    points: dict[str, dict[str, float]], bound: dict[str, Any], front: list[dict[str, Any]]
) -> dict[str, Any]:
    """Each dsx point's step over the lower bound at its measured peak (``timeline``; None, and
    ``below_bound_floor``, where no plan could reach that peak by the bound: the bound would be wrong) and over the
    planner's own best prediction within that peak (``front``: the frontier with the run's tiers), and the
    peers (configs not named ``dsx*``; not ``none_copies``, a diagnostic that moves bytes without freeing any)
    that peak at the same or less memory and step faster: the points that show dsx's curve not dominating.
    ``worst_over_bound``: the largest such ratio; both summaries are None without a dsx point."""
    per: dict[str, Any] = {}
    peers = {p: q for p, q in points.items() if is_peer(p)}
    for cfg, r in points.items():
        if not cfg.startswith("dsx"):
            continue
        at = bound_step_s(bound, "timeline", r["activation_peak_gb"])
        faster = sorted(p for p, q in peers.items()
                        if q["activation_peak_gb"] <= r["activation_peak_gb"] and q["step_s"] < r["step_s"])  # fmt: skip
        best = best_within(front, r["activation_peak_gb"])
        planned = best["predicted_step_with_rest_s"] if best else None
        finite = at != float("inf")
        per[cfg] = {"bound_step_s": at if finite else None, "over_bound": r["step_s"] / at if finite else None,
                    "below_bound_floor": not finite, "planner_best_step_s": planned,
                    "over_planner_best": r["step_s"] / planned if planned else None,
                    "planner_best_over_bound": planned / at if planned and finite else None,
                    "faster_peers_at_or_below": faster}  # fmt: skip
    return {
        "per_config": per,
        "worst_over_bound": max((v["over_bound"] for v in per.values() if v["over_bound"]), default=None),
        "below_bound_floor": sorted(c for c, v in per.items() if v["below_bound_floor"]),
        "dominates_every_peer": all(not v["faster_peers_at_or_below"] for v in per.values()) if per else None,
    }


def _draw(panel: Any, section: str, out: dict[str, Any]) -> None:
    """One section's panel, two plots: every point on a log scale, and the targets' region (no offload to 1.3x
    recompute) on a linear one, where the frontiers, the bounds and the speed-up's line are a few ms apart."""
    axes = panel.subplots(1, 2)
    # (the profiles' recompute_modules, where measured, are choices of both frontiers: the +sel forms)
    styles = {"offload": ("tab:blue", "planner, with the run's tiers (+ rest of step; +sel where profiled)"),
              "recompute_only": ("tab:orange", "planner, keep / recompute only (+ rest of step; +sel where profiled)")}  # fmt: skip
    bound_styles = {"timeline": ("-", "lower bound, per-layer / per-module plans (the profiled memory timeline)"),
                    "until_peak": ("-.", "the same, one peak and every write until it (aggregate)"),
                    "forward": (":", "the same with the design's hideable bytes (bandwidth x forward time)")}  # fmt: skip
    rc, none = out["measured"].get("recompute"), out["measured"].get("none")
    for ax in axes:
        for key, front in out["frontiers"].items():
            colour, label = styles[key]
            xs = [f["predicted_peak_gb"] for f in front]
            ys = [f["predicted_step_with_rest_s"] * 1e3 for f in front]
            ax.step(xs, ys, where="post", color=colour, label=label)
        for key, w in ((out.get("lower_bound") or {}).get("windows") or {}).items():
            ls, label = bound_styles[key]
            ax.plot([c["budget_gb"] for c in w["curve"]], [c["step_s"] * 1e3 for c in w["curve"]],
                    color="black", ls=ls, lw=1, label=label)  # fmt: skip
        # dsx at the budgets of a sweep (config@<scale>x), one curve per config
        sweeps: dict[str, list[tuple[float, float]]] = {}
        for c, r in out["measured"].items():
            if c.startswith("dsx_auto_budget"):
                sweeps.setdefault(c.split("@")[0], []).append((r["activation_peak_gb"], r["step_s"] * 1e3))
        for base, pts in sweeps.items():
            if len(pts) > 1:
                ax.plot(
                    *zip(*sorted(pts)), color="tab:green", lw=1, label=f"{base}, measured over the budgets"
                )
        for cfg, r in out["measured"].items():
            dsx_cfg = cfg.startswith("dsx")
            ax.scatter(r["activation_peak_gb"], r["step_s"] * 1e3, color="tab:green" if dsx_cfg else "tab:gray",
                       marker="o" if dsx_cfg else "s", zorder=3)  # fmt: skip
            ax.annotate(cfg, (r["activation_peak_gb"], r["step_s"] * 1e3), fontsize=7, xytext=(4, 3),
                        textcoords="offset points", annotation_clip=True)  # fmt: skip
        speedup = out["config"]["speedup"]
        if rc:  # the speed-up asked for at recompute's budget
            ax.axhline(rc["step_s"] * 1e3 / speedup, color="tab:red", ls="--", lw=0.8,
                       label=f"{speedup:g}x full recompute's throughput (measured / {speedup:g})")  # fmt: skip
            ax.axvline(rc["activation_peak_gb"], color="tab:gray", ls=":", lw=0.8)
        ax.set_xlabel("activation peak (GB)")
        ax.set_ylabel("step time (ms)")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    axes[0].set_title("every point", fontsize=9)
    if rc and none:
        axes[1].set_ylim(none["step_s"] * 1e3 * 0.95, rc["step_s"] * 1e3 * 1.3)
        axes[1].set_xlim(0, none["activation_peak_gb"] * 1.05)
    axes[1].set_title("the targets' region", fontsize=9)
    src = out["source_env"] or {}
    panel.suptitle(f"{section}: planner frontier and lower bound on profiles measured on "
                   f"{src.get('device', '?')} ({out['source']})", fontsize=10)  # fmt: skip


if __name__ == "__main__":
    main()
