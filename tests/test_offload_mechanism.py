"""Activation offload on CPU: bitwise-equal gradients, dedup, in-place detection, integrity errors."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from dsx.config import ActivationOffloadConfig, SchedulerConfig
from dsx.offload import ActivationOffload, OffloadIntegrityError
from dsx.runtime.scheduler import Scheduler
from tests._offload_models import OddModel, TinyGPT, assert_same_grads


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


@pytest.mark.parametrize("kind", ["gpt", "odd"])
@pytest.mark.parametrize("tiers", [["host"], ["ssd"], ["host", "ssd"]])
def test_bitwise_equal_gradients(tmp_path, kind, tiers):
    model, batches, want = _reference(1, 3, TinyGPT if kind == "gpt" else OddModel, kind)
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(model, _cfg(tmp_path, tiers), sched)
    try:
        got = _train(model, batches, off)
        moved = sum(sched.telemetry.history[0].bytes_by_tier.values()) if sched.telemetry.history else 0
    finally:
        off.close()
        sched.close()
    assert moved > 0, "nothing was offloaded: the test would pass vacuously"
    if "ssd" in tiers:
        assert sched.telemetry.history[0].bytes_by_tier.get("ssd", 0) > 0
    assert_same_grads(want, got)
    if "ssd" in tiers:
        assert not os.listdir(tmp_path / "ssd"), "run dir not removed at close"


def test_storage_moved_once(tmp_path):
    """Two views of one storage and a tensor saved by two ops are each moved once."""
    sched = Scheduler(SchedulerConfig(io_workers=2))
    model = OddModel(layers=1)
    off = ActivationOffload(model, _cfg(tmp_path, ["host"]), sched)
    try:
        x = torch.randn(4, 6, 48)
        y = model(x)
        entries = off.mover.entries_of(0)
        ptrs = [e.name for e in entries]
        assert len(entries) == len(set(id(e) for e in entries))
        # refs > 1 proves dedup happened: several saved tensors share one moved storage
        assert max(e.refs for e in entries) >= 2, ptrs
        y.sum().backward()
    finally:
        off.close()
        sched.close()


def test_inplace_after_save_raises(tmp_path):
    class L(torch.nn.Module):
        def forward(self, x):
            self.h = x * 2
            return self.h.sin()

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([L(), L()])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    m = M()
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(m, _cfg(tmp_path, ["host"]), sched)
    try:
        x = torch.randn(64, requires_grad=True)
        y = m(x)
        assert off.mover.entries_of(0), "layer 0 offloaded nothing"
        with torch.no_grad():
            m.blocks[1].h.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
    finally:
        off.close()
        sched.close()


def test_corrupt_ssd_read_is_an_error(tmp_path):
    # Four layers: the end of forward already reads back the last layer and prefetch_depth more (3 and 2),
    # so layer 0 is read only during backward, after the bytes below were flipped.
    model = OddModel(layers=4)
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(model, _cfg(tmp_path, ["ssd"]), sched)
    try:
        y = model(torch.randn(4, 6, 48))
        off.mover.drain()
        e = off.mover.entries_of(0)[0]
        assert e.tier == "ssd"
        with open(off.ssd.path, "r+b") as f:  # flip bytes on disk behind dsx's back
            f.seek(e.ssd_off)
            b = f.read(16)
            f.seek(e.ssd_off)
            f.write(bytes(x ^ 0xFF for x in b))
            f.flush()
            os.fsync(f.fileno())
        with pytest.raises(OffloadIntegrityError, match="layer 0"):
            y.sum().backward()
    finally:
        off.close()
        sched.close()


def test_failed_read_names_path_and_offset(tmp_path):
    model = OddModel(layers=4)  # layers 0 and 1 are read during backward, after the truncation
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(model, _cfg(tmp_path, ["ssd"], verify=False), sched)
    try:
        y = model(torch.randn(4, 6, 48))
        off.mover.drain()
        os.ftruncate(off.ssd.fd, 0)  # the data are gone: the read hits end of file
        with pytest.raises(OSError, match=r"path=.*offset=\d+, size=\d+"):
            y.sum().backward()
    finally:
        off.close()
        sched.close()


def test_recompute_all_bitwise(tmp_path):
    model, batches, want = _reference(2, 2)
    sched = Scheduler()
    off = ActivationOffload(model, _cfg(tmp_path, ["host"], policy="recompute_all"), sched)
    got = _train_closing(model, batches, off, sched)
    assert_same_grads(want, got)


def test_recompute_all_with_frozen_embeddings_keeps_layer_gradients(tmp_path):
    """Layer inputs that need no grad (frozen embeddings): reentrant checkpointing would drop the layers'
    parameter gradients, so dsx must still give exactly the gradients of a run without recompute."""

    def grads(model, batch):
        model(batch).float().pow(2).mean().backward()
        return [p.grad.clone() for p in model.blocks.parameters()]

    torch.manual_seed(3)
    ref = TinyGPT()
    ref.tok.requires_grad_(False)
    ref.pos.requires_grad_(False)
    model = copy.deepcopy(ref)
    batch = _batches("gpt", 1, seed=5)[0]
    want = grads(ref, batch)
    sched = Scheduler()
    off = ActivationOffload(model, _cfg(tmp_path, ["host"], policy="recompute_all"), sched)
    try:
        got = grads(model, batch)
    finally:
        off.close()
        sched.close()
    assert len(got) == len(want) > 0
    for a, b in zip(want, got):
        assert torch.isfinite(a).all() and a.abs().sum() > 0 and torch.equal(a, b)


@pytest.mark.slow
def test_bitwise_equal_gradients_aio_backend(tmp_path):
    """DeepSpeed's AIO handle as the SSD backend (its JIT build takes ~4 min once, then is cached)."""
    from dsx.offload.io import describe_backends

    info = describe_backends()["aio"]
    if not info["available"]:
        pytest.skip(f"DeepSpeed async_io unavailable: {info['reason']}")
    model, batches, want = _reference(7, 3)
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(model, _cfg(tmp_path, ["host", "ssd"], io_backend="aio"), sched)
    try:
        assert off.ssd.io.name == "aio"
        got = _train(model, batches, off)
        assert sched.telemetry.history[0].bytes_by_tier.get("ssd", 0) > 0
    finally:
        off.close()
        sched.close()
    assert_same_grads(want, got)


