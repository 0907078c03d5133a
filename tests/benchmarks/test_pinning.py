"""benchmarks/bench_pinning.py on the CPU: each way in a process of its own, interleaved rounds, the summary's
medians and spreads, a failed child recorded as such (and the run's exit status says so)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_pinning


def test_quick_run_interleaves_both_ways_and_writes_json_and_png(tmp_path) -> None:
    result = bench_pinning.main(
        ["--quick", "--repeats", "2", "--sizes-gib", "0.03125", "--out", str(tmp_path)]
    )
    rows = result["rows"]
    assert [(r["round"], r["way"]) for r in rows] == [
        (0, "pin_memory"), (0, "in_place"), (1, "in_place"), (1, "pin_memory")
    ]  # fmt: skip
    for r in rows:
        assert "error" not in r and r["pinned"] is False  # no GPU: nothing is pinned, and the row says so
        assert r["pin_s"] > 0 and r["worst_iter_s"] > 0 and r["iters_during"] >= 1
        assert r["d2h_gbps"] > 0 and r["h2d_gbps"] > 0
    s = result["summary"]["0.03125"]
    for way in bench_pinning.WAYS:
        runs = sorted(r["pin_s"] for r in rows if r["way"] == way)
        assert s[way]["pin_s_runs"] == runs and s[way]["pin_s"] == pytest.approx(sum(runs) / 2)
    assert s["pin_memory_vs_in_place"] == pytest.approx(s["pin_memory"]["pin_s"] / s["in_place"]["pin_s"])
    on_disk = json.loads((tmp_path / "bench_pinning.json").read_text())
    assert on_disk["summary"] == json.loads(json.dumps(result["summary"]))
    assert (tmp_path / "bench_pinning.png").stat().st_size > 0


def test_a_size_the_host_cannot_hold_is_a_failed_row_and_a_failed_run(tmp_path) -> None:
    with pytest.raises(SystemExit, match="2 run"):
        bench_pinning.main(["--quick", "--repeats", "1", "--sizes-gib", "100000", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_pinning.json").read_text())["rows"]
    assert len(rows) == 2 and all("HostMemoryError" in r["error"] for r in rows)
    assert json.loads((tmp_path / "bench_pinning.json").read_text())["summary"] == {}
