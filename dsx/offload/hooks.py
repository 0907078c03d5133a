"""Per-layer saved-tensor hooks: what autograd saves inside a layer leaves the device and comes back.

Each layer's forward runs inside its own ``torch.autograd.graph.saved_tensors_hooks`` context (entered by
a forward pre-hook, left by the forward hook), so the action can differ per layer. A saved tensor stays
where it is if it lives on another device than the model, shares storage with a parameter (this covers
``weight.t()`` and ZeRO-3's gathered buffers, collected at every layer entry) or is smaller than
``min_tensor_bytes``. Otherwise its whole storage is moved once, however many views of it are saved, and
each view is rebuilt on unpack with its own offset, shape, stride and dtype.

Autograd no longer sees the saved tensor once a pack hook replaces it, so its in-place check would be lost;
each handle keeps a storage-less alias of the saved tensor (``detach()`` shares the version counter, then
its data is dropped) and unpack raises autograd's own error when the version moved.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dsx.offload.transfer import Entry, Mover

__all__ = ["LayerHooks", "find_layers"]


def find_layers(model: nn.Module, layer_classes: list[str] | None) -> list[nn.Module]:
    """Modules whose class name is in ``layer_classes``; by default the items of the largest
    ``nn.ModuleList`` whose items all share one class (the repeated transformer blocks)."""
    if layer_classes:
        names = set(layer_classes)
        layers = [m for m in model.modules() if type(m).__name__ in names]
        unmatched = sorted(names - {type(m).__name__ for m in layers})
        if unmatched:  # a misspelt name beside a right one would silently leave those blocks alone
            lists = sorted(
                {type(c).__name__ for m in model.modules() if isinstance(m, nn.ModuleList) for c in m}
            )
            raise ValueError(
                f"dsx activation offload: layer_classes {unmatched} match no module of {type(model).__name__}; "
                f"classes held in its nn.ModuleLists: {lists}"
            )
        # a layer inside another would be profiled twice (its time in both) and planned on its own while its
        # outer layer's action already covers it
        ids = {id(m) for m in layers}
        for outer in layers:
            inner = next((m for m in outer.modules() if m is not outer and id(m) in ids), None)
            if inner is not None:
                raise ValueError(
                    f"dsx activation offload: layer_classes nest: a {type(inner).__name__} sits inside a "
                    f"{type(outer).__name__}; layers must not nest. Name only the outer class (to recompute "
                    f"a part of each layer, name it in recompute_modules)"
                )
    else:
        best: list[nn.Module] = []
        for m in model.modules():
            if isinstance(m, nn.ModuleList) and len(m) > len(best) and len({type(c) for c in m}) == 1:
                best = list(m)
        layers = best
    if not layers:
        raise ValueError(
            f"dsx activation offload found no layers in {type(model).__name__} (layer_classes={layer_classes}): "
            "no nn.ModuleList holds modules of one class; set activation_offload.layer_classes to the class "
            "names of its repeated blocks"
        )
    return layers


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a module's output: itself, or those one level into a tuple, list or dict."""
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def _holds(ref: weakref.ref, key: tuple[int, int]) -> bool:
    """Whether the tensor behind ``ref`` is alive and still on the storage ``key`` (address, bytes) names.

    Alive is not enough: ``t.data = ...`` (Megatron frees pipeline outputs so) moves a live tensor to another
    storage, and the address it left may come back as a new tensor's, which would be matched to the old bytes.
    """
    t = ref()
    if t is None:
        return False
    st = t.untyped_storage()
    return (st.data_ptr(), st.nbytes()) == key


class _Handle:
    """What autograd keeps instead of the tensor: the moved storage plus how to view it."""

    __slots__ = (
        "__weakref__",
        "conj",
        "dtype",
        "entry",
        "layer",
        "neg",
        "offset",
        "probe",
        "size",
        "stride",
        "version",
    )

    def __init__(self, entry: Entry, layer: int, t: torch.Tensor) -> None:
        self.entry, self.layer = entry, layer
        self.offset, self.size, self.stride, self.dtype = t.storage_offset(), t.size(), t.stride(), t.dtype
        # lazy conjugate and negative views are bits on the tensor, not in its bytes (c.conj() saved by mul)
        self.conj, self.neg = t.is_conj(), t.is_neg()
        probe = t.detach()  # shares t's version counter ...
        probe.data = torch.empty(0, dtype=t.dtype, device=t.device)  # ... but not its memory
        self.probe, self.version = probe, t._version