def test_posix_backend_roundtrip_and_alignment(tmp_path):
    from dsx.offload.io import select_backend

    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        be = select_backend("posix", str(path), fd, threads=2)
        buf = torch.randint(0, 256, (8192,), dtype=torch.uint8)
        be.pwrite(buf, 4096).result()
        out = torch.zeros_like(buf)
        be.pread(out, 4096).result()
        assert torch.equal(out, buf)
        with pytest.raises(ValueError, match="4 KiB-aligned"):
            be.pwrite(buf[:100], 0)
        with pytest.raises(OSError, match=r"path=.*offset=1048576, size=8192"):
            be.pread(out, 1 << 20).result()  # past the end of the file
        be.close()
    finally:
        os.close(fd)


@pytest.mark.slow
def test_select_backend_auto_on_cpu_and_describe(tmp_path):
    """``auto`` without CUDA: aio when DeepSpeed's op loads (may JIT-build it), else posix; never kvikio."""
    from dsx.offload.io import describe_backends, select_backend

    info = describe_backends()
    assert set(info) == {"posix", "aio", "kvikio"} and info["posix"]["available"]
    fd = os.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        be = select_backend("auto", str(tmp_path / "f.bin"), fd, threads=2)
        assert be.name == ("aio" if info["aio"]["available"] else "posix")
        be.close()
    finally:
        os.close(fd)


# ------------------------------------------------------------------- selective recompute (recompute_modules)
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


@pytest.mark.parametrize("tiers", [["host"], ["ssd"]])
def test_offload_all_with_recompute_modules_bitwise(tmp_path, tiers):
    model, batches, want = _reference(3, 3)
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(model, _cfg(tmp_path, tiers, recompute_modules=["CoreAttention"]), sched)
    try:
        assert all(type(b.attn.forward).__name__ == "function" for b in model.blocks), "attention not wrapped"
        got = _steps(model, batches, off)
        moved = sched.telemetry.history[0].bytes_by_tier.get(tiers[-1], 0)
    finally:
        off.close()
        sched.close()
    assert moved > 0
    assert all("forward" not in b.attn.__dict__ for b in model.blocks), "close() left the wrapper"
    assert_same_grads(want, got)


