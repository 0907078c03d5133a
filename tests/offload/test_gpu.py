"""Activation offload on one GPU: bitwise gradients per tier and backend, device memory actually freed."""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import threading

import pytest
import torch

from dsx.config import ActivationOffloadConfig, SchedulerConfig
from dsx.offload import ActivationOffload, OffloadIntegrityError
from dsx.offload.io import describe_backends
from dsx.runtime import allocator
from dsx.runtime.scheduler import Scheduler
from tests.offload._offload_models import TinyGPT, assert_same_grads
from tests.offload._runs import slow_ssd_reads

pytestmark = pytest.mark.gpu


def _train(model, batches, off=None, hold=None, between=None):
    """AdamW steps; each step's gradients. ``hold``: a stream that gets ~1 s of GPU sleep queued before each
    forward (longer than a warm step takes the host to queue; a shorter sleep was outlasted); ``between()``
    runs after each forward."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    grads = []
    for x in batches:
        opt.zero_grad()
        if hold is not None:
            with torch.cuda.stream(hold):
                torch.cuda._sleep(2_000_000_000)
        loss = model(x).float().pow(2).mean()
        if between is not None:
            between()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        if off is not None:
            off.end_step()
    return grads


def _reference(seed: int, n_batches: int):
    """A small GPT on the GPU, its batches, and the gradients of training a copy of it without offload."""
    torch.manual_seed(0)
    ref = TinyGPT(vocab=256, d=256, layers=4, heads=8, seq=128).cuda()
    model = copy.deepcopy(ref)
    g = torch.Generator(device="cuda").manual_seed(seed)
    batches = [torch.randint(0, 256, (8, 128), device="cuda", generator=g) for _ in range(n_batches)]
    return model, batches, _train(ref, batches)


def _host_all(seed: int, n_batches: int, **cfg_kw):
    """``_reference``'s model, batches and gradients, and a config moving every layer's tensors (all sizes) to a
    1 GB host pool; skips without CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, batches, want = _reference(seed=seed, n_batches=n_batches)
    cfg = ActivationOffloadConfig(enabled=True, tiers=["host"], policy="offload_all", host_pool_gb=1,
                                  min_tensor_bytes=0, **cfg_kw)  # fmt: skip
    return model, batches, want, cfg


@contextlib.contextmanager
def _offloaded(model, cfg, **sched_kw):
    """The model under activation offload with ``cfg`` and a CUDA scheduler (4 I/O threads, ``sched_kw``)."""
    sched = Scheduler(SchedulerConfig(io_workers=4, **sched_kw), device=torch.device("cuda"))
    off = ActivationOffload(model, cfg, sched)
    try:
        yield off, sched
    finally:
        off.close()
        sched.close()


def _measured_step(model, opt, x, off=None) -> int:
    """One training step; its activation peak (max_memory_allocated above the level it started at)."""
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model(x).float().pow(2).mean().backward()
    opt.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    if off is not None:
        off.end_step()
    return peak


@pytest.mark.parametrize(
    "tiers,backend,sel,read_pool,verify",
    [
        (["host"], "posix", False, "compute", True),
        (["ssd"], "posix", False, "compute", True),
        (["host", "ssd"], "aio", False, "compute", True),
        (["host", "ssd"], "kvikio", False, "compute", True),
        (["host"], "posix", True, "compute", True),  # recompute_modules: attention recomputed, the rest moved
        (
            ["host"],
            "posix",
            False,
            "prefetch",
            True,
        ),  # read buffers from the side stream's pool
        (["ssd"], "posix", False, "prefetch", True),
        # without verify, host reads are queued on the fetching thread, ordered after their writes on the GPU
        (["host"], "posix", False, "compute", False),
        (["host"], "posix", False, "prefetch", False),
        (["host"], "posix", True, "prefetch", False),
    ],
)
def test_gpu_bitwise(tmp_path, tiers, backend, sel, read_pool, verify):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if backend != "posix" and not describe_backends()[backend]["available"]:
        pytest.skip(f"{backend}: {describe_backends()[backend]['reason']}")
    model, batches, want = _reference(seed=1, n_batches=3)
    (tmp_path / "ssd").mkdir()
    cfg = ActivationOffloadConfig(
        enabled=True,
        tiers=tiers,
        ssd_path=str(tmp_path / "ssd"),
        policy="offload_all",
        host_pool_gb=1,
        ssd_capacity_gb=1,
        min_tensor_bytes=0,
        io_backend=backend,
        verify=verify,
        recompute_modules=["CoreAttention"] if sel else [],
        read_pool=read_pool,
    )
    sched = Scheduler(SchedulerConfig(io_workers=4), device=torch.device("cuda"))
    off = ActivationOffload(model, cfg, sched)
    try:
        assert off.mover.read_pool == read_pool
        inline = []  # which path each read took: the test must cover the one it names
        reads_inline = off.mover._reads_inline
        off.mover._reads_inline = lambda e: inline.append(reads_inline(e)) or inline[-1]
        got = _train(model, batches, off)
        assert inline and all(inline) == (tiers == ["host"] and not verify) and any(inline) == all(inline)
        assert sum(sched.telemetry.history[0].bytes_by_tier.values()) > 0
        # every read's device-side wait was timed and resolved (zero when the data were back in time), and
        # the write barrier's (offload_all holds it), when the writes were late
        summary = sched.telemetry.summary()
        assert {"unpack"} <= set(summary["gpu_wait_by"]) <= {"unpack", "write-barrier"}
        assert summary["gpu_wait_s"] >= 0.0
    finally:
        off.close()
        sched.close()
    assert_same_grads(want, got)


