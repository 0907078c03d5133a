"""Activation offload on CPU: bitwise-equal gradients, dedup, in-place detection, integrity errors, I/O
backends, the storages a layer keeps or shares."""

from __future__ import annotations

import copy
import os
import re
import threading
import time

import pytest
import torch

from dsx.config import SchedulerConfig
from dsx.offload import ActivationOffload, OffloadIntegrityError
from dsx.offload.plan import Action
from dsx.runtime.scheduler import Scheduler
from tests.harness import needs_async_io
from tests.offload._offload_models import OddModel, TinyGPT, assert_same_grads
from tests.offload._runs import (
    _batches,
    _cfg,
    _reference,
    _steps,
    _train,
    _train_closing,
)


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


def _corrupt(kind: str, path: str, e, other) -> None:
    """Change an entry's bytes on disk behind dsx's back: 16 flipped bytes, a zeroed page, or the bytes of
    another tensor (a stale or misplaced block)."""
    with open(path, "r+b") as f:
        f.seek(e.ssd_off)
        b = f.read(min(e.nbytes, 4096))
        if kind == "flip":
            new = bytes(x ^ 0xFF for x in b[:16]) + b[16:]
        elif kind == "zero":
            new = bytes(len(b))
        else:
            f.seek(other.ssd_off)
            new = f.read(len(b))
            assert new != b
        f.seek(e.ssd_off)
        f.write(new)
        f.flush()
        os.fsync(f.fileno())


@pytest.mark.parametrize("kind", ["flip", "zero", "stale"])
@pytest.mark.parametrize("verify", ["default", True])
def test_corrupt_ssd_read_is_an_error(tmp_path, kind, verify):
    """Verified by default on the SSD tier: a corrupt read names layer, tier, file and offset, and no
    gradient comes out of it."""
    # Four layers: the end of forward already reads back the last layer and prefetch_depth more (3 and 2),
    # so layer 0 is read only during backward, after its bytes were changed.
    model = OddModel(layers=4)
    cfg = _cfg(tmp_path, ["ssd"])
    if verify == "default":
        cfg = type(cfg)(**cfg.model_dump(exclude={"verify"}))
        assert cfg.verify == "auto" and cfg.verified_tiers() == {"ssd"}
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(model, cfg, sched)
    try:
        y = model(torch.randn(4, 6, 48))
        off.mover.drain()
        e, other = off.mover.entries_of(0)[0], off.mover.entries_of(1)[0]
        assert e.tier == "ssd" and other.tier == "ssd"
        _corrupt(kind, off.ssd.path, e, other)
        message = rf"layer 0 .*from the ssd tier \({re.escape(off.ssd.path)} offset {e.ssd_off}\)"
        with pytest.raises(OffloadIntegrityError, match=message):
            y.sum().backward()
        # layer 0's own parameters (not the one all layers share) got no gradient from the corrupt bytes
        shared = {id(p) for p in model.layers[1].parameters()}
        own = [p for p in model.layers[0].parameters() if id(p) not in shared]
        assert own and all(p.grad is None for p in own)
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


def test_the_ssd_tier_is_timed_by_its_drive_calls_alone(tmp_path, monkeypatch):
    """The SSD tier's rate is the drive's: a write's span starts once it has passed the optimizer swap's gate
    (here shut for 0.8 s through the forward), a read's ends when the drive has filled the staging slot (its
    check after, slowed here by 0.25 s each, is not the drive's). The bytes all still count, and the gradients
    are those of a run without offload."""
    from dsx.offload import reads

    model, batches, want = _reference(3, 1, OddModel, "odd")
    real = reads.checksum

    def slow_check(t):
        time.sleep(0.25)
        return real(t)

    monkeypatch.setattr(reads, "checksum", slow_check)
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(model, _cfg(tmp_path, ["ssd"]), sched)
    gate = sched.gate("ssd")
    gate.clear()
    opener = threading.Timer(0.8, gate.set)
    opener.start()
    try:
        got = _train(model, batches, off)
    finally:
        opener.cancel()
        gate.set()
        off.close()
        sched.close()
    assert_same_grads(want, got)
    step = sched.telemetry.history[0]
    assert step.bytes_by_tier["ssd"] > 0 and step.bytes_by_tier["ssd_read"] == step.bytes_by_tier["ssd"]
    assert step.busy_by_tier["ssd"] < 0.4, step.busy_by_tier  # not the 0.8 s at the gate
    assert step.busy_by_tier["ssd_read"] < 0.2, step.busy_by_tier  # not the checks' 0.25 s each


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
@needs_async_io
def test_bitwise_equal_gradients_aio_backend(tmp_path):
    """DeepSpeed's AIO handle as the SSD backend (its JIT build takes minutes once, then is cached)."""
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
    sched = Scheduler(SchedulerConfig(io_workers=2))  # the backend's calls run on its "ssd" pool
    try:
        be = select_backend("posix", str(path), fd, sched)
        buf = torch.randint(0, 256, (8192,), dtype=torch.uint8)
        be.pwrite(buf, 4096).result()
        out = torch.zeros_like(buf)
        be.pread(out, 4096).result()
        assert torch.equal(out, buf)
        with pytest.raises(ValueError, match="4 KiB-aligned"):
            be.pwrite(buf[:100], 0)
        with pytest.raises(OSError, match=r"path=.*offset=1048576, size=8192"):
            be.pread(out, 1 << 20).result()  # past the end of the file
        # the calls ran on the scheduler's "ssd" pool (io_workers threads); closing the backend waits for its
        # own calls and leaves the shared pool running
        pool = sched.executor("ssd")
        assert be._pool is pool and pool._max_workers == 2
        be.close()
        assert pool.submit(lambda: 7).result() == 7
        with pytest.raises(RuntimeError, match="closed"):
            be.pwrite(buf, 4096)
    finally:
        os.close(fd)
        sched.close()