def test_auto_profiles_selective_bytes_and_moves_what_it_predicts(tmp_path):
    """The profiled +sel bytes are exactly what the layer moves with its recompute modules recomputed."""
    model, batches, want = _reference(4, 4, make=lambda: TinyGPT(by_keyword=True))
    sched = Scheduler(SchedulerConfig(io_workers=2))
    cfg = _cfg(tmp_path, ["host"], policy="auto", recompute_modules=["CoreAttention"], profile_warmup_steps=0)
    off = ActivationOffload(model, cfg, sched)
    n = len(model.blocks)
    try:
        # step 0 profiles; step 1 moves everything outside attention; step 2 everything; step 3 mixes
        got = _steps(model, batches, off, [["host+sel"] * n, ["host"] * n, ["keep+sel", "host+sel", "keep"]])
        profiles = off.plan.profiles
        hist = sched.telemetry.history
    finally:
        off.close()
        sched.close()
    assert_same_grads(want, got)
    for p in profiles:
        assert p.sel_saved_bytes is not None and 0 < p.sel_saved_bytes < p.saved_bytes
        assert p.sel_recompute_s > 0
    assert hist[1].bytes_by_tier["host"] == sum(p.sel_saved_bytes for p in profiles)
    assert hist[2].bytes_by_tier["host"] == sum(p.saved_bytes for p in profiles)
    assert hist[3].bytes_by_tier["host"] == profiles[1].sel_saved_bytes


def test_partial_moves_move_what_the_plan_counts(tmp_path):
    """A hide-only plan moves part of a layer (its first saved storages, each that still fits under the
    cap): the profile records the storages in save order, and plan.movable() predicts the bytes the runtime
    then moves, for caps that fall between storage sizes."""
    from dsx.offload.plan import Action, movable

    model, batches, want = _reference(12, 3)
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(model, _cfg(tmp_path, ["host"], policy="auto", profile_warmup_steps=0), sched)
    profiles, caps = [], {}

    def partial_moves(step: int) -> None:  # after the profiling step: parts of every layer, to the host
        if step == 0:
            profiles.extend(off.plan.profiles)
            caps.update(
                {i: int(p.saved_bytes * f) for i, (p, f) in enumerate(zip(profiles, (0.31, 0.55, 0.83)))}
            )
            off._apply(["host"] * len(profiles), 1, caps)

    try:
        got = _steps(model, batches, off, after=partial_moves)
        moved = [h.bytes_by_tier.get("host", 0) for h in sched.telemetry.history]
    finally:
        off.close()
        sched.close()
    assert_same_grads(want, got)
    for p in profiles:
        assert sum(p.saved_sizes) == p.saved_bytes and len(p.saved_sizes) > 3
    want_moved = sum(movable(p, Action.HOST, caps[i]) for i, p in enumerate(profiles))
    assert 0 < want_moved < sum(caps.values())  # the caps fall between storages: less than the caps moves
    assert moved[1:] == [want_moved, want_moved]


