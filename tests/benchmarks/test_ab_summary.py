"""benchmarks/ab_summary.py: each variant's run is compared with its own round's no-offload run."""

from __future__ import annotations

import random
from pathlib import Path

from benchmarks import ab_summary
from benchmarks._common import write_section


def _write(d: Path, name: str, step: float, config: str = "dsx_auto_hide") -> None:
    res = {"config": config, "step_s": step, "event_wait": "spin",
           "telemetry": {"written_gb_per_measured_step": [4.8], "gpu_wait_by_measured_step": [{"unpack": 0.0}]}}  # fmt: skip
    write_section({"env": {"device": "test"}, "results": [res]}, d, "bench_offload", name)


def test_runs_pair_with_their_own_round(tmp_path):
    rng = random.Random(5)
    want = {}
    for rnd in (1, 2, 3):
        base = rng.uniform(0.24, 0.27)
        _write(tmp_path, f"bench_x_none_{rnd}", base, config="none")
        for v in ("spin", "poll"):
            step = base / rng.uniform(0.9, 1.0)
            _write(tmp_path, f"bench_x_{v}_{rnd}", step)
            want[(v, rnd)] = base / step
    _write(tmp_path, "bench_x_spin_4", 0.3)  # a round without its no-offload run: left out
    _write(tmp_path, "bench_x_y_none_1", 0.2, config="none")  # another stage whose prefix extends this one
    _write(tmp_path, "bench_x_y_spin_1", 0.3)
    write_section({"env": {}, "results": [{"error": "OOM"}]}, tmp_path, "bench_offload", "bench_x_poll_5")
    rows = ab_summary.collect(tmp_path, "bench_x")
    assert {(r["variant"], r["round"]): r["ratio_vs_none"] for r in rows} == want
    out = ab_summary.main(["--out", str(tmp_path), "--name", "s", "--target", "0.95", "bench_x"])
    assert out["at_or_above_target"] == sum(v >= 0.95 for v in want.values())
    for variant in ("spin", "poll"):
        ratios = [r for (v, _), r in want.items() if v == variant]
        assert out["at_or_above_target_by_variant"][variant] == [sum(r >= 0.95 for r in ratios), len(ratios)]
    assert (tmp_path / "s.json").exists() and (tmp_path / "s.png").exists()
