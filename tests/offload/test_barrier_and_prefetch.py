"""When the runtime waits and reads on CPU: the write barrier in forward and backward, the prefetch window,
read buffers given back as backward goes, and which pool read buffers come from."""

from __future__ import annotations

import pytest
import torch

from dsx.config import SchedulerConfig
from dsx.offload import ActivationOffload
from dsx.offload.plan import Action
from dsx.runtime.scheduler import Scheduler
from tests.offload._offload_models import TinyGPT, assert_same_grads
from tests.offload._runs import (
    _cfg,
    _reference,
    _train,
)


@pytest.mark.parametrize("barrier", [True, False])
def test_write_barrier_holds_the_forward_until_earlier_layers_left_the_device(tmp_path, barrier):
    """With the write barrier (``offload_all``'s fixed rule, on by default), layer j's forward starts only
    once the bytes layers <= j - 2 moved have left the device (the allocator then sees them freed before j
    allocates); the single I/O thread is kept busy for 0.5 s so that the writes are late. With
    ``write_barrier: "off"`` the forward runs ahead of them (this check can fail). Gradients stay bitwise
    equal either way."""
    import threading

    model, batches, want = _reference(21, 2)
    sched = Scheduler(SchedulerConfig(io_workers=1))
    cfg = _cfg(tmp_path, ["host"]) if barrier else _cfg(tmp_path, ["host"], write_barrier="off")
    off = ActivationOffload(model, cfg, sched)
    n = len(off.hooks.layers)
    assert n >= 3
    fixed = ([max(-1, j - 2) for j in range(n)] + [n - 1], [])
    assert (off.hooks.write_barrier, off.hooks.write_barrier_bwd) == (fixed if barrier else ([], []))
    seen: list[bool] = []

    def probe(j):
        def hook(module, args):
            if torch.is_grad_enabled() and j >= 2:
                entries = [e for i in range(j - 1) for e in off.mover.entries_of(i)]
                seen.append(bool(entries) and all(e.off_device.is_set() and e.src is None for e in entries))

        return hook

    handles = [layer.register_forward_pre_hook(probe(j)) for j, layer in enumerate(off.hooks.layers)]
    busy = threading.Event()
    sched.submit(busy.wait)  # the I/O thread is taken: layer 0's write waits behind this
    threading.Timer(0.5, busy.set).start()
    try:
        got = _train(model, batches, off)
    finally:
        busy.set()
        for h in handles:
            h.remove()
        off.close()
        sched.close()
    assert_same_grads(want, got)
    assert len(seen) == 2 * (n - 2)
    # the waits are reported as stall under their own name (the benchmarks' stall_by)
    waited = [r.stall_by.get("write-barrier", 0.0) for r in sched.telemetry.history]
    if barrier:
        assert all(seen), seen
        assert waited[0] > 0, sched.telemetry.history[0]
    else:
        assert not seen[0], "the forward ran ahead of the writes: the check above can fail"
        assert not any(waited), waited


@pytest.mark.parametrize("barrier", [True, False])
def test_backward_write_barrier_waits_at_the_layer_backward_start(tmp_path, barrier):
    """The backward side of the barrier: at the last layer's backward start (a hook on its output's
    gradient) the writes of every layer have left the device; the forward does not wait at all here. The
    single I/O thread is kept busy for 0.5 s so that the writes are late; without the barrier the check
    sees them unfinished (it can fail)."""
    import threading

    model, batches, want = _reference(22, 2)
    sched = Scheduler(SchedulerConfig(io_workers=1))
    off = ActivationOffload(model, _cfg(tmp_path, ["host"], write_barrier="off"), sched)
    layers = off.hooks.layers
    n = len(layers)
    if barrier:
        off.hooks.write_barrier = [-1] * (n + 1)
        off.hooks.write_barrier_bwd = [n - 1] * n
    seen: list[bool] = []

    def check(_g):
        entries = [e for i in range(n) for e in off.mover.entries_of(i)]
        seen.append(bool(entries) and all(e.off_device.is_set() for e in entries))

    def post(module, args, out):  # registered after dsx's hook: its gradient hook runs after dsx's
        if torch.is_grad_enabled():
            out.register_hook(check)

    handle = layers[-1].register_forward_hook(post)
    busy = threading.Event()
    sched.submit(busy.wait)
    threading.Timer(0.5, busy.set).start()
    try:
        got = _train(model, batches, off)
    finally:
        busy.set()
        handle.remove()
        off.close()
        sched.close()
    assert_same_grads(want, got)
    assert len(seen) == 2
    assert seen[0] if barrier else not seen[0], seen