def test_profiler_times_backward_of_keyword_called_layers(tmp_path):
    """Megatron passes hidden_states by keyword: per-layer backward times must still add up."""
    import time

    from dsx.offload.profile import Profiler

    torch.manual_seed(5)
    model = TinyGPT(d=128, layers=3, heads=4, seq=64, by_keyword=True)
    sched = Scheduler()
    off = ActivationOffload(model, _cfg(tmp_path, ["host"], policy="none"), sched)
    prof = Profiler(off.layers, off.hooks, off.device)
    try:
        x = torch.randint(0, 64, (8, 64))
        loss = model(x).float().pow(2).mean()
        t0 = time.perf_counter()
        loss.backward()
        total = time.perf_counter() - t0
        profiles = prof.finish()
    finally:
        off.close()
        sched.close()
    assert all(p.bwd_s > 0 for p in profiles)
    # the blocks are most of the backward (the rest: embedding, head, loss); hooks that fired back to back
    # would sum to ~0
    assert sum(p.bwd_s for p in profiles) > 0.3 * total


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_profile_measures_the_step_outside_the_layers(tmp_path, mode):
    """The printed prediction covers the whole step: the profiling step's time outside the layers (here a
    0.2 s sleep where the optimizer runs) is measured and added; the layers' own time, their recomputation
    under profile_mode recompute included (a 0.25 s sleep in each attention, which the recomputation runs
    again), is not counted outside."""
    import time

    torch.manual_seed(11)
    model = TinyGPT(by_keyword=True)
    for b in model.blocks:
        b.attn.register_forward_pre_hook(lambda *_: time.sleep(0.25))
    sched = Scheduler()
    cfg = _cfg(tmp_path, ["host"], policy="auto", profile_warmup_steps=0, profile_mode=mode)
    off = ActivationOffload(model, cfg, sched)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for x in _batches("gpt", 2):
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            time.sleep(0.2)
            opt.step()
            off.end_step()
        plan = off.plan
    finally:
        off.close()
        sched.close()
    assert 0.2 <= plan.outside_s < 0.2 + 0.25, plan.outside_s
    assert plan.predicted_total_step_s == pytest.approx(plan.predicted_step_s + plan.outside_s)
    assert plan.predicted_step_s >= 0.25 * len(model.blocks)  # each layer's forward, once
    text = plan.describe()
    assert f"predicted step {plan.predicted_total_step_s * 1e3:.1f} ms" in text
    assert f"{plan.outside_s * 1e3:.1f} outside them" in text


def test_unknown_recompute_module_is_a_clear_error(tmp_path):
    model = TinyGPT()
    with pytest.raises(ValueError, match=r"recompute_modules \['Nope'\] match no sub-module.*CoreAttention"):
        ActivationOffload(model, _cfg(tmp_path, ["ssd"], recompute_modules=["Nope"]), Scheduler())
    assert not model._forward_pre_hooks and not any(b._forward_pre_hooks for b in model.blocks)
    assert not os.listdir(tmp_path / "ssd"), "a run directory was created before the config was checked"


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


def test_auto_profiles_after_warmup_steps(tmp_path):
    model, batches, want = _reference(6, 4)
    sched = Scheduler()
    cfg = _cfg(tmp_path, ["host"], policy="auto", profile_warmup_steps=2, write_barrier="on")
    off = ActivationOffload(model, cfg, sched)
    got, plans = _train_with_plans(model, batches, off, sched)
    assert plans[0] is None and plans[1] is None and plans[2] is not None
    assert all(p.saved_bytes > 0 and p.fwd_s > 0 for p in plans[2].profiles)
    # the plan's write barrier is what the hooks wait by
    assert len(plans[2].write_barrier) == len(plans[2].actions) + 1
    assert off.hooks.write_barrier == plans[2].write_barrier
    assert_same_grads(want, got)


