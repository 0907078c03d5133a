"""One rank of the launcher tests: plain DeepSpeed, then dsx with activation offload on the same data, once for
each ``--run``.

Prints ``OFFLOAD-OK rank=<r> run=<spec> ...`` for each run whose losses are bitwise equal to plain DeepSpeed's
and whose SSD tier moved bytes (``offload_all``) or whose plan was made from a profile taken under
recomputation (``auto``, with a budget); exits non-zero at the first that is not.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import os
import time

import deepspeed
import torch

import dsx
from tests.offload._offload_models import TinyGPT


def _config(
    nvme: str, stage: int, with_dsx: bool, ssd: str, policy: str = "offload_all", profile_mode: str = "auto"
) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
        "zero_allow_untested_optimizer": True,
    }
    if with_dsx:
        cfg["dsx"] = {
            "activation_offload": {
                "enabled": True,
                "tiers": ["host", "ssd"],
                "ssd_path": ssd,
                "policy": policy,
                "host_pool_gb": 0.05,
                "ssd_capacity_gb": 0.05,
                "min_tensor_bytes": 0,
                "io_backend": "posix",
                "verify": True,
            }
        }
        if policy == "auto":  # a budget: the warm-up and profiling steps recompute every layer
            cfg["dsx"]["activation_offload"].update(memory_budget_gb=1.0, profile_mode=profile_mode)
    return cfg


def _train(engine, batches) -> list[float]:
    losses = []
    for x in batches:
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _offload_run(a, rank: int, base, batches, want: list[float], spec: str, i: int) -> None:
    """dsx with the ``spec`` (``POLICY[:PROFILE_MODE]``) section on ``batches``; its losses must equal plain
    DeepSpeed's ``want`` bitwise."""
    policy, _, profile_mode = spec.partition(":")
    profile_mode = profile_mode or "auto"
    model = copy.deepcopy(base)
    if policy == "auto" and rank == 1:  # one rank's layer 1 runs slower: the ranks must still plan alike
        block, fwd = (
            model.blocks[1],
            model.blocks[1].forward,
        )  # (in its forward: the recomputation runs it too)
        block.forward = lambda *args, **kw: (time.sleep(0.05), fwd(*args, **kw))[1]
    e1, *_ = dsx.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=_config(os.path.join(a.nvme, f"dsx{i}"), a.stage, True, a.ssd, policy, profile_mode),
    )
    got = _train(e1, batches)
    sched = e1.dsx.scheduler
    ssd_bytes = sum(r.bytes_by_tier.get("ssd", 0) for r in sched.telemetry.history)
    # (the warm-up and profiling steps: the first two; profile_mode recompute+host moves the layers' inputs there)
    profiling_host_bytes = [r.bytes_by_tier.get("host", 0) for r in sched.telemetry.history[:2]]
    handle = e1.dsx.features["activation_offload"]
    shared, pauses = handle.offload.shared_ssd, sched.gate_pauses.get("ssd", 0)
    plan, under_rc = handle.offload.plan, handle.offload._profile_rc
    e1.dsx.close()
    assert want == got, f"rank {rank} {spec}: losses differ with activation offload: {want} vs {got}"
    if policy == "auto":
        assert plan is not None and under_rc, (
            f"rank {rank} {spec}: no plan, or not profiled under recomputation"
        )
        moved_inputs = all(b > 0 for b in profiling_host_bytes)
        assert moved_inputs == (profile_mode == "recompute+host"), (spec, profiling_host_bytes)
        assert all(p.saved_bytes > p.input_bytes > 0 and not p.recompute_only for p in plan.profiles), (
            plan.profiles
        )
        # the ranks planned from the same (agreed) profiles: the slow rank's time for layer 1
        assert plan.profiles[1].fwd_s > 0.05, plan.profiles[1]
        digest = hashlib.sha256(repr((plan.profiles, plan.actions, plan.move_caps)).encode()).hexdigest()
        print(f"PLAN-DIGEST rank={rank} run={spec} {digest[:16]}", flush=True)
    else:
        assert ssd_bytes > 0, f"rank {rank} {spec}: the SSD tier moved nothing"
    assert shared and pauses == len(batches), f"rank {rank} {spec}: shared={shared} gate pauses={pauses}"
    print(
        f"OFFLOAD-OK rank={rank} run={spec} losses={got} ssd_bytes={ssd_bytes} gate_pauses={pauses}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvme", required=True)
    ap.add_argument("--ssd", required=True)
    ap.add_argument("--stage", type=int, default=2)
    # several runs in one launch share its start (the ranks' imports and process group) and the reference run
    ap.add_argument("--run", action="append", metavar="POLICY[:PROFILE_MODE]",
                    help="a dsx run: offload_all, auto or auto:recompute+host (repeatable; default offload_all)")  # fmt: skip
    ap.add_argument("--local_rank", type=int, default=0)
    a = ap.parse_args()
    runs = a.run or ["offload_all"]
    for spec in runs:
        policy, _, mode = spec.partition(":")
        if policy not in ("offload_all", "auto") or mode not in ("", "auto", "recompute+host"):
            ap.error(f"--run {spec}: expected offload_all, auto or auto:recompute+host")
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    base = TinyGPT()
    g = torch.Generator().manual_seed(100 + rank)
    # policy auto takes a fourth step (warm-up, profiling, then planned ones); offload_all trains on the first 3
    batches = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(4)]
    ref_model = copy.deepcopy(base)
    e0, *_ = deepspeed.initialize(
        model=ref_model,
        model_parameters=ref_model.parameters(),
        config=_config(os.path.join(a.nvme, "ref"), a.stage, False, a.ssd),
    )
    want = _train(e0, batches)
    for i, spec in enumerate(runs):
        n = 4 if spec.startswith("auto") else 3
        _offload_run(a, rank, base, batches[:n], want[:n], spec, i)


if __name__ == "__main__":
    main()
