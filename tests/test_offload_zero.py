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


ZERO2_RUNS = ["offload_all", "auto:auto", "auto:recompute+host"]


@pytest.fixture(scope="module")
def zero2_launch(tmp_path_factory) -> tuple[int, str, Path]:
    """The ZeRO-2 runs of the tests below in one 2-rank launch, each against the same plain DeepSpeed run: a
    launch's start (the ranks' imports and process group) is most of its time on the CPU."""
    tmp = tmp_path_factory.mktemp("zero2")
    nvme, ssd = tmp / "nvme", tmp / "ssd"
    nvme.mkdir()
    ssd.mkdir()
    runs = [arg for spec in ZERO2_RUNS for arg in ("--run", spec)]
    rc, out = _launch(
        REPO / "tests" / "_offload_zero_worker.py", ["--nvme", str(nvme), "--ssd", str(ssd), *runs]
    )
    return rc, out, ssd


def _check_run(zero2_launch: tuple[int, str, Path], spec: str) -> str:
    rc, out, ssd = zero2_launch
    tail = "\n".join(out.splitlines()[-60:])
    assert rc == 0, tail
    assert len(re.findall(rf"OFFLOAD-OK rank=\d run={re.escape(spec)} ", out)) == 2, tail
    assert not os.listdir(ssd), f"run dirs left behind: {os.listdir(ssd)}"
    return tail


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_zero2_nvme_optimizer_plus_ssd_activations_two_ranks(zero2_launch):
    _check_run(zero2_launch, "offload_all")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("profile_mode", ["auto", "recompute+host"])
def test_zero2_auto_with_a_budget_profiles_under_recomputation_two_ranks(zero2_launch, profile_mode):
    """policy auto with memory_budget_gb through DeepSpeed's engine on two ranks: the warm-up and profiling
    steps run every layer under the reentrant checkpoint beside ZeRO-2's gradient hooks (with recompute+host,
    their inputs on the host and read back, verified, by I/O threads), the plan comes from that profile, and the
    losses stay bitwise equal to plain DeepSpeed's."""
    spec = f"auto:{profile_mode}"
    tail = _check_run(zero2_launch, spec)
    # rank 1's layer 1 is 50 ms slower; both ranks planned from the agreed profiles: one plan
    # the ranks share one pipe, so a line may run into the other rank's next one: match, do not split
    digests = dict(
        re.findall(rf"PLAN-DIGEST rank=(\d+) run={re.escape(spec)} ([0-9a-f]{{16}})", zero2_launch[1])
    )
    assert sorted(digests) == ["0", "1"] and len(set(digests.values())) == 1, tail


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
