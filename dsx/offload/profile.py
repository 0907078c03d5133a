"""The profiling step of policy ``auto``: per-layer saved bytes, forward and backward time.

Runs once, everything kept, on the step after ``profile_warmup_steps`` warm-up steps. Times are taken with
``perf_counter`` around a device synchronize on CUDA, which costs one slow step and is exact, rather than CUDA
events whose pairing across hooks and autograd threads is fragile.

Every interval, and the warm-up step's wall time from which the time outside the layers is taken, leaves out
what the offload's waits cost in it (the ``waited`` callable): on CUDA the GPU's idle time while the host waited
for a read or at the write barrier, and its waits for reads' copies (in a warm-up step the host runs ahead and
waits while the GPU still has work, so its own wait would overstate the cost); on the CPU, where the host runs
the layers, the host's waits. Under ``profile_mode`` ``"recompute+host"`` with the SSD tier, inputs the pool
cannot hold go to the drive, and a layer's backward would otherwise include the wait for its read: the plan
models each move's time itself, from the tiers' measured rates, and would count it twice.

Backward time is taken from gradient hooks on the layer's activations: it starts when the gradient of the
layer's output arrives and ends when the gradient of its input is computed. Module full-backward hooks
cannot do this: they see positional inputs only, and Megatron passes ``hidden_states`` by keyword, so they
fire back to back and report ~0 ms.

On CUDA the profiling step also measures memory, so that the planner predicts the peak
``max_memory_allocated`` will see and not only the saved bytes (a megatron-core plan counted on saved bytes
alone peaked well above its prediction): per layer, the forward's peak above its start; what is
allocated at the start of its forward and of its backward beyond the saved bytes of the layers still holding
them (gradients, the layer's input and output, what the model outside the layers keeps); the peak in the gap
after its forward (the next layer's start, or for the last layer the head, the loss and the start of
backward) beyond the saved bytes so far; and its backward's workspace: the peak above the level at its start
(gradient buffers and temporaries; with everything kept, net of what the backward frees). All are relative to
the allocated memory when the model's forward starts (``root``; without one, when its first layer starts), so
what the embedding allocates counts, and gradients freed between steps do not. The step resets CUDA's
peak-memory statistics.

The gap after the last layer's forward (its ``gap_s``: to its own backward, through the head, the loss and their
backward) is timed the same way; writes cross the link through it. The gaps between layers are not: in the
synchronized profiled step they are host time that a normal step overlaps with the GPU's work.

The step's time outside the layers (``Profiler.outside_s``: embedding, head, loss, optimizer) is a step's wall
time from the model's forward start to the optimizer step's end less the layers' intervals; the printed prediction
adds it. The wall time is the last warm-up step's, which runs as the profiled step does but is synchronized only
at its ends (``end_warm_step``): the profiled step's own synchronizations expose host-bound work (many small
optimizer kernels) that a normal step overlaps with the layers' GPU work, and overstate that time several times
over. With one warm-up step (the first step pays for lazy initialisation) the profiled step's own wall time is
used. With gradient accumulation the profiled step runs several micro-batches; the times (and the outside time)
are divided by their number, as the saved bytes are counted for the first one: the plan is per micro-batch. On
CUDA the profiled step also measures its peak after the layers' backward (``Profiler.outside_peak``: the
gradients' reduction, the optimizer step), above the same base: where that, and not the layers, sets the step's
peak, no activation plan can lower it (not measured without a warm-up step: the first optimizer step allocates its
state). Each layer's saved storages are also recorded in save order (``saved_sizes``): a partial move takes them
in that order.

Under recomputation (``profile_mode`` ``"recompute"``: the micro-batch may fit only with dsx) every layer runs
through the reentrant checkpoint and :meth:`Profiler.wrap` sees its recomputation in backward: the saved
bytes are counted there, the forward time and peak are the recomputation's (a forward that saves, as a kept
layer's does), and the backward time is the layer's backward interval less it. What layers hold between
their forward and backward is then only their inputs (``input_bytes``), which the memory points subtract
instead of the saved bytes; the backward's workspace is measured from the end of the recomputation, above
what it re-saved. A layer whose checkpoint falls back to the non-reentrant form (no input requires grad)
cannot have its saved tensors counted there (the checkpoint's own hooks take them); it is timed and
marked ``recompute_only``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from dsx.offload.plan import LayerProfile

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
        self,
        layers: list[nn.Module],
        hooks: Any,
        device: torch.device,
        recompute_modules: Iterable[str] = (),
        under_recompute: bool = False,
        root: nn.Module | None = None,
        waited: Callable[[], float] | None = None,
    ) -> None:
        self.layers, self.hooks, self.device = layers, hooks, device
        # seconds the offload's waits have cost so far (the module docstring): what an interval waited is no
        # part of a layer's time
        self._waited = waited or (lambda: 0.0)
        self.under_recompute = under_recompute
        n = len(layers)
        self.fwd, self.bwd, self.sub = [0.0] * n, [0.0] * n, [0.0] * n
        self.in_bytes = [0] * n
        self.rc = [0.0] * n  # recomputation time (under recompute)
        self._rc_calls = [0] * n
        self._rc_counted = [False] * n
        self._rc_level = 0
        self.workspace = [0] * n
        # memory (CUDA): see the module docstring; base is the level when the first layer starts
        self.fwd_peak, self.fwd_bg, self.gap_bg, self.bwd_bg = [0] * n, [0] * n, [0] * n, [0] * n
        self._base: int | None = None
        # the step's wall time from the model's forward start (its first layer's without a root) to finish():
        # what the layers' times leave is what runs outside them (embedding, head, loss, optimizer)
        self._step_start: float | None = None
        self._step_waited = 0.0
        self.outside_s = 0.0
        # the last warm-up step's wall time (end_warm_step), when it is not the first step: outside_s is taken
        # from it, as the profiled step's per-layer synchronizations expose host work a normal step overlaps
        self.warm_step_s: float | None = None
        self._warm_start: float | None = None
        self._warm_waited = 0.0
        self._warm_steps = 0
        # (CUDA) the peak from the end of the layers' backward to finish(), above the same base: the gradients'
        # reduction and the optimizer step, which no activation plan changes (Plan.outside_peak_bytes)
        self.outside_peak = 0
        self._tail_open = False
        self.micro_batches = 1  # forwards in the profiled step (gradient accumulation); times are per one
        self._fwd_start = 0
        self._gap: int | None = None  # the layer whose after-forward gap is being measured
        # the gap after the last layer's forward (its LayerProfile.gap_s): when that forward ended, until its own
        # backward starts; summed over the micro-batches where it was seen, and their count
        self.head_t = 0.0
        self._heads = 0
        self._head_from: float | None = None
        self._head_waited = 0.0
        self._open: dict[int, int] = {}  # layers whose backward runs: memory allocated at its start
        self.has_sub = [False] * n
        self.enabled = True  # off during warm-up steps
        self._t: dict[tuple[str, int], tuple[float, float]] = {}  # interval -> (clock, waited) at its start
        self._handles = []
        if root is not None:
            self._handles.append(root.register_forward_pre_hook(self._root_pre))
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
                        sub.register_forward_hook(self._sub_post(i), always_call=True),  # (sub_depth)
                    ]

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        """The model's forward starts: the memory base and the step's start, taken on the profiled step's
        first micro-batch."""
        if not self.enabled:
            # a warm-up step's first forward (an evaluation forward without grad does not start one); without a
            # root module no warm-up step is timed, and the profiled step's own time is used
            if self._warm_start is None and torch.is_grad_enabled():
                self._warm_start, self._warm_waited = self._now(), self._waited()
            return
        if self._step_start is None:
            self._step_start, self._step_waited = self._now(), self._waited()
        if self.device.type == "cuda" and self._base is None:
            self._base = torch.cuda.memory_allocated(self.device)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _saved_upto(self, i: int, at: str = "f") -> int:
        """What layers 0..i hold on the device between their forward and backward: all they save, or their
        inputs, less what of those inputs moved off it (``profile_mode`` ``"recompute+host"``). At a forward's
        start (``at="f"``) the moved bytes are gone (the previous layer's end synchronized the device, and its
        hooks then freed them); through the gap after layer ``i``'s forward (``"gap"``) its own are still
        allocated, their copy out seen to end only at the next layer's start; at a backward's start (``"b"``)
        those asked back are there again. In the gap after the last layer the reads the head's end asks for are
        not counted: the background is then an upper bound."""
        if not self.under_recompute:
            return sum(self.hooks.profile_bytes[: i + 1])
        held = 0
        for j, b in enumerate(self.in_bytes[: i + 1]):
            back = (at == "gap" and j == i) or (at == "b" and self.hooks.read_back(j))
            held += b if back else b - self.hooks.moved_bytes(j)
        return held

    def _close_gap(self) -> None:
        """End the gap after layer ``self._gap``'s forward: its peak beyond the saved bytes so far."""
        if self._gap is not None and self._base is not None:
            peak = torch.cuda.max_memory_allocated(self.device) - self._base
            self.gap_bg[self._gap] = max(self.gap_bg[self._gap], peak - self._saved_upto(self._gap, "gap"))
        self._gap = None

    def _start(self, kind: str, i: int) -> None:
        if not self.enabled:
            return
        now, waited = self._now(), self._waited()
        self._t[(kind, i)] = (now, waited)
        if kind in ("f", "b") and self._head_from is not None:
            # the last layer's own backward ends the gap; anything else first (another micro-batch's forward, as
            # a pipeline schedule runs) leaves it unmeasured
            if (kind, i) == ("b", len(self.layers) - 1):
                self.head_t += now - self._head_from - (waited - self._head_waited)
                self._heads += 1
            self._head_from = None
        if self._step_start is None:
            self._step_start, self._step_waited = now, waited
        if self.device.type != "cuda":
            return
        if kind == "f":
            self._tail_open = False  # (a later micro-batch: its backward's end starts the tail again)
            now = torch.cuda.memory_allocated(self.device)
            if self._base is None:
                self._base = now
            self._close_gap()
            self.fwd_bg[i] = now - self._base - self._saved_upto(i - 1)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._fwd_start = now
        elif kind == "b":
            self._tail_open = False  # (a layer's backward after layer 0's: not the tail yet)
            self._close_gap()  # the last layer's gap: head, loss and the start of backward
            # another layer's backward may still be open (its end and this start are one gradient): fold the
            # peak so far into it before the reset
            self._fold_peaks()
            now = torch.cuda.memory_allocated(self.device)
            if self._base is not None:
                self.bwd_bg[i] = now - self._base - self._saved_upto(i, "b")
            torch.cuda.reset_peak_memory_stats(self.device)
            self._open[i] = now

    def _stop(self, kind: str, i: int, into: list[float]) -> None:
        t0 = self._t.pop((kind, i), None)
        if t0 is not None:
            now, waited = self._now(), self._waited()
            into[i] += now - t0[0] - (waited - t0[1])
            if kind == "f" and i == len(self.layers) - 1:
                self._head_from, self._head_waited = now, waited
        if kind == "f" and t0 is not None and self.device.type == "cuda":
            self.fwd_peak[i] = torch.cuda.max_memory_allocated(self.device) - self._fwd_start
            torch.cuda.reset_peak_memory_stats(self.device)
            self._gap = i
        if kind == "b" and i in self._open:
            self._fold_peaks()
            del self._open[i]
            # the layers' backward is over: what follows is the step's tail (if another layer's backward is still
            # open, as where one's end is queued to the end of backward, no tail is measured: outside_peak is 0)
            if i == 0 and not self._open:
                torch.cuda.reset_peak_memory_stats(self.device)
                self._tail_open = True

    def _fold_peaks(self, skip: int | None = None) -> None:
        peak = torch.cuda.max_memory_allocated(self.device)
        for j, base in self._open.items():
            if j != skip:
                self.workspace[j] = max(self.workspace[j], peak - base)

    def wrap(self, i: int, fn: Any, count_saved: bool = True) -> Any:
        """``fn`` (layer ``i``'s forward, as its checkpoint calls it) such that its second call of each
        micro-batch, the recomputation in backward, is timed, measured and (``count_saved``) has its saved
        tensors counted. The non-reentrant checkpoint must pass ``count_saved=False``: saved-tensor hooks
        entered inside its recomputation would take the tensors from the checkpoint's own."""

        def run(*args: Any, **kwargs: Any) -> Any:
            self._rc_calls[i] += 1
            if not self.enabled or self._rc_calls[i] % 2:  # the forward, not the recomputation
                return fn(*args, **kwargs)
            t0, s0 = self._now(), self._waited()
            if self.device.type == "cuda":
                self._fold_peaks()
                self._rc_level = torch.cuda.memory_allocated(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
            if count_saved:  # (the hooks count the profiled step's first micro-batch only)
                self._rc_counted[i] = True
                with self.hooks.profile_scope(i, args, kwargs):
                    out = fn(*args, **kwargs)
            else:
                out = fn(*args, **kwargs)
            self.rc[i] += self._now() - t0 - (self._waited() - s0)
            if self.device.type == "cuda":
                self.fwd_peak[i] = torch.cuda.max_memory_allocated(self.device) - self._rc_level
                # the rest of the backward's peak is its workspace, above what the recomputation re-saved
                self._fold_peaks(skip=i)
                if i in self._open:
                    self._open[i] += self.hooks.profile_bytes[i] - self.in_bytes[i]
                torch.cuda.reset_peak_memory_stats(self.device)
            return out

        return run

    def _fwd_pre(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not (self.enabled and torch.is_grad_enabled()):
                return
            x = first_grad_tensor([*args, *kwargs.values()])
            self._has_input = x is not None
            self.in_bytes[i] = sum(self.hooks.storages([*args, *kwargs.values()]).values())
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
            if self.hooks.counting():
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

    def end_warm_step(self) -> None:
        """Call at a warm-up step's end (after the optimizer): its wall time from its first forward, synchronized
        at both ends only, as a training step runs. The first step's is not kept (lazy initialisation)."""
        self._warm_steps += 1
        if self._warm_start is not None and self._warm_steps > 1:
            self.warm_step_s = self._now() - self._warm_start - (self._waited() - self._warm_waited)
        self._warm_start = None

    def finish(self) -> list[LayerProfile]:
        """Call at the profiled step's end (after the optimizer): the layers' profiles; ``outside_s`` is set
        to the step's time outside the layers (their forward and backward intervals, recomputation
        included, subtracted from the last warm-up step's wall time, or without one from the profiled
        step's)."""
        for h in self._handles:
            h.remove()
        # with gradient accumulation the step ran k micro-batches: the times are their mean, as the saved
        # bytes are the first micro-batch's (the planner plans one micro-batch)
        k = max(1, self.hooks.forwards_since_profile)
        self.micro_batches = k
        # not without a warm-up step: the first optimizer step allocates its state, which later steps keep
        if self.device.type == "cuda" and self._tail_open and self._base is not None and self._warm_steps:
            self.outside_peak = max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
        if self._step_start is not None:
            wall = self._now() - self._step_start - (self._waited() - self._step_waited)
            if self.warm_step_s is not None:  # (it ran as this step does, without the synchronizations)
                wall = self.warm_step_s
            self.outside_s = max(0.0, wall - sum(self.fwd) - sum(self.bwd)) / k
        for times in (self.fwd, self.bwd, self.rc, self.sub):
            times[:] = [t / k for t in times]
        # (None where no gap was seen, as where the last layer's backward start is not hooked: not measured, so
        # that the bound takes all of the outside time rather than none)
        head = self.head_t / self._heads if self._heads else None
        rc = self.under_recompute
        return [
            LayerProfile(
                index=i,
                name=f"{type(m).__name__}[{i}]",
                saved_bytes=self.hooks.profile_bytes[i],
                fwd_s=self.rc[i] if rc and self.rc[i] else self.fwd[i],
                bwd_s=max(0.0, self.bwd[i] - self.rc[i]) if rc else self.bwd[i],
                input_bytes=self.in_bytes[i],
                recompute_only=rc and not self._rc_counted[i],
                gap_s=head if i == len(self.layers) - 1 else None,
                saved_sizes=list(self.hooks.profile_sizes[i]),
                sel_saved_bytes=self.hooks.sel_saved_bytes(i) if self.has_sub[i] else None,
                sel_saved_sizes=self.hooks.sel_saved_sizes(i) if self.has_sub[i] else [],
                sel_recompute_s=self.sub[i],
                bwd_workspace_bytes=self.workspace[i],
                fwd_peak_bytes=self.fwd_peak[i],
                fwd_background_bytes=self.fwd_bg[i],
                gap_background_bytes=self.gap_bg[i],
                bwd_background_bytes=self.bwd_bg[i],
            )
            for i, m in enumerate(self.layers)
        ]