class LayerHooks:
    """Installs the per-layer hooks; ``actions[i]`` is ``"keep"``, ``"host"``, ``"ssd"`` or ``"profile"``."""

    def __init__(self, model: nn.Module, layers: list[nn.Module], mover: Mover, min_bytes: int) -> None:
        self.model, self.layers, self.mover, self.min_bytes = model, layers, mover, min_bytes
        self.actions: list[str] = ["keep"] * len(layers)
        self.prefetch_depth = 1
        # per layer, then for the start of backward: wait there until the writes of layers <= this value have
        # left the device (the plan's write_barrier; empty: never wait)
        self.write_barrier: list[int] = []
        self.write_barrier_bwd: list[int] = []  # the same at each layer's backward start
        self._fwd_t0: dict[int, float] = {}  # host time each layer's forward began (the trace's spans)
        self._awaited = -1
        # layer -> bytes it may move per step (the planner's partial layers); what is saved beyond stays
        self.move_caps: dict[int, int] = {}
        self._moved_bytes: dict[int, int] = {}
        self._ctx: list[Any] = []
        self._cur: int | None = None
        self._params: set[int] = set()
        # the model's parameter storages, taken at the first moved layer of each forward (None: not yet)
        self._model_params: set[int] | None = None
        # storages of the current layer's inputs that need no gradient: kept like parameters
        self._inputs: set[int] = set()
        # (address, bytes) -> (entry, weak reference to the base tensor, the version its bytes were moved at)
        self._dedup: dict[tuple[int, int], tuple[Entry, weakref.ref, int]] = {}
        self._lock = threading.Lock()
        # handles are released by finalizers, which Python's cyclic GC runs on whatever thread allocates, at
        # any point, holding whatever lock it holds (this one in _pack, an entry's in Mover.fetch): they only
        # queue here, and the queue runs where no dsx lock is held (release_dead())
        self._releases: collections.deque[Entry] = collections.deque()
        self._final_drain = False  # a drain is queued for the end of the running backward
        # storages a kept layer beside a moved one saved this step: (address, bytes) -> (base, version)
        self._kept: dict[tuple[int, int], tuple[weakref.ref, int]] = {}
        self._fetched_layers: set[int] = set()
        self._top_moved = -1  # the last layer the running forward moves (set at its start)
        # each layer's saved storages in the order it saves them (what a partial move takes: its first ones)
        self.profile_sizes: list[list[int]] = [[] for _ in layers]
        self._profile_seen: set[tuple[int, int]] = set()
        self._scope_profile = False  # inside profile_scope(): pack counts, whatever the layer's action
        # bytes are per micro-batch: with gradient accumulation the profiled step has several forwards (and
        # recomputations); only the first one's are counted
        self._forwards = 0
        self._profile_from = 0
        # what each layer would still save with its recompute_modules recomputed, in the order it would save
        # them: storages saved outside them, and their inputs where they are called (the non-reentrant
        # checkpoint saves those); sub_depth > 0 while one of them runs
        self.sub_depth = 0
        self._sel_saved: list[dict[tuple[int, int], int]] = [{} for _ in layers]
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
        with self._lock:  # forget storages that died or were released: the table stays one step long
            self._dedup = {k: v for k, v in self._dedup.items() if _holds(v[1], k) and not v[0].released}

    def _root_post(self, module: nn.Module, args: Any, out: Any) -> None:
        if not torch.is_grad_enabled():  # no backward follows
            return
        self.release_dead()
        if self.write_barrier:
            self.await_writes(self.write_barrier[-1])
        # backward starts with the last layer: bring back what its backward and the next prefetch_depth
        # layers' need as soon as forward is over (the window the planner's cost model assumes: an offloaded
        # layer further down is read later, so its bytes are not back on the device for the whole backward)
        for i in self._moved_from(len(self.actions) - 1):
            self._prefetch_layer(i)

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
            # their read buffers stayed allocated to the end of backward, a 64 MiB block over the budget at
            # hidden 4096 on the H100)
            if upto is None and not self._moved_from(i) and i >= self._top_moved:
                return
            y = next((t for t in _tensors(out) if t.requires_grad), None)
            if y is not None:  # fires once the gradient of the layer's output is known: its backward starts
                y.register_hook(lambda g: self._backward_starts(i, upto))

        return post

    def _beside_moved(self, i: int) -> bool:
        """Whether a neighbour of layer ``i`` moves: a storage two layers save (a layer's output, saved by its
        last op and the next layer's first) is then seen by both, whichever saves it first (``_pack``)."""
        return any(0 <= j < len(self.actions) and self.actions[j] in ("host", "ssd") for j in (i - 1, i + 1))

    def _moved_from(self, i: int) -> list[int]:
        """The moved layers whose reads are due once layer ``i``'s backward starts: ``i`` down to
        ``i - prefetch_depth`` (the window of the planner's model)."""
        return [
            j
            for j in range(i, max(-1, i - 1 - self.prefetch_depth), -1)
            if self.actions[j] in ("host", "ssd")
        ]

    def _backward_starts(self, i: int, upto: int | None) -> None:
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
            stream = torch.cuda.current_stream(self.mover.device)
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

    @property
    def profile_bytes(self) -> list[int]:
        """Per layer, the bytes of the storages it saved in the profiled step's first micro-batch."""
        return [sum(sizes) for sizes in self.profile_sizes]

    @property
    def forwards_since_profile(self) -> int:
        """Micro-batches (grad-enabled model forwards) since :meth:`start_profile`."""
        return self._forwards - self._profile_from

    def start_profile(self) -> None:
        """The coming step is profiled: count the bytes of its first micro-batch."""
        self._profile_from = self._forwards

    def counting(self) -> bool:
        """Whether bytes saved now belong to the profiled step's first micro-batch (forward or recompute)."""
        return self._forwards - self._profile_from <= 1

    def _note_params(self, i: int) -> None:
        """The storages of parameters, kept where they are: the model's, as of this forward's first moved layer,
        and layer ``i``'s own as of now (ZeRO-3 gathers them in its pre-hooks, registered earlier, so they ran
        already). (Walking every parameter of the model at each layer took ~0.1 ms a layer of host time, where
        the GPU can be waiting for the layer's first kernel.)"""
        if self._model_params is None:
            self._model_params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        self._params = self._model_params | {
            p.untyped_storage().data_ptr() for p in self.layers[i].parameters()
        }

    def _note_inputs(self, args: Any, kwargs: dict[str, Any]) -> None:
        """The tensors handed to the layer about to run that need no gradient stay on the device.

        They are what every layer is given alike (attention masks, position embeddings). Moved with the
        first layer that saved them, they tied each later layer's backward to that layer's read: on the H100
        (hidden 4096) the mask waited behind the bulk reads, 130 ms a step.
        """
        values = [*args, *kwargs.values()]
        self._inputs = {
            t.untyped_storage().data_ptr() for v in values for t in _tensors(v) if not t.requires_grad
        }

    @contextlib.contextmanager
    def profile_scope(self, i: int, args: Any = (), kwargs: dict[str, Any] | None = None) -> Iterator[None]:
        """Count what is saved inside the block as layer ``i``'s saved bytes: a recomputation, which the
        layer's forward hooks do not see (the profiling step under recomputation).

        Storages are deduplicated within the block only: between two layers' recomputations the caching
        allocator hands the same addresses out again, so a step-long table would miss bytes.
        """
        prev = self._cur
        self._cur, self._scope_profile = i, True
        self._profile_seen = set()
        self._note_params(i)
        self._note_inputs(args, kwargs or {})
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._cur, self._scope_profile = prev, False

    def storages(self, values: Any) -> dict[tuple[int, int], int]:
        """The storages pack would move among ``values`` (tensors, one level into tuples, lists and dicts):
        (address, bytes) -> bytes."""
        out: dict[tuple[int, int], int] = {}
        for t in (t for v in values for t in _tensors(v)):
            if not self._keep(t):
                st = t.untyped_storage()
                out[(st.data_ptr(), st.nbytes())] = st.nbytes()
        return out

    # -------------------------------------------------------------------------------------- pack
    def _keep(self, t: torch.Tensor) -> bool:
        if t.device != self.mover.device or isinstance(t, nn.Parameter) or t.layout != torch.strided:
            return True
        st = t.untyped_storage()
        ptr = st.data_ptr()
        return st.nbytes() < self.min_bytes or ptr in self._params or ptr in self._inputs

    def _pack(self, t: torch.Tensor) -> Any:
        i = self._cur
        if i is None or self._keep(t):
            return t
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if self._scope_profile or self.actions[i] == "profile":
            if not self.counting():
                return t
            if key not in self._profile_seen:
                self._profile_seen.add(key)
                self.profile_sizes[i].append(key[1])
            if self.sub_depth == 0:
                self._sel_saved[i].setdefault(key, key[1])
            return t
        base = t._base if t._base is not None else t
        self.release_dead()
        with self._lock:
            hit = self._dedup.get(key)
            # the weak reference proves the storage is still the same one (a freed address may be reused), the
            # version that its moved bytes are still its bytes (saved, changed in place, saved again: legal
            # when the first saver never runs backward)
            live = hit is not None and _holds(hit[1], key) and not hit[0].released
            entry = hit[0] if live and hit[2] == t._version else None
            if self.actions[i] == "keep":
                # a kept layer beside a moved one: a storage the neighbour moved already is shared (kept here,
                # it would stay on the device and the move would free nothing); any other is recorded
                if entry is None:
                    self._kept[key] = (weakref.ref(base), t._version)
                    return t
            elif (
                entry is None
                and (k := self._kept.get(key)) is not None
                and _holds(k[0], key)
                and k[1] == t._version
            ):
                return t  # a kept layer holds these bytes: moving them would free nothing
            if entry is None:
                cap = self.move_caps.get(i)
                done = self._moved_bytes.get(i, 0)
                if (
                    cap is not None and done + key[1] > cap
                ):  # a partial layer: its first storages move, to the cap
                    return t
                entry = self.mover.offload(st, i, self.actions[i], name=f"{tuple(t.shape)}:{t.dtype}")
                if entry is None:  # no room in any tier: stays on the device (the mover warned once)
                    return t
                self._moved_bytes[i] = done + key[1]
                self._dedup[key] = (entry, weakref.ref(base), t._version)
            entry.refs += 1
        h = _Handle(entry, i, t)
        weakref.finalize(h, self._release, entry)
        return h

    def note_sub_inputs(self, i: int, values: list[Any]) -> None:
        """Record the storages a recompute module of layer ``i`` takes as input (profiling step)."""
        for key, n in self.storages(values).items():
            self._sel_saved[i].setdefault(key, n)

    def sel_saved_sizes(self, i: int) -> list[int]:
        """The storages layer ``i`` saves with its recompute modules recomputed, in save order (profiled)."""
        return list(self._sel_saved[i].values())

    def sel_saved_bytes(self, i: int) -> int:
        """Bytes layer ``i`` saves with its recompute modules recomputed (measured in the profiling step)."""
        return sum(self._sel_saved[i].values())

    def _release(self, entry: Entry) -> None:
        """A handle died (its finalizer): queued, never run here (see ``_releases``)."""
        self._releases.append(entry)

    def release_dead(self) -> None:
        """Finish the writes whose copies ended (``Mover.poll_writes``), and give back the slots and read
        buffers of entries whose handles all died. Called where this thread holds no dsx lock: each pack and
        unpack, a model forward's start and end, each layer's forward and backward start, the end of a
        backward, a step's end. A finalizer run by the GC during this only queues."""
        self.mover.poll_writes()
        if not self._releases:
            return
        with self._lock:
            while self._releases:
                entry = self._releases.popleft()
                entry.refs -= 1
                if entry.refs == 0:
                    self.mover.release(entry)
        self.mover.poll_writes()  # (slots of released entries whose reads have already run go back now)

    def _drain_after_backward(self) -> None:
        """Release what the backward freed once it ends (the graph's last nodes free their handles after the
        last unpack, and the next safe point would be the next forward: their read buffers would stay on
        the device through the optimizer step)."""
        if self._final_drain:
            return
        self._final_drain = True

        def drain() -> None:
            self._final_drain = False
            self.release_dead()

        try:
            torch.autograd.Variable._execution_engine.queue_callback(drain)
        except RuntimeError:  # not in a backward (a saved tensor read from Python): nothing to wait for
            self._final_drain = False

    # ------------------------------------------------------------------------------------ unpack
    def _prefetch_layer(self, i: int) -> None:
        if i in self._fetched_layers:
            return
        self._fetched_layers.add(i)
        for entry in self.mover.entries_of(i):
            self.mover.fetch(entry)

    def _unpack(self, h: Any) -> torch.Tensor:
        if not isinstance(h, _Handle):
            return h
        self.release_dead()
        self._drain_after_backward()
        if h.probe._version != h.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{h.dtype} {list(h.size)}] is at version {h.probe._version}; expected version "
                f"{h.version} instead. (dsx activation offload, layer {h.layer})"
            )
        # layer h.layer's backward has started (a layer with no output needing a gradient has no start hook)
        for j in self._moved_from(h.layer):
            self._prefetch_layer(j)
        data = self.mover.wait(h.entry)
        out = torch.empty(0, dtype=h.dtype, device=data.device)
        out = out.set_(data.untyped_storage(), h.offset, h.size, h.stride)
        if h.conj:
            out = out.conj()
        if h.neg:
            out = torch._neg_view(out)
        return out

    def remove(self) -> None:
        self.release_dead()
        while self._ctx:
            self._ctx.pop().__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
