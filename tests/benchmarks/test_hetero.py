"""bench_hetero.py --quick runs on the CPU and writes its JSON + PNG (the real run is on the H100): every dsx
pipeline timed over interleaved repeats, the per-batch preparation share, the learning comparison, and PyG's
pipeline measured or the reason it could not run recorded."""

from __future__ import annotations

import json

from tests.harness import load_example


def test_bench_hetero_quick(tmp_path) -> None:
    mod = load_example("benchmarks/bench_hetero.py")
    mod.main(["--quick", "--models", "rgcn,hgt", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_hetero.json").read_text())
    assert (tmp_path / "bench_hetero.png").stat().st_size > 0
    for model in ("rgcn", "hgt"):
        out = saved["models"][model]
        for name in ("dsx_host", "dsx_gpu"):
            r = out["runs"][name]
            assert len(r["batch_ms_all"]) == 3 and r["batch_ms_min"] <= r["batch_ms"] <= r["batch_ms_max"]
            assert r["epoch_s"] > 0
        assert "pyg_w0" in out["runs"]  # measured, or why PyG could not sample
        assert 0 < out["prep_share_of_batch"]
        learned = out["learning"]["runs"]["dsx_gpu"]
        assert [r["seed"] for r in learned] == [0, 1]  # one run per seed, each from its own weights
        assert all(len(r["losses"]) == 6 and r["val_seeds"] > 0 for r in learned)
        assert out["learning"]["val_acc"]["dsx_gpu"]["all"] == [r["val_acc"] for r in learned]
    # --merge keeps the models this run does not run
    mod.main(["--quick", "--models", "rgat", "--out", str(tmp_path), "--merge", "--learn-steps", "0"])
    merged = json.loads((tmp_path / "bench_hetero.json").read_text())
    assert list(merged["models"]) == ["rgcn", "rgat", "hgt"]
    assert merged["models"]["hgt"] == saved["models"]["hgt"]