@pytest.mark.parametrize("depth", [1, 2])
def test_reads_start_at_the_backward_of_the_layer_depth_above(tmp_path, depth):
    """A moved layer under kept ones is read back from the backward start of the layer ``depth`` above it
    (the planner's window), though the kept layers have nothing to unpack; left to its own first unpack, its
    read would start only as its backward needs it."""
    model, batches, want = _reference(9, 2, make=lambda: TinyGPT(layers=4))
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(model, _cfg(tmp_path, ["host"], host_pool_gb=0.2), sched)
    issued_at: list[list[bool]] = []

    def watch(module, args, out):  # registered after dsx's hook: its tensor hook fires after dsx's
        out.register_hook(
            lambda g: issued_at.append([e.fetched is not None for e in off.mover.entries_of(0)])
        )

    handle = off.layers[depth].register_forward_hook(watch)
    try:
        off._apply([Action.HOST] + [Action.KEEP] * 3, depth)
        got = _train(model, batches, off)
    finally:
        handle.remove()
        off.close()
        sched.close()
    assert len(issued_at) == len(batches)
    assert all(step and all(step) for step in issued_at), issued_at
    assert_same_grads(want, got)


def test_a_moved_layers_read_buffers_go_back_before_the_recomputed_layers_below_run(tmp_path):
    """Layers recomputed (or kept) below a moved one have no unpack of their own: the moved layer's last
    handles die after its last unpack, and their entries (with the read buffers) must be released as the
    layer below starts its backward, not at the end of backward, where they sat through the recomputed layers'
    backward (over a budget set at full recompute's peak)."""
    model, batches, want = _reference(23, 2, make=lambda: TinyGPT(layers=4))
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(model, _cfg(tmp_path, ["host"], host_pool_gb=0.2, write_barrier="off"), sched)
    left: list[int] = []

    def watch(module, args, out):  # registered after dsx's hook: its tensor hook fires after dsx's
        if torch.is_grad_enabled():
            out.register_hook(lambda g: left.append(len(off.mover.entries_of(2))))

    handle = off.layers[1].register_forward_hook(watch)
    try:
        off._apply([Action.RECOMPUTE, Action.RECOMPUTE, Action.HOST, Action.KEEP], 1)
        got = _train(model, batches, off)
    finally:
        handle.remove()
        off.close()
        sched.close()
    assert len(left) == len(batches), left
    assert left == [0] * len(batches), f"layer 2's entries still held at layer 1's backward start: {left}"
    assert_same_grads(want, got)


@pytest.mark.parametrize(
    "setting,budget_gb,pool",
    [
        ("auto", None, "prefetch"),
        ("auto", 4.0, "compute"),
        ("compute", None, "compute"),
        ("prefetch", 4.0, "prefetch"),
    ],
)
def test_read_pool_setting(tmp_path, setting, budget_gb, pool):
    """``auto`` reads into the compute stream's pool only under a budget, where one pool keeps the allocator
    from fragmenting; a hide-only plan keeps the copies' head start (the pool matters on CUDA only)."""
    model = TinyGPT()
    sched = Scheduler()
    cfg = _cfg(tmp_path, ["host"], policy="auto", read_pool=setting, memory_budget_gb=budget_gb)
    off = ActivationOffload(model, cfg, sched)
    try:
        assert off.mover.read_pool == pool
    finally:
        off.close()
        sched.close()
    with pytest.raises(ValueError, match="read_pool"):
        _cfg(tmp_path, ["host"], read_pool="managed")