@pytest.mark.parametrize("event_wait", ["spin", "poll"])
def test_gpu_bitwise_whichever_way_the_io_threads_wait(tmp_path, event_wait):
    """The I/O threads' wait for each write (scheduler.event_wait) decides when a slot is reused and when an SSD
    write starts: gradients stay bitwise, through the host and the SSD tier."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, batches, want = _reference(seed=3, n_batches=3)
    (tmp_path / "ssd").mkdir()
    cfg = ActivationOffloadConfig(enabled=True, tiers=["host", "ssd"], ssd_path=str(tmp_path / "ssd"),
                                  policy="offload_all", host_pool_gb=1, ssd_capacity_gb=1, min_tensor_bytes=0,
                                  io_backend="posix")  # fmt: skip
    with _offloaded(model, cfg, event_wait=event_wait) as (off, sched):
        assert sched.waiter.mode == event_wait
        got = _train(model, batches, off)
        assert sched.telemetry.history[0].bytes_by_tier.get("ssd", 0) > 0
    assert_same_grads(want, got)


@pytest.mark.parametrize("read_pool", ["compute", "prefetch"])
def test_gpu_late_reads_are_waited_for_once_per_run_of_the_stream(tmp_path, read_pool):
    """The compute stream waits for a read's copy unless it already waited for a later one (the prefetch stream
    ends copies in order). With the prefetch stream held back past the forward (a sleep queued on it), every
    read lands late: the gradients must still be bitwise, with fewer device-side waits than reads."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, batches, want = _reference(seed=4, n_batches=3)
    cfg = ActivationOffloadConfig(enabled=True, tiers=["host"], policy="offload_all", host_pool_gb=1,
                                  min_tensor_bytes=0, read_pool=read_pool)  # fmt: skip
    with _offloaded(model, cfg) as (off, sched):
        got = _train(model, batches, off, hold=sched.stream("prefetch"))  # (reads queued after the sleep)
        reads, waits = off.mover._read_seq, off.mover.device_waits
        waited_s = sched.telemetry.summary()["gpu_wait_s"]
    assert waited_s > 0.05, f"the reads were not late ({waited_s} s waited): the test checked nothing"
    assert 0 < waits < reads
    assert_same_grads(want, got)


@pytest.mark.parametrize("read_pool", ["compute", "prefetch"])
def test_gpu_host_reads_wait_for_their_writes_on_the_gpu(tmp_path, read_pool):
    """Host reads queued on the fetching thread (no verify) are ordered after their writes by an event, not by
    a host wait: with the offload stream held back (a sleep queued on it), every copy out lands after the
    forward has ended on the host and the copies back are queued; they must still read what was written. (The
    write barrier, which would hold the host until the writes land, is off.)"""
    model, batches, want, cfg = _host_all(2, 3, read_pool=read_pool, write_barrier="off")
    late = []
    with _offloaded(model, cfg) as (off, sched):

        def count_late() -> None:  # writes not landed when the forward has ended on the host
            late.append(sum(not e.copied.query() for i in range(4) for e in off.mover.entries_of(i)))

        got = _train(model, batches, off, hold=sched.stream("offload"), between=count_late)
    # (the first step's host work, cold, can outlast the sleep)
    assert all(n > 0 for n in late[1:]), (
        f"writes had landed before backward: the test checked nothing ({late})"
    )
    assert_same_grads(want, got)


