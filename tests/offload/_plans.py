"""Shared pieces of the planner tests: tier bandwidths, configs and random layer profiles."""

from __future__ import annotations

import random

from dsx.config import ActivationOffloadConfig
from dsx.offload.plan import LayerProfile, TierBandwidth, planned_bandwidths

GiB = 1 << 30
BW = [TierBandwidth("host", 20e9, 20e9), TierBandwidth("ssd", 2e9, 1.5e9)]


def _profiles(rng: random.Random, n: int) -> list[LayerProfile]:
    return [
        LayerProfile(i, f"L{i}", rng.randint(1, 16) << 26, rng.uniform(0.004, 0.02), rng.uniform(0.008, 0.04))
        for i in range(n)
    ]


def _cfg(**kw) -> ActivationOffloadConfig:
    return ActivationOffloadConfig(tiers=["host", "ssd"], **kw)


def _bw(bws: list[TierBandwidth] = BW, budget: bool = False) -> dict[str, TierBandwidth]:
    """The tiers as the planner sees them under the default settings: without a budget each moved tensor's
    host time is added, under one it is not."""
    return planned_bandwidths(bws, _cfg(memory_budget_gb=1.0 if budget else None))


def _sel_profiles(rng: random.Random, n: int) -> list[LayerProfile]:
    """Layers whose attention holds most of the saved bytes and is cheap to recompute (long sequences)."""
    out = []
    for p in _profiles(rng, n):
        p.sel_saved_bytes = int(p.saved_bytes * rng.uniform(0.2, 0.4))
        p.sel_recompute_s = p.fwd_s * rng.uniform(0.1, 0.2)
        out.append(p)
    return out


def _with_background(rng: random.Random, n: int) -> list[LayerProfile]:
    out = []
    for p in _profiles(rng, n):
        p.fwd_peak_bytes = p.saved_bytes + (rng.randint(0, 8) << 24)
        p.bwd_workspace_bytes = rng.randint(0, 16) << 24
        p.fwd_background_bytes = rng.randint(0, 4) << 24
        p.gap_background_bytes = rng.randint(0, 32) << 24
        p.bwd_background_bytes = rng.randint(0, 32) << 24
        out.append(p)
    return out
