"""Per-layer saved-tensor hooks: what autograd saves inside a layer leaves the device and comes back.

Each layer's forward runs inside its own ``torch.autograd.graph.saved_tensors_hooks`` context (entered by
a forward pre-hook, left by the forward hook), so the action can differ per layer. The hooks here scope the
layers, wait for writes where the plan's write barrier says, and issue each backward's reads a prefetch window
ahead; what a saved tensor becomes is :mod:`dsx.offload.saved`'s part.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from dsx.offload.saved import SavedTensorHooks, tensors_of
from dsx.offload.transfer import Mover
from dsx.runtime.streams import current_stream

__all__ = ["LayerHooks"]


class LayerHooks(SavedTensorHooks):
    """Installs the per-layer hooks; ``actions[i]`` is ``"keep"``, ``"host"``, ``"ssd"`` or ``"profile"``."""

    def __init__(self, model: nn.Module, layers: list[nn.Module], mover: Mover, min_bytes: int) -> None:
        super().__init__(model, layers, mover, min_bytes)
        # per layer, then for the start of backward: wait there until the writes of layers <= this value have
        # left the device (the plan's write_barrier; empty: never wait)
        self.write_barrier: list[int] = []
        self.write_barrier_bwd: list[int] = []  # the same at each layer's backward start
        self._fwd_t0: dict[int, float] = {}  # host time each layer's forward began (the trace's spans)
        self._awaited = -1
        self._ctx: list[Any] = []
        self._top_moved = -1  # the last layer the running forward moves (set at its start)
        self._handles: list[Any] = [model.register_forward_pre_hook(self._root_pre)]
        self._handles.append(model.register_forward_hook(self._root_post))
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._make_pre(i), with_kwargs=True))
            # always_call: a forward that raises still closes the layer's saved-tensor hooks, which would
            # otherwise stay on the thread's stack (under, and popped by, any hooks the caller opened around
            # the model) until the next forward
            self._handles.append(layer.register_forward_hook(self._make_post(i), always_call=True))

    # -------------------------------------------------------------------------------- layer scoping
    def _root_pre(self, module: nn.Module, args: Any) -> None:
        # a forward under no_grad (an evaluation between micro-batches) saves nothing and is no micro-batch:
        # counting it would end the profiled step's byte count before its recomputations run
        self.release_dead()
        self._final_drain = False  # (a backward that raised never ran its final callback)
        if not torch.is_grad_enabled():
            return
        self._forwards += 1
        self._awaited = -1
        while self._ctx:  # a forward that raised left a layer context open: close it now
            self._ctx.pop().__exit__(None, None, None)
        self._cur = None
        # (taken only if a layer of this forward moves: keep-only forwards pay nothing)
        self._model_params = None
        self._fetched_layers.clear()
        self._moved_bytes.clear()
        self._kept.clear()
        # the last layer this forward moves (actions change between steps only): see _make_post's hook
        self._top_moved = max((j for j, a in enumerate(self.actions) if a in ("host", "ssd")), default=-1)
        self._forget_dead()

    def _root_post(self, module: nn.Module, args: Any, out: Any) -> None:
        if not torch.is_grad_enabled():  # no backward follows
            return
        self.release_dead()
        if self.write_barrier:
            self.await_writes(self.write_barrier[-1])
        # backward starts with the last layer: bring back what its backward and the next prefetch_depth
        # layers' need as soon as forward is over (the window the planner's cost model assumes: an offloaded
        # layer further down is read later, so its bytes are not back on the device for the whole backward)
        t0 = time.perf_counter()  # (issuing reads is offload host time: telemetry's hook_s)
        due = self._moved_from(len(self.actions) - 1)
        for i in due:
            self._prefetch_layer(i)
        if due:
            self.mover.sched.telemetry.add_hook(time.perf_counter() - t0)

    def _make_pre(self, i: int) -> Any:
        def pre(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            if not torch.is_grad_enabled():
                return
            self.release_dead()  # (a run of kept layers packs nothing: their starts see copies end)
            if self.write_barrier and self._cur is None:  # not inside another layer (a recomputation)
                self.await_writes(self.write_barrier[i])
            self._fwd_t0[i] = time.perf_counter()  # the trace's host-side layer span (after any wait)
            self._note_inputs(args, kwargs)  # (for keep layers too: the profiler counts inputs through it)
            if self.actions[i] == "keep" and not self._beside_moved(i):
                return
            self._cur = i
            self._note_params(i)
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            ctx.__enter__()
            self._ctx.append(ctx)

        return pre

    def _make_post(self, i: int) -> Any:
        def post(module: nn.Module, args: Any, out: Any) -> None:
            if self._cur == i and self._ctx:
                self._ctx.pop().__exit__(None, None, None)
                self._cur = None
            if i in self._fwd_t0:  # (a recomputation calls the layer's forward without its hooks)
                t0 = self._fwd_t0.pop(i)
                self.mover.sched.telemetry.add_event("layers", f"forward {i}", t0, time.perf_counter())
            if not torch.is_grad_enabled():
                return
            # the autograd thread runs ahead of the GPU as the forward did: wait at this layer's backward
            # start for the writes the model has finished by then (else forward's end waited already)
            bwd, at_end = self.write_barrier_bwd, (self.write_barrier or [-1])[-1]
            upto = bwd[i] if bwd and bwd[i] > at_end else None
            # (below a moved layer the hook also releases what that layer's backward freed: its last handles
            # die after its last unpack, and kept or recomputed layers have no unpack that would release them;
            # their read buffers stayed allocated to the end of backward, over a tight budget)
            if upto is None and not self._moved_from(i) and i >= self._top_moved:
                return
            y = next((t for t in tensors_of(out) if t.requires_grad), None)
            if y is not None:  # fires once the gradient of the layer's output is known: its backward starts
                y.register_hook(lambda g: self._backward_starts(i, upto))

        return post

    def _beside_moved(self, i: int) -> bool:
        """Whether a neighbour of layer ``i`` moves: a storage two layers save (a layer's output, saved by its
        last op and the next layer's first) is then seen by both, whichever saves it first (``_pack``)."""
        return any(0 <= j < len(self.actions) and self.actions[j] in ("host", "ssd") for j in (i - 1, i + 1))

    def _backward_starts(self, i: int, upto: int | None) -> None:
        t0 = time.perf_counter()
        try:
            self._backward_starts_in(i, upto)
        finally:
            self.mover.sched.telemetry.add_hook(time.perf_counter() - t0)

    def _backward_starts_in(self, i: int, upto: int | None) -> None:
        self.release_dead()
        self._drain_after_backward()
        if upto is not None:
            self.await_writes(upto)
        # issued here even when layer i itself is kept (it has nothing to unpack): the reads below it get
        # the whole window; left to the first unpack of a moved layer, they would start only as it is needed
        for j in self._moved_from(i):
            self._prefetch_layer(j)

    def await_writes(self, upto: int) -> None:
        """Block the host until the bytes layers ``<= upto`` moved in this forward have left the device.

        The copies run on a side stream while the host goes on queueing kernels, so the host is ahead of the
        GPU; the caching allocator sees a freed block only when the host does, and without this wait later
        layers would be allocated (in host order) before earlier layers' bytes are released. The plan puts
        the wait where its model has the copies already done, so the host waits only as long as the copies
        run late, and the wait is logged as a stall.
        """
        if upto <= self._awaited:
            return
        late = [  # (every caller has just polled: copies that ended are not counted late)
            e
            for layer in range(self._awaited + 1, upto + 1)
            for e in self.mover.entries_of(layer)
            if not e.off_device.is_set()
        ]
        self._awaited = upto
        if not late:
            return
        name = f"write-barrier:layer{upto}"
        cuda = self.mover.device.type == "cuda"
        if cuda:  # what the wait costs the GPU: the time it idles between the work queued so far and the next
            stream = current_stream(self.mover.device)
            reached = torch.cuda.Event(enable_timing=True)
            reached.record(stream)
        t0 = time.perf_counter()
        for e in late:
            self.mover.wait_off_device(e)
        self.mover.sched.telemetry.add_stall(t0, time.perf_counter(), name)
        if cuda:
            resumed = torch.cuda.Event(enable_timing=True)
            resumed.record(stream)
            self.mover.sched.telemetry.add_gpu_wait(reached, resumed, name)

    def remove(self) -> None:
        self.release_dead()
        while self._ctx:
            self._ctx.pop().__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