def test_gpu_memory_released_during_forward(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(0)
    model = TinyGPT(vocab=256, d=512, layers=6, heads=8, seq=256).cuda()
    x = torch.randint(0, 256, (16, 256), device="cuda")

    def peak(off=None):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        y = model(x).float().pow(2).mean()
        if off is not None:
            off.mover.drain()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        y.backward()
        model.zero_grad(set_to_none=True)
        return held

    plain = peak()
    cfg = ActivationOffloadConfig(
        enabled=True, tiers=["host"], policy="offload_all", host_pool_gb=4, min_tensor_bytes=1 << 16
    )
    sched = Scheduler(device=torch.device("cuda"))
    off = ActivationOffload(model, cfg, sched)
    try:
        offloaded = peak(off)
    finally:
        off.close()
        sched.close()
    assert offloaded < 0.5 * plain, (plain, offloaded)


def test_gpu_dropped_graph_gives_read_buffers_back(tmp_path):
    """A forward whose graph is dropped without backward after its reads were issued (forward's end
    prefetches the last layers): by the step's end the read buffers are given back (to be reused only after
    their copies: ``Mover._drop_unread``, which ``memory_allocated`` does not see), nothing stays allocated, and
    the next steps still give the gradients of a run without offload."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, batches, want = _reference(seed=2, n_batches=2)
    cfg = ActivationOffloadConfig(enabled=True, tiers=["host"], policy="offload_all", host_pool_gb=1,
                                  min_tensor_bytes=0, read_pool="compute")  # fmt: skip
    sched = Scheduler(SchedulerConfig(io_workers=4), device=torch.device("cuda"))
    off = ActivationOffload(model, cfg, sched)
    try:
        gc.collect()  # (what earlier tests left in reference cycles would be freed below, under `before`)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = model(batches[0]).float().pow(2).mean()
        issued = [e for i in range(4) for e in off.mover.entries_of(i) if e.fetched is not None]
        assert issued  # forward's end issued the last layer's reads
        del y
        gc.collect()
        # the dead handles' entries are released at the step's end (handle finalizers only queue them), and
        # each unread buffer with them; the writes' device bytes go back once the step's end sees their
        # copies ended (Mover.poll_writes: the synchronize makes sure they have)
        torch.cuda.synchronize()
        off.end_step()
        assert torch.cuda.memory_allocated() == before
        got = _train(model, batches, off)
    finally:
        off.close()
        sched.close()
    assert_same_grads(want, got)


def test_gpu_host_writes_need_no_io_thread(tmp_path):
    """Host-tier writes finish on the threads that queue the GPU's work (an event query at each hook): without
    ``verify`` no I/O thread is started, none spins in ``cudaEventSynchronize``, and the gradients are those of
    a run without offload. With ``verify`` the writes still need none (their checksums are queued on the GPU
    with the copies), but each read is checked on an I/O thread, which waits for its copy back."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")

    def io_threads() -> int:
        return sum(t.name.startswith("dsx-io") for t in threading.enumerate())

    for verify in (False, True):
        model, batches, want = _reference(seed=4, n_batches=3)
        cfg = ActivationOffloadConfig(enabled=True, tiers=["host"], policy="offload_all", host_pool_gb=1,
                                      min_tensor_bytes=0, verify=verify)  # fmt: skip
        assert io_threads() == 0
        with _offloaded(model, cfg) as (off, sched):
            got = _train(model, batches, off)
            started = io_threads()
            moved = sum(r.bytes_by_tier.get("host", 0) for r in sched.telemetry.history)
            # every copy has ended; the next forward's first hook sees them all (no drain: the hooks' polls
            # are what gives the device memory back)
            torch.cuda.synchronize()
            with torch.no_grad():
                model(batches[0])
            left = len(off.mover._in_flight)
        assert moved > 0
        assert (started > 0) == verify, (verify, started)
        assert left == 0
        assert_same_grads(want, got)


def test_gpu_slots_of_a_graph_dropped_while_its_writes_copy_wait_for_the_copies(tmp_path):
    """A graph dropped before its writes' copies end (the offload stream held back by a sleep): its entries
    are released at the step's end, but their host slots, which the copies are still writing, go back only
    once the copies are seen to end; the next steps give the gradients of a run without offload. (The write
    barrier, which would hold the forward until the copies end, is off.)"""
    model, batches, want, cfg = _host_all(5, 2, write_barrier="off")
    with _offloaded(model, cfg) as (off, sched):
        # a warm step first, parameters unchanged: the first pack allocates the pinned pool (seconds)
        model(batches[0]).float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
        off.end_step()
        torch.cuda.synchronize()
        with torch.cuda.stream(sched.stream("offload")):  # ~2 s: longer than gc.collect() below takes, also
            torch.cuda._sleep(4_000_000_000)  # late in the suite
        y = model(batches[0]).float().pow(2).mean()
        used = off.mover.host.arena.used
        del y
        gc.collect()
        off.end_step()  # releases every entry of the dropped graph
        in_flight = sum(not e.copied.query() for e, _ in off.mover._in_flight)
        assert in_flight > 0, "the copies ended before the step's end: the test checked nothing"
        assert off.mover.host.arena.used == used  # no slot given back while its copy runs
        torch.cuda.synchronize()
        off.mover.poll_writes()
        assert off.mover.host.arena.used == 0
        got = _train(model, batches, off)
    assert_same_grads(want, got)


