"""Activation offload beside ZeRO through the deepspeed launcher (2 ranks, gloo, CPU)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.harness import REPO, build_deepspeed_ops, launch, needs_async_io


def _launch(script: Path, args: list[str], nprocs: int = 2, timeout: float = 600) -> tuple[int, str]:
    build_deepspeed_ops("CPUAdamBuilder", "AsyncIOBuilder")  # ZeRO's NVMe optimizer offload in the ranks
    r = launch(script, args, nprocs=nprocs, timeout=timeout)
    return r.returncode, r.output


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
    # rank 1's layer 1 is 50 ms slower; both ranks planned from the agreed profiles: one plan
    digests = {line.split()[-1] for line in out.splitlines() if "PLAN-DIGEST" in line}
    assert out.count("PLAN-DIGEST") == 2 and len(digests) == 1, tail
    assert not os.listdir(ssd), f"run dirs left behind: {os.listdir(ssd)}"


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_async_io  # ZeRO-3 swaps optimizer state to nvme through async_io (stages 1 and 2 treat nvme as cpu)
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
