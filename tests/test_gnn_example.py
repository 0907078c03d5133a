"""The GraphSAGE example trains on 2 CPU ranks through the deepspeed launcher (gloo): accuracy rises."""

from __future__ import annotations

import json

import pytest

from tests.harness import REPO, launch


@pytest.mark.slow
def test_train_sage_two_ranks_gloo(tmp_path):
    log = tmp_path / "sage.json"
    res = launch(
        REPO / "examples" / "gnn" / "train_sage.py",
        ["--deepspeed_config", str(REPO / "configs" / "gnn_sage.json"), "--nodes", "6000", "--edges", "60000",
         "--features", "16", "--fanouts", "10,5", "--epochs", "3", "--no-progress", "--log-json", str(log)],
        nprocs=2, timeout=300,
    )  # fmt: skip
    res.check()
    s = json.loads(log.read_text())
    assert s["world_size"] == 2
    h = s["history"]
    assert h[-1]["train_acc"] > h[0]["train_acc"] and h[-1]["loss"] < h[0]["loss"]
    assert s["final_val_acc"] > 2.0 / 8  # well above chance (8 classes)
    assert "final val accuracy" in res.output
