"""What a saved tensor becomes: moved once per storage, rebuilt as the same view, checked for in-place changes.

A saved tensor stays where it is if it lives on another device than the model, shares storage with a
parameter (this covers ``weight.t()`` and ZeRO-3's gathered buffers, collected at every layer entry) or is
smaller than ``min_tensor_bytes``. Otherwise its whole storage is moved once, however many views of it are
saved, and each view is rebuilt on unpack with its own offset, shape, stride and dtype.

Autograd no longer sees the saved tensor once a pack hook replaces it, so its in-place check would be lost;
each handle keeps a storage-less alias of the saved tensor (``detach()`` shares the version counter, then
its data is dropped) and unpack raises autograd's own error when the version moved.

:class:`SavedTensorHooks` also counts what each layer saves in the profiling step, and releases the entries
of handles autograd dropped. Which layer is running, and so which action applies, is
:class:`~dsx.offload.hooks.LayerHooks`'s part.
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

from dsx.offload.entry import Entry
from dsx.offload.plan.types import cap_floor
from dsx.offload.transfer import Mover

__all__ = ["SavedTensorHooks", "tensors_of"]


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors of a module's output or argument: itself, or those one level into a tuple, list or dict."""
    items = (
        value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else (value,)
    )
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


class SavedTensorHooks:
    """The pack and unpack hooks of the layers' saved tensors, the profiling step's counts and the release of
    dropped handles; ``actions[i]`` is ``"keep"``, ``"host"``, ``"ssd"`` or ``"profile"`` (the tier of the
    plan's :class:`~dsx.offload.plan.Action`, or the profiling step's count)."""

    def __init__(self, model: nn.Module, layers: list[nn.Module], mover: Mover, min_bytes: int) -> None:
        self.model, self.layers, self.mover, self.min_bytes = model, layers, mover, min_bytes
        self.actions: list[str] = ["keep"] * len(layers)
        self.prefetch_depth = 1
        # layer -> bytes it may move per step (the planner's partial layers; a MoveCap also names the smallest
        # storage that moves); what is saved beyond stays
        self.move_caps: dict[int, int] = {}
        self._moved_bytes: dict[int, int] = {}
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
        # each layer's saved storages in the order it saves them (a partial move takes, in that order, those of
        # at least its cap's floor that fit under the cap)
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

    def _moved_from(self, i: int) -> list[int]:
        """The moved layers whose reads are due once layer ``i``'s backward starts: ``i`` down to
        ``i - prefetch_depth`` (the window of the planner's model)."""
        return [
            j
            for j in range(i, max(-1, i - 1 - self.prefetch_depth), -1)
            if self.actions[j] in ("host", "ssd")
        ]

    def moved_bytes(self, i: int) -> int:
        """Bytes layer ``i`` moved off the device in the running forward."""
        return self._moved_bytes.get(i, 0)

    def read_back(self, i: int) -> bool:
        """Whether layer ``i``'s moved bytes are on the device again in the running backward: asked back, and
        every read's buffer allocated. With ``read_pool="compute"`` on CUDA each buffer is allocated when the
        read is asked for, whether the read has run or not (an SSD read can take longer than a layer's
        backward). Otherwise this says yes once the read is done: a read queued on this thread is done when
        asked; an I/O thread's allocates its buffer before its copy, and until the read ends (after the copy,
        for a staged SSD read or a verified one) what is on the device is counted as background."""
        at_issue = self.mover.buffer_at_issue
        return i in self._fetched_layers and all(
            e.fetched is not None and (at_issue or e.fetched.done()) for e in self.mover.entries_of(i)
        )

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
        already). (Walking every parameter of the model at each layer cost host time at every layer, where the
        GPU can be waiting for the layer's first kernel.)"""
        if self._model_params is None:
            self._model_params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        self._params = self._model_params | {
            p.untyped_storage().data_ptr() for p in self.layers[i].parameters()
        }

    def _note_inputs(self, args: Any, kwargs: dict[str, Any]) -> None:
        """The tensors handed to the layer about to run that need no gradient stay on the device.

        They are what every layer is given alike (attention masks, position embeddings). Moved with the
        first layer that saved them, they tied each later layer's backward to that layer's read: the mask
        waited behind the bulk reads.
        """
        values = [*args, *kwargs.values()]
        self._inputs = {
            t.untyped_storage().data_ptr() for v in values for t in tensors_of(v) if not t.requires_grad
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
        for t in (t for v in values for t in tensors_of(v)):
            if not self._keep(t):
                st = t.untyped_storage()
                out[(st.data_ptr(), st.nbytes())] = st.nbytes()
        return out

    # -------------------------------------------------------------------------------------- pack
    def _forget_dead(self) -> None:
        """Forget storages that died or were released (at each forward's start): the table stays one step
        long."""
        with self._lock:
            self._dedup = {k: v for k, v in self._dedup.items() if _holds(v[1], k) and not v[0].released}

    def _keep(self, t: torch.Tensor) -> bool:
        if t.device != self.mover.device or isinstance(t, nn.Parameter) or t.layout != torch.strided:
            return True
        st = t.untyped_storage()
        ptr = st.data_ptr()
        return st.nbytes() < self.min_bytes or ptr in self._params or ptr in self._inputs

    def _pack(self, t: torch.Tensor) -> Any:
        i = self._cur
        if i is None or self._scope_profile or self.actions[i] == "profile":
            return self._pack_in(i, t)
        t0 = time.perf_counter()  # the host time a step's hooks take is telemetry's hook_s
        try:
            return self._pack_in(i, t)
        finally:
            self.mover.sched.telemetry.add_hook(time.perf_counter() - t0)

    def _pack_in(self, i: int | None, t: torch.Tensor) -> Any:
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
                # a partial layer: its first storages (of at least the cap's floor) move, to the cap
                if cap is not None and (done + key[1] > cap or key[1] < cap_floor(cap)):
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
        t0 = time.perf_counter()
        try:
            return self._unpack_handle(h)
        finally:
            self.mover.sched.telemetry.add_hook(time.perf_counter() - t0)

    def _unpack_handle(self, h: _Handle) -> torch.Tensor:
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