@pytest.mark.parametrize("read_pool", ["compute", "prefetch"])
def test_gpu_host_slots_outlive_the_reads_queued_from_them(tmp_path, read_pool):
    """The host runs ahead of the GPU: a backward can end on the host, and free its graph, before the reads it
    queued have run. The entries' host slots go back only once those copies ran (a slot given back earlier
    could be rewritten from the host, by an SSD read's staging, before the copy reads it). With the prefetch
    stream held back by a sleep, the slots are still taken after backward, and given back after the reads."""
    model, batches, want, cfg = _host_all(6, 3, read_pool=read_pool)
    held = []
    with _offloaded(model, cfg) as (off, sched):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        got = []
        for step, x in enumerate(batches):
            opt.zero_grad()
            torch.cuda.synchronize()
            with torch.cuda.stream(sched.stream("prefetch")):  # (~2 s: longer than the host's backward)
                torch.cuda._sleep(4_000_000_000 if step > 0 else 1)
            model(x).float().pow(2).mean().backward()
            if step > 0:  # (the first step's host work, cold, allocates the pinned pool)
                held.append((off.mover.host.arena.used, len(off.mover._read_frees)))
            got.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            off.end_step()
        torch.cuda.synchronize()
        off.mover.poll_writes()
        left = off.mover.host.arena.used
    assert all(used > 0 and pending > 0 for used, pending in held), held
    assert left == 0
    assert_same_grads(want, got)


def _gpt_step(batch: int, seed: int):
    """A small GPT on the GPU, its optimizer and a step function returning the step's activation peak."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=256, d=512, layers=6, heads=8, seq=256).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randint(0, 256, (batch, 256), device="cuda", generator=g)
    return model, opt, lambda off=None: _measured_step(model, opt, x, off)


def _auto_peaks(model, step, budget: float, **kw):
    """Peaks of six steps under policy auto at ``budget`` GiB (by default one warm-up step, profile, planned, up
    to two re-plans, settled) and the plan in force at the end."""
    cfg = ActivationOffloadConfig(**{"enabled": True, "tiers": ["host"], "policy": "auto", "host_pool_gb": 2,
                                     "memory_budget_gb": budget, "min_tensor_bytes": 1 << 16,
                                     "profile_warmup_steps": 1, **kw})  # fmt: skip
    sched = Scheduler(device=torch.device("cuda"))
    off = ActivationOffload(model, cfg, sched)
    try:
        return [step(off) for _ in range(6)], off.plan
    finally:
        off.close()
        sched.close()


def test_gpu_budget_makes_new_segments_expandable(tmp_path):
    """Under a budget (expandable_segments "auto"), the segments the offloaded steps allocate are expandable,
    and closing restores the setting the process had."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if allocator.user_configured():
        pytest.skip("PYTORCH_CUDA_ALLOC_CONF names expandable_segments: auto leaves it to the user")
    model, _, step = _gpt_step(16, 4)
    before = allocator.expandable_segments()
    step()
    old = {s["address"] for s in torch.cuda.memory_snapshot()}
    # one warm-up step: the third step is a planned one
    cfg = ActivationOffloadConfig(enabled=True, tiers=["host"], policy="auto", host_pool_gb=2,
                                  memory_budget_gb=64, min_tensor_bytes=1 << 16, profile_warmup_steps=1)  # fmt: skip
    sched = Scheduler(device=torch.device("cuda"))
    off = ActivationOffload(model, cfg, sched)
    try:
        assert allocator.expandable_segments()
        for _ in range(3):
            step(off)
        new = [s for s in torch.cuda.memory_snapshot() if s["address"] not in old]
        assert new, "the offloaded steps allocated no new segment"
        assert all(s.get("is_expandable") for s in new), [
            (s["total_size"], s.get("is_expandable")) for s in new
        ]
    finally:
        off.close()
        sched.close()
    assert allocator.expandable_segments() == before


def test_gpu_calibration_measures_what_the_step_allocates_for_activations(tmp_path):
    """Calibration's measured peak is the step's activation peak as the prediction counts it, from the
    model's forward: gradients that zero_grad(set_to_none=True) frees between steps are not in its base.
    (Measured from the step boundary, it came out short by about the gradients' bytes, and a plan 2% over
    its budget was kept.)"""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, _, step = _gpt_step(16, 5)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    step()
    cfg = ActivationOffloadConfig(enabled=True, tiers=["host"], policy="recompute_all", host_pool_gb=1,
                                  min_tensor_bytes=1 << 16)  # fmt: skip
    sched = Scheduler(device=torch.device("cuda"))
    off = ActivationOffload(model, cfg, sched)
    try:
        step(off)
        off.calibration.meter.mark()
        measured = step(off)  # from just after zero_grad: the gradients count, as in the prediction
        seen = off.calibration.meter.since_mark()
        assert seen is not None
        # both are measured from the model's forward (after zero_grad), the gradients inside the peak
        assert abs(seen - measured) < grad_bytes / 2, (seen, measured, grad_bytes)
        assert abs(seen - measured) < 1 << 20, (seen, measured)
    finally:
        off.close()
        sched.close()


