"""The profiling step of policy ``auto``: per-layer saved bytes, forward and backward time.

Runs once, everything kept, on the step after ``profile_warmup_steps`` warm-up steps. Times are taken with
``perf_counter`` around a device synchronize on CUDA, which costs one slow step and is exact, rather than CUDA
events whose pairing across hooks and autograd threads is fragile.

Backward time is taken from gradient hooks on the layer's activations: it starts when the gradient of the
layer's output arrives and ends when the gradient of its input is computed. Module full-backward hooks
cannot do this: they see positional inputs only, and Megatron passes ``hidden_states`` by keyword, so they
fire back to back and report ~0 ms.

On CUDA each layer's backward workspace is measured too: the peak allocated memory above the level at its
start (gradient buffers and temporaries; with everything kept, net of what the backward frees). The profiling
step resets CUDA's peak-memory statistics to measure it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["Profiler", "first_grad_tensor"]


def first_grad_tensor(values: Iterable[Any]) -> torch.Tensor | None:
    """The first tensor that requires grad among ``values`` (looking one level into tuples, lists, dicts)."""
    for v in values:
        if isinstance(v, (tuple, list)):
            v = first_grad_tensor(v)
        elif isinstance(v, dict):
            v = first_grad_tensor(v.values())
        if isinstance(v, torch.Tensor) and v.requires_grad:
            return v
    return None


class Profiler:
    """Times each layer (and its ``recompute_modules``) during one step; ``finish()`` gives the profiles."""

    def __init__(
        self, layers: list[nn.Module], hooks: Any, device: torch.device, recompute_modules: Iterable[str] = ()
    ) -> None:
        self.layers, self.hooks, self.device = layers, hooks, device
        n = len(layers)
        self.fwd, self.bwd, self.sub = [0.0] * n, [0.0] * n, [0.0] * n
        self.workspace = [0] * n
        self._open: dict[int, int] = {}  # layers whose backward runs: memory allocated at its start
        self.has_sub = [False] * n
        self.enabled = True  # off during warm-up steps
        self._t: dict[tuple[str, int], float] = {}
        self._handles = []
        names = set(recompute_modules)
        for i, m in enumerate(layers):
            self._handles += [
                m.register_forward_pre_hook(self._fwd_pre(i), with_kwargs=True),
                m.register_forward_hook(self._fwd_post(i)),
            ]
            for sub in m.modules():
                if sub is not m and type(sub).__name__ in names:
                    self.has_sub[i] = True
                    self._handles += [
                        sub.register_forward_pre_hook(self._sub_pre(i), with_kwargs=True),
                        sub.register_forward_hook(self._sub_post(i)),
                    ]

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _start(self, kind: str, i: int) -> None:
        if not self.enabled:
            return
        self._t[(kind, i)] = self._now()
        if kind == "b" and self.device.type == "cuda":
            # another layer's backward may still be open (its end and this start are one gradient): fold the
            # peak so far into it before the reset
            self._fold_peaks()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._open[i] = torch.cuda.memory_allocated(self.device)

    def _stop(self, kind: str, i: int, into: list[float]) -> None:
        t0 = self._t.pop((kind, i), None)
        if t0 is not None:
            into[i] += self._now() - t0
        if kind == "b" and i in self._open:
            self._fold_peaks()
            del self._open[i]

    def _fold_peaks(self) -> None:
        peak = torch.cuda.max_memory_allocated(self.device)
        for j, base in self._open.items():
            self.workspace[j] = max(self.workspace[j], peak - base)

    def _fwd_pre(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not (self.enabled and torch.is_grad_enabled()):
                return
            x = first_grad_tensor([*args, *kwargs.values()])
            self._has_input = x is not None
            if x is not None:
                x.register_hook(lambda _g: self._stop("b", i, self.bwd))
            self._start("f", i)

        return hook

    def _fwd_post(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if not (self.enabled and torch.is_grad_enabled()):
                return
            self._stop("f", i, self.fwd)
            y = first_grad_tensor([out])
            if y is None:
                return
            has_input = self._has_input

            def start(_g: torch.Tensor) -> None:
                self._start("b", i)
                if not has_input:  # nothing marks the end of this layer's backward but the end of backward
                    torch.autograd.Variable._execution_engine.queue_callback(
                        lambda: self._stop("b", i, self.bwd)
                    )

            y.register_hook(start)

        return hook

    def _sub_pre(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not (self.enabled and torch.is_grad_enabled()):
                return
            self.hooks.sub_depth += 1
            self.hooks.note_sub_inputs(i, [*args, *kwargs.values()])
            self._start(f"s{id(module)}", i)

        return hook

    def _sub_post(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if not (self.enabled and torch.is_grad_enabled()):
                return
            self.hooks.sub_depth -= 1
            self._stop(f"s{id(module)}", i, self.sub)

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
                sel_saved_bytes=self.hooks.sel_saved_bytes(i) if self.has_sub[i] else None,
                sel_recompute_s=self.sub[i],
                bwd_workspace_bytes=self.workspace[i],
            )
            for i, m in enumerate(self.layers)
        ]
