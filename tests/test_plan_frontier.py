"""benchmarks/plan_frontier.py: the planner's frontier over budgets, on a run file like bench_offload's."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

from benchmarks import plan_frontier
from dsx.offload.plan import LayerProfile, TierBandwidth

GiB = 1 << 30


def _run_file(tmp_path, n: int = 4, pool_gb: float | None = None) -> str:
    rng = random.Random(5)
    profiles = []
    for i in range(n):
        saved = rng.randint(4, 16) << 26
        p = LayerProfile(i, f"L{i}", saved, rng.uniform(0.004, 0.02), rng.uniform(0.008, 0.04),
                         sel_saved_bytes=saved // 4, sel_recompute_s=0.002, fwd_peak_bytes=saved + (1 << 26),
                         bwd_workspace_bytes=1 << 27, bwd_background_bytes=1 << 27,
                         gap_background_bytes=(4 << 30) if i == n - 1 else 1 << 28)  # fmt: skip
        profiles.append(vars(p))
    tiers = {"host": {"write_Bps": 20e9, "read_Bps": 20e9}, "ssd": {"write_Bps": 2e9, "read_Bps": 2e9}}
    plan = {"profiles": profiles, "bound": {"tiers": tiers}}
    rc_peak = (4 << 30) * 1.2 / 1e9
    results = [
        {"config": "none", "step_s": 0.1, "activation_peak_gb": 3.0},
        {"config": "recompute", "step_s": 0.14, "activation_peak_gb": rc_peak},
        {"config": "save_on_cpu", "step_s": 0.9, "activation_peak_gb": 0.5},
        {"config": "dsx_auto_budget_sel", "step_s": 0.12, "activation_peak_gb": rc_peak, "plan": plan},
        {"config": "dsx_ssd", "error": "timed out"},
    ]
    path = tmp_path / "bench_offload_x.json"
    run = {"env": {"device": "test"}, "results": results}
    if pool_gb is not None:
        run["config"] = {"pool_gb": pool_gb}
    path.write_text(json.dumps(run))
    return str(path)


def test_frontier_plans_within_the_runs_pool(tmp_path) -> None:
    """The frontier's plans stay within the pool the run had (bench_offload's --pool-gb), not the default."""

    def most_moved(pool_gb: float | None) -> int:
        d = tmp_path / str(pool_gb)
        d.mkdir()
        out = plan_frontier.main([_run_file(d, pool_gb=pool_gb), "--points", "6", "--out", str(d)])
        return max(f["move_bytes"] for f in out["frontiers"]["offload"])

    small = 0.125
    assert most_moved(small) <= 2 * small * GiB  # host pool plus SSD quota, each of pool_gb
    assert most_moved(None) > 2 * small * GiB


def test_frontier_is_exact_monotone_and_offload_never_worse(tmp_path) -> None:
    out = plan_frontier.main(
        [_run_file(tmp_path), "--input-mib", "16", "--points", "6", "--out", str(tmp_path)]
    )
    assert (tmp_path / "plan_frontier_bench_offload_x.json").exists()
    assert (tmp_path / "plan_frontier_bench_offload_x.png").stat().st_size > 0
    fronts = out["frontiers"]
    for front in fronts.values():
        assert len(front) >= 4
        budgets = [f["budget_gb"] for f in front]
        assert budgets == sorted(budgets)
        # 4 layers: the planner searches exhaustively, so more budget never predicts a slower step
        steps = [f["predicted_step_s"] for f in front]
        assert all(b <= a + 1e-12 for a, b in itertools.pairwise(steps)), steps
        assert all(f["predicted_peak_gb"] <= f["budget_gb"] + 1e-9 for f in front)
    # offload adds choices: at any budget both frontiers reach, it is never predicted slower
    only = {round(f["budget_gb"], 9): f["predicted_step_s"] for f in fronts["recompute_only"]}
    common = [(f["predicted_step_s"], only[round(f["budget_gb"], 9)]) for f in fronts["offload"]
              if round(f["budget_gb"], 9) in only]  # fmt: skip
    assert common and all(a <= b + 1e-12 for a, b in common)
    # the last layer's gap (head and loss, 4 GiB here) is the floor's point: moving the inputs recomputed
    # layers keep reaches lower than any keep / recompute plan
    assert fronts["offload"][0]["predicted_peak_gb"] < fronts["recompute_only"][0]["predicted_peak_gb"]
    at_rc = out["targets"]["at_recompute_peak"]
    assert at_rc["predicted_best_step_s"] <= out["targets"]["predicted_recompute_step_s"]
    assert "dsx_ssd" not in out["measured"]


def test_best_within_picks_the_fastest_plan_that_fits() -> None:
    front = [{"predicted_peak_gb": 1.0, "predicted_step_s": 3.0}, {"predicted_peak_gb": 2.0, "predicted_step_s": 2.0},
             {"predicted_peak_gb": 3.0, "predicted_step_s": 1.0}]  # fmt: skip
    assert plan_frontier.best_within(front, 2.5)["predicted_step_s"] == 2.0
    assert plan_frontier.best_within(front, 0.5) is None


def test_lower_bound_by_hand() -> None:
    """Two 4 GB layers, 1 GB of each droppable by its recompute_modules at 2 ms (2 ms/GB, the cheapest);
    10 GB/s of writes over a 0.1 s forward: 1 GB movable then. At a 6 GB budget from a 10 GB no-offload peak,
    3 GB must go by other means: recomputed at 2 ms/GB, or moved in time the plan adds (X >= c (3 GB - bw X)):
    X >= 6 ms / 1.02."""
    profiles = [LayerProfile(i, f"L{i}", 4 * 10**9, 0.05, 0.08, sel_saved_bytes=3 * 10**9, sel_recompute_s=0.002,
                             input_bytes=10**8) for i in range(2)]  # fmt: skip
    measured = {"none": {"step_s": 0.2, "activation_peak_gb": 10.0},
                "recompute": {"step_s": 0.3, "activation_peak_gb": 6.0},
                "save_on_cpu": {"step_s": 1.0, "activation_peak_gb": 5.0}}  # fmt: skip
    bw = [TierBandwidth("host", 10e9, 10e9)]
    out = plan_frontier.lower_bound(measured, profiles, bw)
    assert out["cheapest"] == "recompute_modules"
    assert abs(out["cost_s_per_gb"]["layer_forward"] - 0.05 / 3.9) < 1e-12
    # per byte the recomputed layers drop (7.8 GB), not per byte of peak (4 GB)
    assert abs(out["cost_s_per_gb"]["measured_recompute"] - 0.1 / 7.8) < 1e-12
    fwd = out["windows"]["forward"]
    assert abs(fwd["movable_gb"] - 1.0) < 1e-12
    assert abs(fwd["at_recompute_peak"]["step_s"] - (0.2 + 0.006 / 1.02)) < 1e-12
    assert abs(fwd["at_save_on_cpu_peak"]["step_s"] - (0.2 + 0.008 / 1.02)) < 1e-12
    assert abs(plan_frontier.bound_step_s(out, "forward", 9.5) - 0.2) < 1e-12  # nothing left to remove
    # until the peak: the step less the other layer's backward, 0.2 - 0.08 = 0.12 s
    peak = out["windows"]["until_peak"]
    assert abs(peak["movable_gb"] - 1.2) < 1e-12
    assert abs(peak["at_recompute_peak"]["step_s"] - (0.2 + 0.0056 / 1.02)) < 1e-12
    # 1.15x of 0.3 s leaves 60.9 ms: 31 GB recomputable, more than the 4 GB to remove: no window needed
    assert out["window_s_for_1.15x"] == 0.0
    assert plan_frontier.lower_bound({}, profiles, bw) is None


def test_the_closing_runs_measurements_lie_on_or_above_their_lower_bound() -> None:
    """The bound on the committed H100 closing runs (stop 21): no measured strategy is faster than it allows
    at its peak (a bound that a measurement beat would be wrong), and what it says of issue 3's targets."""
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    limits = {}
    for shape in ("h2048", "h4096"):
        run, profiles, bws = plan_frontier.load_run(
            str(results / f"bench_offload_final_{shape}_s21.json"), "dsx_auto_hide_sel"
        )
        measured = {r["config"]: r for r in run["results"] if "error" not in r}
        bound = plan_frontier.lower_bound(measured, profiles, bws)
        for key in bound["windows"]:
            for cfg, r in measured.items():
                floor = plan_frontier.bound_step_s(bound, key, r["activation_peak_gb"])
                assert r["step_s"] >= floor - 1e-12, (shape, key, cfg, r["step_s"], floor)
        w = bound["windows"]["until_peak"]
        limits[shape] = (w["at_recompute_peak"]["max_x_recompute"], w["at_save_on_cpu_peak"]["max_x_save_on_cpu"],
                         bound["window_s_for_1.15x"])  # fmt: skip
    # what issue 3 asks, on this link: 1.15x full recompute at its peak is out of reach at hidden 2048 (it
    # would need no offload's peak 0.2 s into its 0.256 s step); 5x save_on_cpu at its peak at hidden 4096
    assert limits["h2048"][0] < 1.15 and limits["h2048"][2] > 0.19, limits
    assert limits["h4096"][1] < 5, limits