def test_gpu_plan_counts_the_peak_after_the_layers_backward(tmp_path, caplog):
    """Where the step's tail (here a buffer the size of the layers' peak plus 1 GiB, allocated after backward
    as a gradient reduction's would be) peaks above the layers, the plan's predicted step peak is that tail as
    the profiler measured it, within 5 % of the measured step peak; under a budget the tail alone exceeds, dsx
    warns, plans the layers against the tail, and calibration does not re-plan them for it."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, opt, plain = _gpt_step(16, 6)
    layers_peak = plain()
    x = torch.randint(
        0, 256, (16, 256), device="cuda", generator=torch.Generator(device="cuda").manual_seed(6)
    )
    tail = layers_peak + (1 << 30)

    def step(off) -> int:
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(x).float().pow(2).mean().backward()
        torch.empty(tail, dtype=torch.uint8, device="cuda").fill_(1)  # (freed at once)
        opt.step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        off.end_step()
        return peak

    cfg = ActivationOffloadConfig(enabled=True, tiers=["host"], policy="auto", host_pool_gb=1,
                                  memory_budget_gb=layers_peak / 2**30, min_tensor_bytes=1 << 16)  # fmt: skip
    sched = Scheduler(device=torch.device("cuda"))
    off = ActivationOffload(model, cfg, sched)
    plans, peaks = [], []
    try:
        with caplog.at_level("WARNING", logger="dsx.offload"):
            for _ in range(6):  # two warm-up steps, the profiled one, three planned ones
                peaks.append(step(off))
                plans.append(off.plan)
    finally:
        off.close()
        sched.close()
    plan = plans[2]
    assert plan is not None and plans[3] is plan and plans[5] is plan  # no re-plan for the tail
    assert tail <= plan.outside_peak_bytes <= tail + (512 << 20), (plan.outside_peak_bytes, tail)
    assert plan.predicted_step_peak_bytes == plan.outside_peak_bytes > plan.peak_bytes
    for measured in peaks[3:]:
        assert abs(measured - plan.predicted_step_peak_bytes) <= 0.05 * measured, (measured, plan)
    assert "no activation plan lowers that part" in caplog.text
    assert plan.bound["budget_bytes"] == plan.outside_peak_bytes  # the layers planned against the tail


@pytest.mark.parametrize("profile_mode", ["keep", "recompute", "recompute+host"])
def test_gpu_auto_plan_stays_under_its_budget(tmp_path, profile_mode):
    """The budget is a promise about max_memory_allocated, not about saved bytes: the measured peak of the
    planned steps stays under it (the profiled background and workspace, then calibration, see to that),
    whether the profiling step kept everything or recomputed every layer."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, _, step = _gpt_step(16, 2)
    step()
    keep_peak = step()
    budget = 0.55 * keep_peak / 2**30
    peaks, plan = _auto_peaks(model, step, budget, profile_mode=profile_mode)
    assert plan is not None
    assert peaks[-1] <= budget * 2**30, (
        f"measured {peaks[-1] / 2**30:.3f} GiB > budget {budget:.3f} GiB (predicted {plan.peak_bytes / 2**30:.3f}, "
        f"keep-all {keep_peak / 2**30:.3f}); plan {[a.value for a in plan.actions]}; peaks {peaks}"
    )


