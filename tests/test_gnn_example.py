"""examples/gnn/train_sage.py end to end: 2 CPU ranks through the deepspeed launcher (gloo), accuracy rises."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_sage_two_ranks_gloo(tmp_path: Path) -> None:
    log = tmp_path / "log.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--no_ssh_check",
        "--master_port", str(_free_port()), str(ROOT / "examples/gnn/train_sage.py"),
        "--nodes", "3000", "--edges", "30000", "--epochs", "3", "--batch-size", "256", "--log-json", str(log),
    ]  # fmt: skip
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=580)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    epochs = json.loads(log.read_text())["epochs"]
    assert epochs[-1]["acc"] > epochs[0]["acc"] or epochs[-1]["acc"] > 0.6, epochs
    assert epochs[-1]["loss"] < epochs[0]["loss"], epochs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_sage_quick(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/bench_sage.py"), "--quick", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "bench_sage.json").read_text())
    assert res["runs"]["dsx_host_features"]["per_batch_s"] > 0 and (tmp_path / "bench_sage.png").exists()
