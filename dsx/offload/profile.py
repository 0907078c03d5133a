"""The profiling step of policy ``auto``: per-layer saved bytes, forward and backward time.

Runs once (step 0, everything kept). Times are taken with ``perf_counter`` around a device synchronize on
CUDA, which costs one slow step and is exact, rather than CUDA events whose pairing across hooks and
autograd threads is fragile.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

__all__ = ["Profiler"]


class Profiler:
    def __init__(self, layers: list[nn.Module], hooks: Any, device: torch.device) -> None:
        self.layers, self.hooks, self.device = layers, hooks, device
        n = len(layers)
        self.fwd, self.bwd = [0.0] * n, [0.0] * n
        self._t: dict[tuple[str, int], float] = {}
        self._handles = []
        for i, m in enumerate(layers):
            self._handles += [
                m.register_forward_pre_hook(self._mark("f", i, start=True)),
                m.register_forward_hook(self._mark("f", i, start=False)),
                m.register_full_backward_pre_hook(self._mark("b", i, start=True)),
                m.register_full_backward_hook(self._mark("b", i, start=False)),
            ]

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _mark(self, kind: str, i: int, start: bool) -> Any:
        def hook(*_: Any) -> None:
            if start:
                self._t[(kind, i)] = self._now()
            elif (kind, i) in self._t:
                dt = self._now() - self._t.pop((kind, i))
                (self.fwd if kind == "f" else self.bwd)[i] += dt

        return hook

    def finish(self) -> list[Any]:
        from dsx.offload.plan import LayerProfile

        for h in self._handles:
            h.remove()
        return [
            LayerProfile(
                index=i,
                name=f"{type(m).__name__}[{i}]",
                saved_bytes=self.hooks.profile_bytes[i],
                fwd_s=self.fwd[i],
                bwd_s=self.bwd[i],
            )
            for i, m in enumerate(self.layers)
        ]