def test_gpu_profiling_with_the_inputs_on_the_host_peaks_lower_and_measures_alike(tmp_path):
    """profile_mode recompute+host: the warm-up step peaks below profile_mode recompute's, by at
    least half of the inputs of the layers outside the backward's read window, and the profile's memory points
    are recompute's to within the allocator's rounding; the last layer's gap, where the reads the head's end
    asks for are not subtracted, up to the read window above it (an upper bound, never below). At batch 64 the
    layers' inputs outweigh the gradients: with fewer tokens a recomputed step peaks in the first layer's
    backward, where every gradient is held and no other layer's input, and both modes peak alike. The profiling
    step runs as the warm-up step does, but resets the peak counter at each point it measures."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, _, step = _gpt_step(64, 2)
    step()
    budget = 0.55 * step() / 2**30
    (rc_peaks, rc_plan), (host_peaks, host_plan) = (
        _auto_peaks(model, step, budget, profile_mode=mode) for mode in ("recompute", "recompute+host")
    )
    n, inputs = len(rc_plan.profiles), rc_plan.profiles[0].input_bytes
    assert inputs > 0 and [p.input_bytes for p in host_plan.profiles] == [inputs] * n
    assert host_peaks[0] <= rc_peaks[0] - 0.5 * (n - 2) * inputs, (rc_peaks, host_peaks, inputs)
    _assert_memory_points_alike(host_plan.profiles, rc_plan.profiles, inputs)


def _assert_memory_points_alike(got_profiles, want_profiles, inputs: int) -> None:
    """Two profiles' memory points agree to within the allocator's rounding; the last layer's gap, where the
    reads the head's end asks for are not subtracted, up to the read window above (an upper bound, never
    below)."""
    slack, n = 2 << 20, len(want_profiles)
    for a, b in zip(got_profiles, want_profiles, strict=True):
        for key in ("fwd_background_bytes", "fwd_peak_bytes", "gap_background_bytes", "bwd_background_bytes",
                    "bwd_workspace_bytes"):  # fmt: skip
            got, want = getattr(a, key), getattr(b, key)
            if key == "gap_background_bytes" and a.index == n - 1:
                assert want - slack <= got <= want + 2 * inputs + slack, (a.index, key, got, want)
            else:
                assert abs(got - want) <= slack, (a.index, key, got, want)


def test_gpu_profiling_with_a_small_pool_sends_the_inputs_it_cannot_hold_to_the_ssd(tmp_path):
    """profile_mode recompute+host with a pool of two layers' inputs: with the SSD tier listed, the warm-up step
    peaks as with a pool that holds every input (within one input: an SSD read may be asked for at another
    point of the backward than a host read), since the drive takes what the pool cannot; over the host tier
    alone the other four inputs stay on the card, and it peaks higher. How much higher depends on where the
    step peaks: the gradients of the layers done so far outweigh some of the inputs late in the backward."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, _, step = _gpt_step(64, 2)
    step()
    budget = 0.55 * step() / 2**30
    every, every_plan = _auto_peaks(model, step, budget, profile_mode="recompute+host")
    inputs = every_plan.profiles[0].input_bytes
    small = {"profile_mode": "recompute+host", "host_pool_gb": 2 * inputs / 2**30}
    host_peaks, _ = _auto_peaks(model, step, budget, **small)
    ssd_peaks, ssd_plan = _auto_peaks(
        model, step, budget, tiers=["host", "ssd"], ssd_path=str(tmp_path), **small
    )
    assert ssd_plan is not None and inputs > 0
    peaks = {
        "every input in the pool": every[0],
        "small pool": host_peaks[0],
        "small pool and SSD": ssd_peaks[0],
    }
    assert abs(ssd_peaks[0] - every[0]) <= inputs + (2 << 20), (peaks, inputs)
    assert ssd_peaks[0] < host_peaks[0], (peaks, inputs)


def test_gpu_profiling_over_a_slow_drive_measures_as_with_every_input_in_the_pool(tmp_path, monkeypatch):
    """profile_mode recompute+host with a pool of two layers' inputs and the rest on a drive whose reads take
    0.3 s, against a pool that holds every input: the profile's memory points agree to within the allocator's
    rounding (a read's buffer, allocated when the read is asked for, counts as that layer's input while the
    drive still reads it, not as background), and each layer's backward time leaves out the wait for the
    drive, as does the time outside the layers, taken from the last of two warm-up steps (where the host runs
    ahead of the GPU: what it leaves out there is the GPU's idle time). The head queues about 50 ms of GPU work
    outside the layers: this small model's own is less than the profiled step's synchronizations stretch its
    layers by, and would be floored to 0 either way."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    delay = 0.3
    model, _, step = _gpt_step(64, 2)
    model.head.register_forward_hook(lambda *a: torch.cuda._sleep(100_000_000))
    step()
    budget = 0.55 * step() / 2**30
    _, every = _auto_peaks(model, step, budget, profile_mode="recompute+host", profile_warmup_steps=2)
    inputs = every.profiles[0].input_bytes
    slow_ssd_reads(monkeypatch, delay)
    _, slow = _auto_peaks(model, step, budget, profile_mode="recompute+host", profile_warmup_steps=2,
                          host_pool_gb=2 * inputs / 2**30, tiers=["host", "ssd"], ssd_path=str(tmp_path))  # fmt: skip
    assert slow is not None and inputs > 0
    _assert_memory_points_alike(slow.profiles, every.profiles, inputs)
    for a, b in zip(slow.profiles, every.profiles):
        assert a.bwd_s < b.bwd_s + delay / 2, (a.index, a.bwd_s, b.bwd_s)
    # (left in, the waits would lengthen it; counted twice, they would take it to its floor, 0)
    assert every.outside_s > 0.02, (
        f"no time outside the layers ({every.outside_s} s): the check below is void"
    )
    assert 0 < slow.outside_s < every.outside_s + delay / 2, (slow.outside_s, every.outside_s)


def test_gpu_auto_trains_a_micro_batch_that_fits_only_with_it(tmp_path):
    """With a budget, policy auto profiles under recomputation: under a memory cap where a step that keeps
    everything runs out of memory, the warm-up and profiling steps still fit, and the planned steps train
    under the budget."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, opt, step = _gpt_step(32, 3)
    step()
    keep_peak = step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 0.7 * keep_peak) / total)
    try:
        # the cap bites: keeping everything no longer fits (no pytest.raises: its traceback would hold the
        # step's tensors)
        oom = False
        try:
            step()
        except torch.OutOfMemoryError:
            oom = True
        assert oom, "the memory cap did not make the keep-everything step run out of memory"
        gc.collect()
        opt.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        budget = 0.45 * keep_peak / 2**30
        peaks, plan = _auto_peaks(model, step, budget)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert plan is not None and all(not p.recompute_only for p in plan.profiles)
    assert peaks[-1] <= budget * 2**30, (peaks, budget, [a.value for a in plan.actions])


