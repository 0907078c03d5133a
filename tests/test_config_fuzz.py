"""Configs that validate must run: real engines started on a seeded sample of accepted "dsx" sections.

Each sample mixes ordinary and edge values of every key (zero, the upper bounds, names that match nothing,
backends this machine lacks, paths too long). ``dsx.initialize`` must either start an engine that trains a
few steps (and, where the sections ask for them, gathers from a unified tensor and runs a relational layer),
or refuse at start-up with a :class:`~dsx.config.DsxConfigError` naming the key. Any other exception, from
parse to close, is a config that validated and then crashed.

    python -m tests.test_config_fuzz --n 200      # a larger sample; prints the counts
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

import dsx
from dsx.config import MAX_GB, DsxConfigError, parse_dsx_config
from tests.offload._offload_models import TinyGPT

_OFFLOAD: dict[str, list[Any]] = {
    "tiers": [["host"], ["ssd"], ["host", "ssd"], ["ssd", "host"]],
    "host_pool_gb": [0.0, 1e-9, 0.004, 0.05, 0.5],
    "ssd_capacity_gb": [0.0, 1e-9, 0.01, 1.0, MAX_GB],
    "memory_budget_gb": [None, 0.0, 1e-9, 0.001, 1.0, MAX_GB],
    "policy": ["auto", "offload_all", "recompute_all", "none"],
    "layer_classes": [None, ["Block"], ["NoSuchLayer"]],
    "recompute_modules": [[], ["CoreAttention"], ["NoSuchModule"]],
    "profile_warmup_steps": [0, 1, 2, 1000],
    "profile_mode": ["auto", "keep", "recompute", "recompute+host"],
    "write_barrier": ["auto", "on", "off"],
    "read_pool": ["auto", "compute", "prefetch"],
    "expandable_segments": ["auto", "on", "off"],
    "io_backend": ["auto", "posix", "aio", "kvikio"],
    "min_tensor_bytes": [0, 1, 4096, 1 << 20, 1 << 50],
    "prefetch_depth": [None, 1, 2, 64],
    "verify": ["auto", True, False],
    "ssd_endurance_tbw": [None, 1e-9, 1.0, 1e9],
    "wear_warn_years": [1e-9, 1.0, 100.0],
}
_UNIFIED: dict[str, list[Any]] = {
    "shared": ["auto", "on", "off"],
    "max_gather_sms": [None, 1, 1 << 16],
    "sort_indices": [True, False],
    "prefetch_batches": [0, 1, 16],
    "backend": ["auto", "cuda", "torch"],
    "check_indices": ["sync", "deferred"],
}
_RGNN: dict[str, list[Any]] = {
    "precision": ["fp32", "tf32", "bf16"],
    "compact_materialization": [True, False],
    "linear_reorder": [True, False],
    "fusion": [True, False],
    "backend": ["auto", "triton", "interpreter"],
}
_SCHEDULER: dict[str, list[Any]] = {
    "enabled": [True, False],
    "io_workers": [1, 2, 64],
    "log_interval": [1, 3, 1 << 20],
    "trace_steps": [1, 50, 1 << 16],
    "bandwidth_probe_mb": [1, 64, 1 << 16],
    "event_wait": ["auto", "poll", "spin"],
}
STEPS = 4


def sample_section(rng: random.Random, tmp: Path) -> dict[str, Any]:
    """A "dsx" section: each feature on or off, about half of each on feature's keys set from its pool."""

    def pick(pool: dict[str, list[Any]]) -> dict[str, Any]:
        return {k: rng.choice(v) for k, v in pool.items() if rng.random() < 0.5}

    section: dict[str, Any] = {}
    if rng.random() < 0.8:
        off = {"enabled": True, **pick(_OFFLOAD)}
        if "ssd" in off.get("tiers", ["host"]) or rng.random() < 0.3:
            ssd = tmp / "ssd"
            ssd.mkdir(exist_ok=True)
            off["ssd_path"] = rng.choice([str(ssd), str(ssd), str(tmp / "missing"), str(tmp / ("x" * 300))])
        section["activation_offload"] = off
    if rng.random() < 0.4:
        section["unified"] = {"enabled": True, **pick(_UNIFIED),
                              "shared_memory_dir": rng.choice(["/dev/shm", str(tmp)])}  # fmt: skip
    if rng.random() < 0.4:
        section["rgnn"] = {"enabled": True, **pick(_RGNN)}
    if rng.random() < 0.6:
        sched = pick(_SCHEDULER)
        if rng.random() < 0.5:
            sched["trace_path"] = rng.choice(
                [str(tmp / "trace.json"), str(tmp), "", str(tmp / "no" / "t.json")]
            )
        section["scheduler"] = sched
    return section