@pytest.mark.slow
def test_select_backend_auto_on_cpu_and_describe(tmp_path):
    """``auto`` without CUDA: aio where dsx's probe says DeepSpeed's op loads (it may JIT-build it), else posix;
    never kvikio. (Under DSX_TESTS_SKIP_ASYNC_IO=1 the probe says no: tests/conftest.py.)"""
    from dsx.offload.io import describe_backends, select_backend

    info = describe_backends()
    assert set(info) == {"posix", "aio", "kvikio"} and info["posix"]["available"]
    fd = os.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT, 0o600)
    sched = Scheduler(SchedulerConfig(io_workers=2))
    try:
        be = select_backend("auto", str(tmp_path / "f.bin"), fd, sched)
        assert be.name == ("aio" if info["aio"]["available"] else "posix")
        be.close()
    finally:
        os.close(fd)
        sched.close()


def test_select_backend_auto_does_not_try_aio_where_the_probe_says_it_cannot_build(tmp_path, monkeypatch):
    """Where dsx's probe says the async_io op can neither load nor build (libaio's runtime without its
    development files), ``auto`` opens posix without asking DeepSpeed for the op, whose build would fail at
    link time minutes into the start."""
    import dsx.offload.io as io

    tried = []

    class Refused(io.IOBackend):
        def __init__(self, *args, **kwargs):
            tried.append("aio")
            raise RuntimeError("the aio backend was tried")

    monkeypatch.setattr(io, "async_io_status", lambda: (False, "libaio-dev is not installed"))
    monkeypatch.setitem(io._BACKENDS, "aio", Refused)
    fd = os.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT, 0o600)
    sched = Scheduler(SchedulerConfig(io_workers=1))
    try:
        be = io.select_backend("auto", str(tmp_path / "f.bin"), fd, sched)
        assert be.name == "posix" and tried == []
        be.close()
        monkeypatch.setattr(io, "async_io_status", lambda: (True, "built"))
        be = io.select_backend("auto", str(tmp_path / "f.bin"), fd, sched)  # tried, refused, then posix
        assert be.name == "posix" and tried == ["aio"]
        be.close()
    finally:
        os.close(fd)
        sched.close()


@pytest.mark.parametrize("tiers", [["host"], ["ssd"]])
def test_inputs_every_layer_is_given_stay_on_the_device(tmp_path, tiers):
    """A mask made once and handed to every layer (as Megatron's attention_mask), saved by each layer's
    attention, stays on the device like a parameter: moved with layer 0, it made every later layer's
    backward wait for layer 0's read. The rest still moves; gradients bitwise."""
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
    from dsx.offload.plan.cost import _split

    torch.manual_seed(3)
    model = _ReluNet()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    batches = [torch.randn(64, 128, generator=g) for _ in range(3)]
    want = _steps(ref, batches, None)
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(model, _cfg(tmp_path, ["host"], policy="auto", profile_warmup_steps=0), sched)
    try:
        acts = [Action(a) for a in actions]
        got = _steps(model, batches, off, actions=[acts, acts])
        profiles = off.plan.profiles
        moved = [r.bytes_by_tier.get("host", 0) for r in sched.telemetry.history[1:]]
    finally:
        off.close()
        sched.close()
    assert [len(p.saved_sizes) for p in profiles] == [2, 1, 1]  # emb out + out0; out1; out2
    planned = sum(_split(profiles, [Action(a) for a in actions], None)[0])
    assert moved == [planned, planned] and planned > 0
    assert_same_grads(want, got)
