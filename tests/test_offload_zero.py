"""Activation offload beside ZeRO through the deepspeed launcher (2 ranks, gloo, CPU)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.harness import REPO, build_deepspeed_ops, launch, needs_async_io


def _launch(script: Path, args: list[str], stage: int = 2) -> tuple[int, str]:
    # ZeRO-3 swaps optimizer state to nvme through async_io; stages 1 and 2 keep it in host memory
    build_deepspeed_ops("CPUAdamBuilder", *(["AsyncIOBuilder"] if stage == 3 else []))
    r = launch(script, [*args, "--stage", str(stage)], nprocs=2, timeout=600)
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


@pytest.mark.parametrize("profile_mode", ["auto", "recompute+host"])
def test_zero2_auto_with_a_budget_profiles_under_recomputation_two_ranks(tmp_path, profile_mode):
    """policy auto with memory_budget_gb through DeepSpeed's engine on two ranks: the warm-up and profiling
    steps run every layer under the reentrant checkpoint beside ZeRO-2's gradient hooks (with recompute+host,
    their inputs on the host and read back, verified, by I/O threads), the plan comes from that profile, and the
    losses stay bitwise equal to plain DeepSpeed's."""
    nvme, ssd = tmp_path / "nvme", tmp_path / "ssd"
    nvme.mkdir()
    ssd.mkdir()
    rc, out = _launch(
        REPO / "tests" / "_offload_zero_worker.py",
        ["--nvme", str(nvme), "--ssd", str(ssd), "--policy", "auto", "--profile-mode", profile_mode],
    )
    tail = "\n".join(out.splitlines()[-60:])
    assert rc == 0, tail
    assert out.count("OFFLOAD-OK") == 2, tail
    # rank 1's layer 1 is 50 ms slower; both ranks planned from the agreed profiles: one plan
    # the ranks share one pipe, so a line may run into the other rank's next one: match, do not split
    digests = dict(re.findall(r"PLAN-DIGEST rank=(\d+) ([0-9a-f]{16})", out))
    assert sorted(digests) == ["0", "1"] and len(set(digests.values())) == 1, tail
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
        REPO / "tests" / "_offload_zero_worker.py", ["--nvme", str(nvme), "--ssd", str(ssd)], stage=3
    )
    tail = "\n".join(out.splitlines()[-60:])
    assert rc == 0, tail
    assert out.count("OFFLOAD-OK") == 2, tail
