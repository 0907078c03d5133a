"""Shared pieces of the CPU offload tests: configs, batches, training loops and their reference runs."""

from __future__ import annotations

import copy
import time

import torch

from dsx.config import ActivationOffloadConfig
from dsx.offload import ActivationOffload, reads
from dsx.runtime.scheduler import Scheduler
from tests.offload._offload_models import TinyGPT


def _cfg(tmp_path, tiers, **kw):
    base = dict(
        enabled=True,
        tiers=tiers,
        policy="offload_all",
        host_pool_gb=0.05,
        min_tensor_bytes=0,
        io_backend="posix",
        verify=True,
    )
    if "ssd" in tiers:
        (tmp_path / "ssd").mkdir(exist_ok=True)
        base.update(ssd_path=str(tmp_path / "ssd"), ssd_capacity_gb=0.05)
    base.update(kw)
    return ActivationOffloadConfig(**base)


def _batches(kind, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "gpt":
        return [torch.randint(0, 64, (2, 16), generator=g) for _ in range(n)]
    return [torch.randn(4, 6, 48, generator=g) for _ in range(n)]


def _train(model, batches, offload=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads = []
    for x in batches:
        opt.zero_grad()
        out = model(x)
        (out.float().pow(2).mean() if out.dim() == 3 else out.sum()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        if offload is not None:
            offload.end_step()
    return grads


def _train_closing(model, batches, off, sched):
    """``_train`` with ``off`` attached; closes it and its scheduler afterwards, also when training raises."""
    try:
        return _train(model, batches, off)
    finally:
        off.close()
        sched.close()


def _reference(seed, n_batches, make=TinyGPT, kind="gpt"):
    """A fresh model, its batches and the gradients of a run without offload (from an identical copy)."""
    torch.manual_seed(seed)
    ref = make()
    model = copy.deepcopy(ref)
    batches = _batches(kind, n_batches)
    return model, batches, _train(ref, batches)


def _steps(model, batches, off, actions=(), after=None):
    """Train on ``batches``; after step i (step 0 profiles under policy auto) install ``actions[i]``, then
    call ``after(i)``; ``off=None`` trains without offload (the reference)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads = []
    for i, x in enumerate(batches):
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        if off is None:  # the reference run
            continue
        off.end_step()
        if i < len(actions):
            off._apply(actions[i], 1)
        if after is not None:
            after(i)
    return grads


def _train_with_plans(model, batches, off, sched):
    """Train on ``batches`` with ``off`` installed; gradients and the plan in force after each step."""
    plans = []
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        got = []
        for x in batches:
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            got.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            off.end_step()
            plans.append(off.plan)
    finally:
        off.close()
        sched.close()
    return got, plans


def _calls_per_step(model, batches, off, sched):
    calls = [0]
    for blk in model.blocks:
        blk.attn.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    per_step, seen = [], 0
    orig_end = off.end_step

    def end_step() -> None:
        nonlocal seen
        per_step.append(calls[0] - seen)
        seen = calls[0]
        orig_end()

    off.end_step = end_step  # type: ignore[method-assign]
    got, plans = _train_with_plans(model, batches, off, sched)
    return got, plans, per_step


def _one_gib_budget_run(tmp_path):
    """A model, its batches and reference gradients, and policy auto under a 1 GiB budget, profiled at once."""
    model, batches, want = _reference(7, 5)
    sched = Scheduler()
    cfg = _cfg(
        tmp_path, ["host"], policy="auto", profile_warmup_steps=0, memory_budget_gb=1.0, host_pool_gb=0.2
    )
    return model, batches, want, ActivationOffload(model, cfg, sched), sched


def slow_ssd_reads(monkeypatch, delay: float) -> None:
    """Every read from the SSD tier takes ``delay`` seconds longer (a slow drive), for the test's duration."""
    real = reads.ReadPath._read

    def slow_drive(self, e, dst=None):
        if e.tier == "ssd":
            time.sleep(delay)
        return real(self, e, dst)

    monkeypatch.setattr(reads.ReadPath, "_read", slow_drive)