def _use_features(engine: Any, section: dict[str, Any]) -> None:
    """What a job does with the sections besides training: a unified gather, a relational layer."""
    if section.get("unified", {}).get("enabled"):
        table = torch.randn(50, 8)
        ut = dsx.unified(table, shared="off")
        idx = torch.randint(0, 50, (20,))
        assert torch.equal(ut[idx], table[idx])
        ut.close()
    if section.get("rgnn", {}).get("enabled"):
        import dsx.rgnn as rg

        conv = rg.RGCNConv(4, 4, 2)
        ei, et = torch.randint(0, 10, (2, 30)), torch.randint(0, 2, (30,))
        out = conv(torch.randn(10, 4), ei, et)
        assert out.shape == (10, 4) and torch.isfinite(out).all()


def run_one(section: dict[str, Any]) -> str:
    """``"parse"`` (refused at parse), ``"startup"`` (refused by dsx.initialize) or ``"trained"``; any other
    exception propagates."""
    try:
        parse_dsx_config(section)
    except DsxConfigError:
        return "parse"
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=3, heads=4, seq=16)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 0},
        "dsx": section,
    }
    try:
        engine, _, _, _ = dsx.initialize(model=model, model_parameters=model.parameters(), config=config)
    except DsxConfigError:
        return "startup"
    runtime = dsx.runtime_of(engine)
    try:
        gen = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            x = torch.randint(0, 64, (2, 16), generator=gen)
            loss = engine(x).float().pow(2).mean()
            assert torch.isfinite(loss)
            engine.backward(loss)
            engine.step()
        _use_features(engine, section)
    finally:
        if runtime is not None:
            runtime.close()
    return "trained"


def _no_async_io_build(section: dict[str, Any]) -> None:
    """Under ``DSX_TESTS_SKIP_ASYNC_IO=1`` (.ci/run) on a machine where the async_io op would build, the SSD
    tier's ``auto`` / ``aio`` backends become ``posix``: that run covers the combination without libaio."""
    from dsx.ops.aio import async_io_status
    from tests.harness import SKIP_ASYNC_IO

    off = section.get("activation_offload")
    if not (os.environ.get(SKIP_ASYNC_IO) == "1" and isinstance(off, dict)):
        return
    if off.get("io_backend", "auto") in ("auto", "aio") and async_io_status()[0]:
        off["io_backend"] = "posix"


def fuzz(n: int, seed: int = 0) -> dict[str, Any]:
    """Run ``n`` sampled sections; the counts per outcome and the failures (section and traceback)."""
    rng = random.Random(seed)
    counts = {"parse": 0, "startup": 0, "trained": 0, "crashed": 0}
    failures = []
    for i in range(n):
        with tempfile.TemporaryDirectory(prefix="dsx-fuzz-") as tmp:
            section = sample_section(rng, Path(tmp))
            _no_async_io_build(section)
            try:
                counts[run_one(section)] += 1
            except Exception:
                counts["crashed"] += 1
                failures.append({"sample": i, "section": section, "traceback": traceback.format_exc()})
    return {"samples": n, "seed": seed, "engines_started": counts["trained"], **counts, "failures": failures}


def test_sampled_configs_that_validate_start_and_train() -> None:
    result = fuzz(24, seed=20261126)
    assert result["failures"] == [], "\n\n".join(
        f"{f['section']}\n{f['traceback']}" for f in result["failures"]
    )
    assert result["trained"] >= 8 and result["parse"] >= 1, result  # the sample reaches both sides


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=200, help="sections to sample")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    result = fuzz(args.n, args.seed)
    for f in result["failures"]:
        print(f"--- sample {f['sample']}: {f['section']}\n{f['traceback']}")
    print({k: v for k, v in result.items() if k != "failures"})
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
