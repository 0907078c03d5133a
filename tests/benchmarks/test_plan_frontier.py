"""benchmarks/plan_frontier.py: the planner's frontier over budgets, on a run file like bench_offload's."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from benchmarks import plan_frontier
from benchmarks._common import write_section
from dsx.offload.plan import LayerProfile

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
    run = {"env": {"device": "test"}, "results": results}
    if pool_gb is not None:
        run["config"] = {"pool_gb": pool_gb}
    return str(write_section(run, tmp_path, "bench_offload", "x")[0])


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
    saved = json.loads((tmp_path / "plan_frontier.json").read_text())["sections"]
    assert list(saved) == ["x"] and saved["x"]["source"] == "bench_offload.json, section x"
    assert (tmp_path / "plan_frontier.png").stat().st_size > 0
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


def test_against_names_the_peers_that_beat_dsx_at_or_below_its_memory() -> None:
    from dsx.offload.plan import bound_step_s

    rng = random.Random(11)
    bound = {"no_offload_peak_gb": 13.0, "no_offload_step_s": 0.12, "write_GBps": 50.0,
             "cost_s_per_gb": {"recompute": rng.uniform(2e-3, 4e-3)}, "cheapest": "recompute",
             "windows": {"until_peak": {"movable_gb": rng.uniform(1.0, 3.0)}},
             "timeline": {"floor_gb": 3.5, "cost_s_per_gb": 3e-3, "write_GBps": 50.0, "read_GBps": 50.0,
                          "droppable_gb": 10.0, "write_need_gb": 15.0, "backward_write_need_gb": 14.0,
                          "read_need_gb": 12.0}}  # fmt: skip
    points = {
        "none": {"activation_peak_gb": 13.0, "step_s": 0.120},
        "peer_low": {"activation_peak_gb": 9.0, "step_s": 0.130},  # less memory and faster than dsx_mid
        "peer_high": {"activation_peak_gb": 12.0, "step_s": 0.100},  # faster, but above dsx_mid's memory
        "peer_equal": {"activation_peak_gb": 4.0, "step_s": 0.149},  # dsx_low's memory, a little faster
        "none_copies": {"activation_peak_gb": 3.0, "step_s": 0.121},  # a diagnostic, not a peer
        "dsx_mid": {"activation_peak_gb": 10.0, "step_s": 0.140},
        "dsx_low": {"activation_peak_gb": 4.0, "step_s": 0.150},
    }
    front = [{"predicted_peak_gb": 3.9, "predicted_step_s": 0.150, "predicted_step_with_rest_s": 0.160},
             {"predicted_peak_gb": 9.5, "predicted_step_s": 0.125, "predicted_step_with_rest_s": 0.135}]  # fmt: skip
    out = plan_frontier.against(points, bound, front)
    per = out["per_config"]
    assert set(per) == {"dsx_mid", "dsx_low"}
    assert per["dsx_mid"]["faster_peers_at_or_below"] == ["peer_low"]
    assert per["dsx_low"]["faster_peers_at_or_below"] == ["peer_equal"]
    assert not out["dominates_every_peer"]
    for cfg, v in per.items():
        at = bound_step_s(bound, "timeline", points[cfg]["activation_peak_gb"])
        assert at > bound_step_s(
            bound, "until_peak", points[cfg]["activation_peak_gb"]
        )  # (the timeline binds)
        assert v["over_bound"] == points[cfg]["step_s"] / at and not v["below_bound_floor"]
    assert per["dsx_mid"]["planner_best_step_s"] == 0.135 and per["dsx_low"]["planner_best_step_s"] == 0.160
    assert per["dsx_mid"]["over_planner_best"] == 0.140 / 0.135
    assert per["dsx_low"]["planner_best_over_bound"] == 0.160 / per["dsx_low"]["bound_step_s"]
    assert out["worst_over_bound"] == max(v["over_bound"] for v in per.values())
    # a dsx point below the bound's floor (no plan reaches that peak, by the bound): flagged, not a ratio of 0
    floor = plan_frontier.against(
        {**points, "dsx_floor": {"activation_peak_gb": 3.0, "step_s": 0.2}}, bound, front
    )
    assert (
        floor["below_bound_floor"] == ["dsx_floor"] and floor["per_config"]["dsx_floor"]["over_bound"] is None
    )
    assert floor["worst_over_bound"] == out["worst_over_bound"]
    points["peer_low"]["step_s"] = 0.145  # now slower than dsx_mid, and peer_equal than dsx_low
    points["peer_equal"]["step_s"] = 0.150
    assert plan_frontier.against(points, bound, front)["dominates_every_peer"] is True
    no_dsx = plan_frontier.against({k: v for k, v in points.items() if not k.startswith("dsx")}, bound, front)
    assert no_dsx["dominates_every_peer"] is None and no_dsx["worst_over_bound"] is None


def test_repeated_configs_are_read_at_their_median_run() -> None:
    steps = [0.31, 0.29, 0.35]
    runs = [{"config": "none", "step_s": 0.2, "activation_peak_gb": 3.0}]
    runs += [
        {"config": "dsx_auto_budget", "step_s": t, "activation_peak_gb": 2.0, "round": i}
        for i, t in enumerate(steps)
    ]
    runs += [
        {"config": "recompute", "error": "out of memory"},
        {"config": "recompute", "step_s": 0.4, "activation_peak_gb": 0},
    ]
    got = plan_frontier.median_runs(runs)
    assert set(got) == {"none", "dsx_auto_budget"} and got["dsx_auto_budget"]["round"] == 0
    runs.append({"config": "dsx_auto_budget", "step_s": 0.30, "activation_peak_gb": 2.0, "round": 3})
    assert plan_frontier.median_runs(runs)["dsx_auto_budget"]["round"] == 3  # the lower middle of four


def test_without_a_config_the_profiles_with_every_choice_are_read(tmp_path) -> None:
    """A run with a dsx config profiled without ``recompute_modules`` before one profiled with them: the bound
    and frontier are computed from the latter, whose profiles hold every choice a plan of the run has."""
    path = _run_file(tmp_path)
    run = json.loads(Path(path).read_text())["sections"]["x"]
    sel = next(r for r in run["results"] if r["config"] == "dsx_auto_budget_sel")
    plain = {**sel, "config": "dsx_auto_budget", "plan": {**sel["plan"], "profiles": [
        {**p, "sel_saved_bytes": None, "sel_recompute_s": 0.0} for p in sel["plan"]["profiles"]]}}  # fmt: skip
    run["results"].insert(0, plain)
    write_section(run, tmp_path, "bench_offload", "x")
    _, profiles, _ = plan_frontier.load_run(path, None)
    assert all(p.sel_saved_bytes is not None for p in profiles)
    _, profiles, _ = plan_frontier.load_run(path, "dsx_auto_budget")  # a named config is read as named
    assert all(p.sel_saved_bytes is None for p in profiles)


def test_an_exhaustive_check_at_recompute_peak_matches_the_planners_best(tmp_path) -> None:
    """--exhaustive-depths: every whole-layer plan at full recompute's peak, at the depths given. With every depth
    it is the planner's own best there (4 layers: the planner is exhaustive too), the rest of the step included;
    with one depth it can only be slower or equal."""
    run = _run_file(tmp_path)
    every = plan_frontier.main([run, "--points", "4", "--out", str(tmp_path), "--exhaustive-depths", "1", "2", "3",
                                "4"])["targets"]["at_recompute_peak"]  # fmt: skip
    ex = every["exhaustive"]
    assert ex["fits"] and ex["exhaustive"] and len(ex["actions"]) == 4
    assert ex["peak_gb"] <= every["measured_peak_gb"] + 1e-9 and ex["tiers"] == ["host", "ssd"]
    assert abs(ex["step_with_rest_s"] - every["predicted_best_step_s"]) < 1e-9, (ex, every)
    one = plan_frontier.main([run, "--points", "4", "--out", str(tmp_path), "--exhaustive-depths", "1"])
    assert (
        one["targets"]["at_recompute_peak"]["exhaustive"]["step_with_rest_s"]
        >= ex["step_with_rest_s"] - 1e-12
    )
    host = plan_frontier.main([run, "--points", "4", "--out", str(tmp_path), "--exhaustive-depths", "1",
                               "--exhaustive-tiers", "host"])["targets"]["at_recompute_peak"]["exhaustive"]  # fmt: skip
    assert host["tiers"] == ["host"] and not any("ssd" in a for a in host["actions"])


def test_the_run_is_a_section_of_the_file_named_or_its_only_one(tmp_path, monkeypatch) -> None:
    """One section: read without naming it, and the frontier is the section of the same name. Two: the one
    named; none named, or one the file lacks, stops naming the sections there are; a file of another kind stops
    naming the file."""
    path = _run_file(tmp_path)
    assert plan_frontier.read_run(path, None)[0] == "x"
    run = json.loads(Path(path).read_text())["sections"]["x"]
    write_section({**run, "results": run["results"][:1]}, tmp_path, "bench_offload", "y")
    assert plan_frontier.read_run(path, "y")[1]["results"] == run["results"][:1]
    for section, says in ((None, "give --section, one of x, y"), ("z", "no section 'z'; it has x, y")):
        with pytest.raises(SystemExit, match=says):
            plan_frontier.main(
                [path, "--points", "4", "--out", str(tmp_path)] + (["--section", section] if section else [])
            )
    assert not (tmp_path / "plan_frontier.json").exists()  # nothing written by a refused run
    plan_frontier.main([path, "--section", "x", "--points", "4", "--out", str(tmp_path)])
    assert list(json.loads((tmp_path / "plan_frontier.json").read_text())["sections"]) == ["x"]
    # an output file of another layout stops the run before its work (--exhaustive-depths takes minutes)
    out = tmp_path / "out"
    out.mkdir()
    (out / "plan_frontier.json").write_text("[]")
    monkeypatch.setattr(plan_frontier, "frontier", lambda *a: pytest.fail("the frontier was computed"))
    with pytest.raises(SystemExit, match=r"plan_frontier\.json is not a file of benchmark result sections"):
        plan_frontier.main([path, "--section", "x", "--out", str(out)])
    assert (out / "plan_frontier.json").read_text() == "[]"
    other = tmp_path / "other.json"
    other.write_text('{"results": []}')
    with pytest.raises(SystemExit, match=r"other\.json is not a file of benchmark result sections"):
        plan_frontier.read_run(str(other), None)