def test_auto_replans_when_the_planned_step_peaks_over_the_budget(tmp_path):
    """A planned step measured over memory_budget_gb (the cost model missed bytes) makes the planner plan
    again against the budget lowered by the overshoot; gradients stay bitwise equal throughout. On CPU there
    is no peak to read, so the measurement is stubbed: on the first calibration the step is said to have
    peaked at budget + overshoot, on the second within the budget."""
    model, batches, want = _reference(7, 5)
    sched = Scheduler()
    cfg = _cfg(
        tmp_path, ["host"], policy="auto", profile_warmup_steps=0, memory_budget_gb=1.0, host_pool_gb=0.2
    )
    off = ActivationOffload(model, cfg, sched)
    budget = 1 << 30
    measured: list[int] = []

    def fake_peak() -> int:
        keep_all = off.plan.bound["keep_all_bytes"]
        # over the budget by (budget - keep_all / 2): the re-plan must fit keep_all / 2
        measured.append(2 * budget - keep_all // 2 if not measured else budget // 2)
        return measured[-1]

    off._peak_since_mark = fake_peak  # type: ignore[method-assign]
    got, plans = _train_with_plans(model, batches, off, sched)
    first, second = plans[0], plans[1]
    keep_all = first.bound["keep_all_bytes"]
    assert first.peak_bytes > keep_all // 2  # a 1 GiB budget leaves the tiny model's plan free
    assert second is not first and second.peak_bytes <= keep_all // 2  # planned with the margin
    assert len(measured) == 2 and plans[2] is second and plans[4] is second  # within budget: no more re-plans
    assert_same_grads(want, got)


def test_partial_layer_moves_up_to_its_cap_bitwise(tmp_path):
    """The planner's partial layer: its first saved storages move, up to the cap; the rest stays; same grads."""

    def run(model, batches, caps):
        sched = Scheduler(SchedulerConfig(io_workers=2))
        off = ActivationOffload(model, _cfg(tmp_path, ["host"], policy="none"), sched)
        try:
            off._apply(["host"] + ["keep"] * (len(off.layers) - 1), 1, caps)
            grads = _train(model, batches, off)
            return grads, [r.bytes_by_tier.get("host", 0) for r in sched.telemetry.history]
        finally:
            off.close()
            sched.close()

    sizing, batches, _ = _reference(5, 1)
    whole = run(sizing, batches, None)[1][0]  # what layer 0 moves when it moves everything
    cap = whole // 3
    model, batches, want = _reference(5, 3)
    got, moved = run(model, batches, {0: cap})
    assert whole > 0 and len(moved) == 3 and all(0 < m <= cap for m in moved), (whole, cap, moved)
    assert_same_grads(want, got)


@pytest.mark.parametrize(
    "actions", [["recompute+host"] * 3, ["recompute+ssd"] * 3, ["recompute+host", "host", "keep"]]
)
def test_recompute_with_its_inputs_moved_bitwise(tmp_path, actions):
    """recompute+<tier>: what the layer's checkpoint keeps (its input hidden state) moves and comes back for
    the recomputation; gradients stay bitwise equal and the inputs are all a recomputed layer moves."""
    model, batches, want = _reference(8, 3)
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(model, _cfg(tmp_path, ["host", "ssd"], policy="recompute_all"), sched)
    try:
        off._apply(actions, 1)
        got = _train(model, batches, off)
        hist = sched.telemetry.history
        tier = actions[0].split("+")[1]  # (an SSD write also counts its staging copy under host)
        moved = [r.bytes_by_tier.get(tier, 0) for r in hist]
        read = [r.bytes_by_tier.get(f"{tier}_read", 0) for r in hist]
    finally:
        off.close()
        sched.close()
    assert moved == read  # everything written came back
    hidden = batches[0].numel() * model.tok.embedding_dim * 4  # one float32 hidden state
    n_rc = sum(a.startswith("recompute+") for a in actions)
    if actions[1] == "host":  # a layer that moves everything it saves: more than its input
        assert all(m > (n_rc + 1) * hidden for m in moved), (moved, hidden)
    else:
        assert moved == [n_rc * hidden] * len(batches), (moved, hidden)
    assert_same_grads(want, got)


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


@pytest.mark.parametrize(("budget", "mask"), [(None, False), (1.0, False), (None, True)])
def test_profile_under_recompute_sees_what_keeping_sees(tmp_path, budget, mask):
    """profile_mode recompute (the default with a budget): the warm-up and profiling steps recompute every
    layer (the attention runs twice a step) and the profile counts the same bytes as a step that keeps
    everything: saved, saved with the recompute modules recomputed, inputs; gradients stay bitwise. A mask
    handed to every layer counts in neither (it stays on the device)."""
    runs = {}
    for mode in ("keep", "recompute" if budget is None else "auto"):
        model, batches, want = _reference(9, 4, make=lambda: TinyGPT(by_keyword=True, shared_mask=mask))
        sched = Scheduler(SchedulerConfig(io_workers=2))
        cfg = _cfg(tmp_path, ["host"], policy="auto", recompute_modules=["CoreAttention"],
                   profile_warmup_steps=1, profile_mode=mode, memory_budget_gb=budget if mode != "keep" else None)  # fmt: skip
        off = ActivationOffload(model, cfg, sched)
        got, plans, calls = _calls_per_step(model, batches, off, sched)
        assert_same_grads(want, got)
        runs[mode] = (plans, calls)
    (kp, kcalls), (rp, rcalls) = runs["keep"], runs["recompute" if budget is None else "auto"]
    n = len(kp[1].profiles)
    assert kp[0] is None and rp[0] is None and kp[1] is not None and rp[1] is not None
    assert kcalls[:2] == [n, n] and rcalls[:2] == [2 * n, 2 * n], (kcalls, rcalls)
    hidden = 2 * 16 * 32 * 4
    for a, b in zip(rp[1].profiles, kp[1].profiles):
        assert a.saved_bytes == b.saved_bytes > a.input_bytes
        assert a.sel_saved_bytes == b.sel_saved_bytes and 0 < a.sel_saved_bytes < a.saved_bytes
        assert a.input_bytes == b.input_bytes == hidden
        assert a.fwd_s > 0 and a.bwd_s > 0 and a.sel_recompute_s > 0 and not a.recompute_only


def test_profile_under_recompute_with_frozen_embeddings(tmp_path):
    """A layer whose input needs no grad runs through the non-reentrant checkpoint, where the profile cannot
    count its saved tensors: it is timed, marked recompute_only and recomputed by the plan; the gradients
    of every trainable parameter stay bitwise equal."""

    def train(model, batches, off=None):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        out, plans = [], []
        for x in batches:
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            out.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
            opt.step()
            if off is not None:
                off.end_step()
                plans.append(off.plan)
        return out, plans

    torch.manual_seed(3)
    ref = TinyGPT()
    ref.tok.requires_grad_(False)
    ref.pos.requires_grad_(False)
    model = copy.deepcopy(ref)
    batches = _batches("gpt", 3, seed=5)
    want, _ = train(ref, batches)
    sched = Scheduler()
    cfg = _cfg(tmp_path, ["host"], policy="auto", profile_warmup_steps=0, profile_mode="recompute")
    off = ActivationOffload(model, cfg, sched)
    try:
        got, plans = train(model, batches, off)
    finally:
        off.close()
        sched.close()
    prof = plans[0].profiles
    assert prof[0].recompute_only and prof[0].fwd_s > 0
    assert all(not p.recompute_only and p.saved_bytes > 0 for p in prof[1:])
    assert plans[0].actions[0].recomputed
    assert len(got) == len(want) and all(len(g) > 0 for g in got)
    assert_same_grads(want, got)


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_profile_counts_bytes_per_micro_batch_under_gradient_accumulation(tmp_path, mode):
    """Two micro-batches per step recompute (or save) twice: the profile still counts one micro-batch's
    bytes, the same as a step of one micro-batch; an evaluation forward under no_grad before the first
    micro-batch's backward does not end the count (its recomputation happens after it)."""
    runs = []
    for accumulate in (1, 2, 0):
        torch.manual_seed(10)
        model = TinyGPT(by_keyword=True)
        sched = Scheduler()
        cfg = _cfg(tmp_path, ["host"], policy="auto", recompute_modules=["CoreAttention"],
                   profile_warmup_steps=0, profile_mode=mode)  # fmt: skip
        off = ActivationOffload(model, cfg, sched)
        try:
            if accumulate:
                for x in _batches("gpt", accumulate, seed=3):
                    model(x).float().pow(2).mean().backward()
            else:  # one micro-batch with an evaluation forward between its forward and its backward
                (x,) = _batches("gpt", 1, seed=3)
                loss = model(x).float().pow(2).mean()
                with torch.no_grad():
                    model(x)
                loss.backward()
            off.end_step()
            runs.append(off.plan.profiles)
        finally:
            off.close()
            sched.close()
    for one, *others in zip(*runs):
        for two in others:
            assert one.saved_bytes == two.saved_bytes > 0
            assert one.input_bytes == two.input_bytes > 0
            assert one.sel_saved_bytes == two.sel_saved_bytes > 0


def test_auto_falls_back_to_recomputing_every_layer_when_no_plan_has_the_margin(tmp_path):
    """A planned step measured far over the budget (more than any plan could save): dsx recomputes every
    layer, measures that, and keeps it once it is within the budget; gradients stay bitwise equal. The peak
    is stubbed as in the re-plan test (CPU has none to read)."""
    model, batches, want = _reference(12, 5)
    sched = Scheduler()
    cfg = _cfg(
        tmp_path, ["host"], policy="auto", profile_warmup_steps=0, memory_budget_gb=1.0, host_pool_gb=0.2
    )
    off = ActivationOffload(model, cfg, sched)
    measured: list[int] = []

    def fake_peak() -> int:
        measured.append(50 << 30 if not measured else 1 << 29)  # 49 GiB over, then half the budget
        return measured[-1]

    off._peak_since_mark = fake_peak  # type: ignore[method-assign]
    got, plans = _train_with_plans(model, batches, off, sched)
    assert not all(a.recomputed for a in plans[0].actions)  # the tiny model's plan recomputes little
    assert all(a.value == "recompute" for a in plans[1].actions), plans[1].actions
    assert len(measured) == 2 and plans[4] is plans[1]
    assert_same_grads(want, got)


@pytest.mark.parametrize("tiers", [["host"], ["ssd"]])
def test_inputs_every_layer_is_given_stay_on_the_device(tmp_path, tiers):
    """A mask made once and handed to every layer (as Megatron's attention_mask), saved by each layer's
    attention, stays on the device like a parameter: moved with layer 0, it made every later layer's
    backward wait for layer 0's read (130 ms a step on the H100). The rest still moves; gradients bitwise."""
    model, batches, want = _reference(23, 3, make=lambda: TinyGPT(by_keyword=True, shared_mask=True))
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(model, _cfg(tmp_path, tiers), sched)
    names: list[str] = []
    offload = off.mover.offload

    def spy(storage, layer, tier, name):
        names.append(name)
        return offload(storage, layer, tier, name)

    off.mover.offload = spy
    got = _train_closing(model, batches, off, sched)
    assert_same_grads(want, got)
    assert names and all(n != "(16, 16):torch.bool" for n in names), names
    assert any(n.endswith("torch.float32") for n in names)


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
        off._apply(["host"] + ["keep"] * 3, depth)
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
    backward (on the H100, one 64 MiB read buffer over a budget set at full recompute's peak)."""
    model, batches, want = _reference(23, 2, make=lambda: TinyGPT(layers=4))
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(model, _cfg(tmp_path, ["host"], host_pool_gb=0.2, write_barrier="off"), sched)
    left: list[int] = []

    def watch(module, args, out):  # registered after dsx's hook: its tensor hook fires after dsx's
        if torch.is_grad_enabled():
            out.register_hook(lambda g: left.append(len(off.mover.entries_of(2))))

    handle = off.layers[1].register_forward_hook(watch)
    try:
        off._apply(["recompute", "recompute", "host", "keep"], 1)
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


class _ReluBlock(torch.nn.Module):
    """Saves its output (ReLU keeps its result), which the next block's Linear saves too, as its input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(128, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class _ReluNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(128, 128)
        self.blocks = torch.nn.ModuleList(_ReluBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("actions", [["keep", "host", "keep"], ["host", "keep", "host"]], ids=["khk", "hkh"])
def test_a_storage_two_layers_save_moves_as_planned(tmp_path, actions):
    """The profile counts a storage two layers save under the first; the runtime must move it exactly when
    that layer moves, and a kept neighbour must not hold it: a moved layer leaves what a kept one saved
    before it, and a kept layer shares what a moved one moved before it."""
    from dsx.offload.plan import Action, _split

    torch.manual_seed(3)
    model = _ReluNet()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    batches = [torch.randn(64, 128, generator=g) for _ in range(3)]
    want = _steps(ref, batches, None)
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(model, _cfg(tmp_path, ["host"], policy="auto", profile_warmup_steps=0), sched)
    try:
        got = _steps(model, batches, off, actions=[actions, actions])
        profiles = off.plan.profiles
        moved = [r.bytes_by_tier.get("host", 0) for r in sched.telemetry.history[1:]]
    finally:
        off.close()
        sched.close()
    assert [len(p.saved_sizes) for p in profiles] == [2, 1, 1]  # emb out + out0; out1; out2
    planned = sum(_split(profiles, [Action(a) for a in actions], None)[0])
    assert moved == [planned, planned] and planned > 0
    assert_same_grads(want, got)
