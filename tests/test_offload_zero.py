"""Activation offload beside ZeRO through the deepspeed launcher (2 ranks, gloo, CPU)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _launch(script: Path, args: list[str], nprocs: int = 2, timeout: float = 600) -> tuple[int, str]:
    """Minimal stand-in for tests/harness.py's ``launch`` (the lead dedupes)."""
    try:
        from tests.harness import launch

        r = launch(script, args, nprocs=nprocs, timeout=timeout)
        return r.returncode, r.output
    except ImportError:
        pass
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"
    )
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    exe = shutil.which("deepspeed", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "deepspeed.launcher.runner"]
    cmd += ["--num_accelerators", str(nprocs), "--master_port", str(port), str(script), *args]
    p = subprocess.run(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )
    return p.returncode, p.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_zero2_nvme_optimizer_plus_ssd_activations_two_ranks(tmp_path):
    nvme, ssd = tmp_path / "nvme", tmp_path / "ssd"
    nvme.mkdir()
    ssd.mkdir()
    rc, out = _launch(REPO / "tests" / "_offload_zero_worker.py", ["--nvme", str(nvme), "--ssd", str(ssd)])
    tail = "\n".join(out.splitlines()[-60:])
    assert rc == 0, tail
    assert out.count("OFFLOAD-OK") == 2, tail
    assert not os.listdir(ssd), f"run dirs left behind: {os.listdir(ssd)}"


def test_zero2_auto_with_a_budget_profiles_under_recomputation_two_ranks(tmp_path):
    """policy auto with memory_budget_gb through DeepSpeed's engine on two ranks: the warm-up and profiling
    steps run every layer under the reentrant checkpoint beside ZeRO-2's gradient hooks, the plan comes from
    that profile, and the losses stay bitwise equal to plain DeepSpeed's."""
    nvme, ssd = tmp_path / "nvme", tmp_path / "ssd"
    nvme.mkdir()
    ssd.mkdir()
    rc, out = _launch(
        REPO / "tests" / "_offload_zero_worker.py",
        ["--nvme", str(nvme), "--ssd", str(ssd), "--policy", "auto"],
    )
    tail = "\n".join(out.splitlines()[-60:])
    assert rc == 0, tail
    assert out.count("OFFLOAD-OK") == 2, tail
    assert not os.listdir(ssd), f"run dirs left behind: {os.listdir(ssd)}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_zero3_nvme_optimizer_plus_ssd_activations_two_ranks(tmp_path):
    """ZeRO-3 gathers parameters in its own pre-hooks: they must stay, activations must move."""
    nvme, ssd = tmp_path / "nvme", tmp_path / "ssd"
    nvme.mkdir()
    ssd.mkdir()
    rc, out = _launch(
        REPO / "tests" / "_offload_zero_worker.py", ["--nvme", str(nvme), "--ssd", str(ssd), "--stage", "3"]
    )
    tail = "\n".join(out.splitlines()[-60:])
    assert rc == 0, tail
    assert out.count("OFFLOAD-OK") == 2, tail
