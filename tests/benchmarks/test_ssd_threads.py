"""benchmarks/bench_ssd_threads.py on the CPU: real files, every way that runs here, and its summary."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_ssd_threads


def test_each_way_and_thread_count_is_timed_and_summarized(tmp_path) -> None:
    out = bench_ssd_threads.main(["--quick", "--mb", "8", "--threads", "1", "3", "--repeats", "2", "--dir",
                                  str(tmp_path), "--out", str(tmp_path)])  # fmt: skip
    rows = out["rows"]
    assert not any("error" in r for r in rows) and all(r["write_GBps"] > 0 < r["read_GBps"] for r in rows)
    # the probe once a round, the others at each count; the ways in alternate order
    assert [(r["way"], r["threads"]) for r in rows if r["round"] == 0][:1] == [("probe", 1)]
    assert [(r["way"], r["threads"]) for r in rows if r["round"] == 1][-1] == ("probe", 1)
    summary = out["summary"]
    assert {"probe@1", "posix@1", "posix@3"} <= set(summary)
    three = [r["read_GBps"] for r in rows if (r["way"], r["threads"]) == ("posix", 3)]
    assert summary["posix@3"]["read_range"] == [min(three), max(three)] and summary["posix@3"]["runs"] == 2
    assert summary["posix@3"]["read_vs_one_thread"] == pytest.approx(
        summary["posix@3"]["read_GBps"] / summary["posix@1"]["read_GBps"]
    )
    saved = json.loads((tmp_path / "bench_ssd_threads.json").read_text())
    assert saved["summary"] == summary and (tmp_path / "bench_ssd_threads.png").stat().st_size > 0
    # the drive's file goes with its directory: only the results are left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_ssd_threads.json", "bench_ssd_threads.png"]
    # the thread counts in alternate order, as the ways
    assert [r["threads"] for r in rows if r["round"] == 1 and r["way"] == "posix"] == [3, 1]


def test_bad_sizes_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        bench_ssd_threads.main(["--quick", "--mb", "6"])
    assert "multiple of 4" in capsys.readouterr().err