@pytest.mark.parametrize("write_barrier", ["off", "auto"])
def test_gpu_ssd_writes_give_device_memory_back_when_their_copies_end(tmp_path, write_barrier):
    """An SSD write's device bytes go back once its copy to the host slot ends, not once an I/O thread gets to
    its file write: with the drive's gate shut (as for DeepSpeed's optimizer swap) every I/O thread waits there
    with more writes queued behind it, and still every moved tensor is off the device after the forward (not
    only those the threads have reached). With ``offload_all``'s write barrier (``"auto"``) the forward itself
    passes the barrier under the shut gate, rather than wait on the drive (here, until a 20 s watchdog opened
    the gate). Once the gate opens the step's gradients are those of a run without offload."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, batches, want = _reference(seed=6, n_batches=2)
    cfg = ActivationOffloadConfig(enabled=True, tiers=["ssd"], ssd_path=str(tmp_path), policy="offload_all",
                                  host_pool_gb=1, min_tensor_bytes=0, io_backend="posix",
                                  write_barrier=write_barrier)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    got = []
    with _offloaded(model, cfg) as (off, sched):
        for i, x in enumerate(batches):
            opt.zero_grad()
            with sched.paused("ssd"):
                fired = threading.Event()
                watchdog = threading.Timer(20.0, lambda f=fired: (f.set(), sched.gate("ssd").set()))
                watchdog.start()
                try:
                    loss = model(x).float().pow(2).mean()
                finally:
                    watchdog.cancel()
                assert not fired.is_set(), f"step {i}: the forward waited for the drive's gate"
                assert bool(off.hooks.write_barrier) == (write_barrier == "auto")
                torch.cuda.synchronize()
                off.mover.poll_writes()
                entries = [e for layer in range(4) for e in off.mover.entries_of(layer)]
                waiting = sum(not e.written.done() for e in entries)
                assert waiting > 4, (
                    f"{waiting} file writes queued: no more than the I/O threads, nothing checked"
                )
                left = [e.name for e in entries if e.src is not None or not e.off_device.is_set()]
                assert not left, (
                    f"step {i}: device bytes held by writes the I/O threads had not reached: {left}"
                )
            loss.backward()
            got.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            off.end_step()
    assert_same_grads(want, got)


@pytest.mark.parametrize("kind", ["flip", "stale"])
def test_gpu_corrupt_ssd_read_is_an_error_by_default(tmp_path, kind):
    """The device checksums (taken on the offload stream as the bytes leave, on the prefetch stream as they
    come back) catch bytes changed on the drive, with the default config; the consumer never gets them."""
    from tests.offload.test_mechanism import _corrupt

    model, batches, _, _ = _host_all(seed=7, n_batches=1)
    (tmp_path / "ssd").mkdir()
    cfg = ActivationOffloadConfig(enabled=True, tiers=["ssd"], ssd_path=str(tmp_path / "ssd"), policy="offload_all",
                                  host_pool_gb=1, ssd_capacity_gb=1, min_tensor_bytes=0, io_backend="posix")  # fmt: skip
    assert cfg.verify == "auto"
    with _offloaded(model, cfg) as (off, _):
        loss = model(batches[0]).float().pow(2).mean()
        off.mover.drain()
        e, other = off.mover.entries_of(0)[0], off.mover.entries_of(1)[0]
        assert e.tier == other.tier == "ssd" and e.checksum is not None
        _corrupt(kind, off.ssd.path, e, other)
        with pytest.raises(OffloadIntegrityError, match=rf"layer 0 .*ssd tier .*offset {e.ssd_off}"):
            loss.backward()


def test_gpu_ssd_reads_are_timed_by_the_drive_not_by_the_copy_on(tmp_path):
    """An SSD read's span, what the tier's rate is taken over, is its drive call alone. With ``read_pool``
    ``"compute"`` a read's copy to the device waits until the GPU reaches the read's point of issue: with about
    2 s of GPU sleep queued on the compute stream after each forward, the reads issued in backward hold their
    I/O thread that long, which is not the drive's time. The sleep is long so that a span holding the wait
    stays several times the drive's own time for the step's reads, which swings between runs on a shared
    virtual disk. Gradients bitwise."""
    model, batches, want, _ = _host_all(seed=8, n_batches=2)
    (tmp_path / "ssd").mkdir()
    cfg = ActivationOffloadConfig(enabled=True, tiers=["ssd"], ssd_path=str(tmp_path / "ssd"), policy="offload_all",
                                  host_pool_gb=1, ssd_capacity_gb=1, min_tensor_bytes=0, io_backend="posix",
                                  read_pool="compute")  # fmt: skip
    slept = []

    def hold_compute() -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(4):  # (cycles per call stay well inside what one spin kernel counts)
            torch.cuda._sleep(1_000_000_000)
        end.record()
        slept.append((start, end))

    with _offloaded(model, cfg) as (off, sched):
        got = _train(model, batches, off, between=hold_compute)
        steps = list(sched.telemetry.history)
    torch.cuda.synchronize()
    sleep_s = min(a.elapsed_time(b) for a, b in slept) / 1e3
    assert sleep_s > 1.2, f"the GPU slept {sleep_s} s: the test checked nothing"
    assert all(r.bytes_by_tier.get("ssd_read") for r in steps)
    busy = [r.busy_by_tier["ssd_read"] for r in steps]
    assert max(busy) < 0.25 * sleep_s, (busy, sleep_s)
    assert_same_grads(want, got)


def test_gpu_report_says_which_mode_kvikio_runs_in() -> None:
    """Both ``dsx report`` lines name the mode kvikio's setting resolves to: ON is its POSIX compat mode, OFF
    GPUDirect Storage (the setting alone; no file is opened)."""
    if not describe_backends()["kvikio"]["available"]:
        pytest.skip(f"kvikio: {describe_backends()['kvikio']['reason']}")
    import kvikio
    import kvikio.defaults

    from dsx.report import collect

    for mode, live in (
        (kvikio.CompatMode.ON, "POSIX compat mode"),
        (kvikio.CompatMode.OFF, "GPUDirect Storage"),
    ):
        with kvikio.defaults.set("compat_mode", mode):
            want = f"compat_mode={mode.name} -> {live}"
            assert want in describe_backends()["kvikio"]["reason"]
            assert any(r["item"] == "kvikio" and want in r["value"] for r in collect()["rows"]), want


def test_gpu_kvikio_tier_leaves_kvikios_pool_as_it_is(tmp_path):
    """kvikio's process-wide pool keeps the size ``KVIKIO_NTHREADS`` gives it when a tier opens, ``dsx report``'s line
    says that size, and calls in flight at once read back what they wrote."""
    if not describe_backends()["kvikio"]["available"]:
        pytest.skip(f"kvikio: {describe_backends()['kvikio']['reason']}")
    from dsx.offload.io import kvikio_threads, select_backend

    before = kvikio_threads()
    assert f"a pool of {before} thread(s)" in describe_backends()["kvikio"]["reason"]
    path = str(tmp_path / "f.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    sched = Scheduler(SchedulerConfig(io_workers=4), device=torch.device("cuda"))
    be = None
    try:
        be = select_backend("kvikio", path, fd, sched)
        assert be.name == "kvikio" and kvikio_threads() == before
        part = 16 << 20
        data = torch.randint(
            0, 256, (4 * part,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
        )
        for f in [be.pwrite(data[i * part : (i + 1) * part], i * part) for i in range(4)]:
            f.result()
        out = torch.empty_like(data)
        for f in [be.pread(out[i * part : (i + 1) * part], i * part) for i in range(4)]:
            f.result()
        assert torch.equal(out, data)
    finally:
        if be is not None:
            be.close()
        os.close(fd)
        sched.close()


def test_a_pinned_pool_of_a_power_of_two_takes_no_page_more() -> None:
    # torch's pinned-memory cache rounds a block up to a power of two: a page more would double it
    from dsx.runtime.host_memory import PAGE, page_aligned_empty

    for n in (32 << 20, 48 << 20):
        buf = page_aligned_empty(n, pin=True)
        assert buf.is_pinned() and buf.data_ptr() % PAGE == 0 and buf.numel() == n
        assert buf.untyped_storage().nbytes() == n  # asked for at its size, not one page more


def test_the_host_pool_is_pinned_in_place_and_given_back_when_released() -> None:
    from dsx.offload.store import HostPool
    from dsx.runtime import pinning

    pool = HostPool(256 << 20, pin=True, device=torch.device("cuda", torch.cuda.current_device()))
    pool.allocate()
    assert pool._pinned is not None, "the pool fell back to pin_memory=True (see the log for why)"
    off, slot = pool.alloc(1 << 20)
    ptr = pool._buf.data_ptr()
    assert pinning.is_registered(ptr) and slot.is_pinned()
    src = torch.randn(1 << 18, device="cuda")
    slot.view(torch.float32).copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(slot.view(torch.float32).cuda(), src)
    assert not pool.release()  # a slot in use keeps it
    pool.free(off, 1 << 20)
    assert pool.release() and not pinning.is_registered(ptr)
    pool.allocate()  # taken again on the next plan that moves bytes
    assert pinning.is_registered(pool._buf.data_ptr())
    assert pool.release()
