"""What the offload runtime gives back and when: slots, entries and graphs after dropped graphs and failed
reads; handles released by the cyclic GC inside a pack; saved tensors whose bits (conj, neg) or version
are not in their bytes. Real files in ``tmp_path``, CPU tensors."""

from __future__ import annotations

import copy
import errno
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from dsx.config import ActivationOffloadConfig, SchedulerConfig
from dsx.offload import ActivationOffload
from dsx.runtime.scheduler import Scheduler
from tests.harness import needs_async_io
from tests.offload._offload_models import OddModel, TinyGPT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _off(model, tmp_path, tiers, **kw):
    base = dict(enabled=True, tiers=tiers, policy="offload_all", host_pool_gb=0.05, min_tensor_bytes=0)
    base.update(io_backend="posix", verify=True)
    if "ssd" in tiers:
        (tmp_path / "ssd").mkdir(exist_ok=True)
        base.update(ssd_path=str(tmp_path / "ssd"), ssd_capacity_gb=0.05)
    base.update(kw)
    sched = Scheduler(SchedulerConfig(io_workers=2))
    return ActivationOffload(model, ActivationOffloadConfig(**base), sched), sched


def _settles(off, value, want, timeout=20.0):
    """``value()`` reaches ``want`` once the I/O threads are done (they run reads queued by forward's end) and
    the dead handles' entries are released (as the next pack, forward or step end would)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        gc.collect()
        off.hooks.release_dead()
        if value() == want:
            return True
        time.sleep(0.02)
    return value() == want


class _Stack(torch.nn.Module):
    def __init__(self, make, n=2):
        super().__init__()
        self.blocks = torch.nn.ModuleList(make() for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _max_grad_diff(make_model, x, tmp_path):
    torch.manual_seed(0)
    ref = make_model()
    m = copy.deepcopy(ref)
    ref(x).sum().backward()
    off, sched = _off(m, tmp_path, ["host"])
    try:
        m(x).sum().backward()
    finally:
        off.close()
        sched.close()
    return max((a.grad - b.grad).abs().max().item() for a, b in zip(ref.parameters(), m.parameters()))


def test_dropped_graphs_give_the_ssd_staging_slots_back(tmp_path):
    # forward's end queues the last layers' reads; a graph dropped before they run must not keep their slots
    torch.manual_seed(0)
    m = TinyGPT()
    off, sched = _off(m, tmp_path, ["ssd"])
    try:
        g = torch.Generator().manual_seed(5)
        for _ in range(10):
            m(torch.randint(0, 64, (2, 16), generator=g))  # an evaluation with grad on: output dropped
        off.mover.drain()
        assert _settles(off, lambda: off.host.arena.used, 0), f"host pool holds {off.host.arena.used} bytes"
        assert _settles(off, lambda: off.ssd.arena.used, 0)
    finally:
        off.close()
        sched.close()


def test_a_failed_read_frees_the_graph_and_every_slot(tmp_path):
    model = OddModel(layers=4)
    off, sched = _off(model, tmp_path, ["ssd"], verify=False)
    try:
        y = model(torch.randn(4, 6, 48))
        off.mover.drain()
        os.ftruncate(off.ssd.fd, 0)  # every later read fails: short read
        with pytest.raises(OSError, match="read failed"):
            y.sum().backward()
        del y

        def live():
            return sum(map(len, off.mover._entries.values())), off.ssd.arena.used, off.host.arena.used

        assert _settles(off, live, (0, 0, 0)), live()
    finally:
        off.close()
        sched.close()


def test_a_failed_reserve_gives_the_staging_slot_back(tmp_path, monkeypatch):
    # ENOSPC and the quota fall back to the host tier (test_failures.py); another error from the
    # filesystem (EIO here, injected: a real one cannot be produced on demand) propagates, with nothing held
    torch.manual_seed(0)
    m = TinyGPT()
    off, sched = _off(m, tmp_path, ["ssd"])
    try:

        def eio(*args):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "posix_fallocate", eio)
        with pytest.raises(OSError, match="Input/output error"):
            m(torch.randint(0, 64, (2, 16)))
        monkeypatch.undo()
        assert _settles(off, lambda: off.host.arena.used, 0), off.host.arena.used
    finally:
        off.close()
        sched.close()


class _LazyViewBlock(torch.nn.Module):
    """Saves a lazy view whose conj or neg is a bit on the tensor, not in its bytes."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin, self.kind = torch.nn.Linear(8, 16), kind

    def forward(self, x):
        c = torch.view_as_complex(self.lin(x).reshape(*x.shape[:-1], 8, 2))
        if self.kind == "conj":
            z = c.conj() * c.exp()  # mul saves the lazy conjugate view c.conj()
            return x + z.real + z.imag
        z = c.conj().imag * c.real  # imag of a conjugate view is a lazy negative view
        return x + z.sum(-1, keepdim=True)


@pytest.mark.parametrize("kind", ["conj", "neg"])
def test_lazy_conjugate_and_negative_views_come_back_with_their_bits(tmp_path, kind):
    assert _max_grad_diff(lambda: _Stack(lambda: _LazyViewBlock(kind)), torch.randn(4, 8), tmp_path) == 0.0


class _StatBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        self.stat = (h * h).mean()  # with grad on, never backpropagated: mul saves h at version 0
        h.mul_(2)  # legal: the version-0 saver never runs backward
        return x + h.sin()  # sin saves h at version 1: the same storage, other bytes


def test_a_storage_saved_again_after_an_inplace_change_is_moved_again(tmp_path):
    assert _max_grad_diff(lambda: _Stack(_StatBlock), torch.randn(8, 16), tmp_path) == 0.0


def test_handles_released_by_the_cyclic_gc_inside_a_pack_do_not_deadlock():
    # a forward that raised, its exception kept in a local, leaves its partial graph in a reference cycle;
    # the GC may free those handles during any allocation, including inside pack on the same thread
    script = textwrap.dedent(f"""
        import sys, faulthandler, torch
        sys.path.insert(0, {ROOT!r})
        from dsx.config import ActivationOffloadConfig, SchedulerConfig
        from dsx.offload import ActivationOffload
        from dsx.runtime.scheduler import Scheduler
        from tests.offload._offload_models import TinyGPT
        faulthandler.dump_traceback_later(200, exit=True)
        torch.manual_seed(0)
        m = TinyGPT(layers=4)
        sched = Scheduler(SchedulerConfig(io_workers=2))
        off = ActivationOffload(m, ActivationOffloadConfig(enabled=True, tiers=["host"], policy="offload_all",
                                host_pool_gb=0.05, min_tensor_bytes=0), sched)
        n = [0]
        def flaky(mod, args):
            n[0] += 1
            if n[0] % 3 == 0:
                raise RuntimeError("simulated OOM")
        m.blocks[2].fc1.register_forward_pre_hook(flaky)
        def step(x):
            try:
                loss = m(x).pow(2).mean()
            except RuntimeError as exc:
                failed = exc
                return
            loss.backward()
        for _ in range(200):
            step(torch.randint(0, 64, (2, 16)))
            off.end_step()
        import gc; gc.collect(); off.hooks.release_dead()
        print("FINISHED", off.host.arena.used)
        off.close(); sched.close()
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "FINISHED 0" in r.stdout, r.stderr[-3000:]


@needs_async_io
def test_aio_read_past_the_end_is_an_oserror(tmp_path):
    # DeepSpeed's aio handle asserts (the process aborts) on it; dsx must raise as the other backends do
    script = textwrap.dedent(f"""
        import os, sys, torch
        sys.path.insert(0, {ROOT!r})
        from dsx.config import SchedulerConfig
        from dsx.offload.io import AioBackend
        from dsx.runtime.scheduler import Scheduler
        path = {str(tmp_path / "f.bin")!r}
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        raw = torch.randint(0, 255, (16384 + 4096,), dtype=torch.uint8)
        s = (-raw.data_ptr()) % 4096
        buf = raw[s:s + 16384]
        sched = Scheduler(SchedulerConfig(io_workers=2))
        io = AioBackend(path, fd, sched)
        io.pwrite(buf, 0).result()
        os.ftruncate(fd, 4096)
        try:
            io.pread(buf, 0).result()
            print("NO ERROR")
        except OSError as e:
            print("OSERROR", e)
        io.close()
        sched.close()
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OSERROR [Errno 5] dsx aio read failed" in r.stdout, (
        r.stdout,
        r.stderr[-800:],
    )


def test_a_backward_gives_its_slots_back_as_it_ends(tmp_path):
    # handles die as backward frees the graph; their releases queue (finalizers take no locks) and run at the
    # backward's end, not at the next forward: read buffers must not stay through the optimizer step
    torch.manual_seed(0)
    m = TinyGPT()
    off, sched = _off(m, tmp_path, ["host"])
    try:
        loss = m(torch.randint(0, 64, (2, 16))).float().pow(2).mean()
        off.mover.drain()
        assert off.host.arena.used > 0
        loss.backward()
        assert off.host.arena.used == 0 and not any(off.mover._entries.values())
        assert off.host._buf is not None
        off.close()
        assert off.host._buf is None  # close gives the pool back (pinned on a GPU), not garbage collection
    finally:
        off.close()
        sched.close()


def test_close_waits_for_the_file_writes_of_a_dropped_graph(tmp_path):
    """A graph dropped while its SSD writes wait (the drive's gate shut, as for DeepSpeed's optimizer swap)
    releases its entries; closing must still wait for those writes before it closes the file, or they run on a
    closed descriptor (or one the process reused for another file), which waiting only for the writes of
    entries still held would allow."""
    torch.manual_seed(0)
    m = TinyGPT()
    # (no write barrier: on CPU the I/O threads copy, and under the shut gate the forward would wait for them)
    off, sched = _off(m, tmp_path, ["ssd"], verify=False, write_barrier="off")
    gate = sched.gate("ssd")
    opener = threading.Timer(0.5, gate.set)
    try:
        gate.clear()
        y = m(torch.randint(0, 64, (2, 16)))
        writes = [e.written for layer in range(len(m.blocks)) for e in off.mover.entries_of(layer)]
        assert writes and not any(f.done() for f in writes), (
            "the writes ran under the shut gate: nothing checked"
        )
        del y
        gc.collect()
        off.end_step()  # releases every entry of the dropped graph
        assert not any(off.mover._entries.values())
        opener.start()
        off.close()
        assert all(f.done() for f in writes), "close returned with file writes still queued"
        assert all(f.exception() is None for f in writes)
    finally:
        opener.cancel()
        gate.set()
        off.close()
        sched.close()


def test_a_layer_that_raises_closes_its_saved_tensor_hooks(tmp_path):
    """A forward that raises inside a moved layer leaves no dsx hooks behind: the caller's own hooks around
    the model come off as they exit, what runs next is not packed by dsx, and training goes on to the
    gradients of a run that never failed."""
    torch.manual_seed(3)
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(2)]
    want = []
    for x in batches:
        ref.zero_grad()
        ref(x).float().pow(2).mean().backward()
        want.append([p.grad.clone() for p in ref.parameters()])

    def boom(module, args):
        raise RuntimeError("layer 1 failed")

    off, sched = _off(model, tmp_path, ["host"])
    try:
        packed = []
        h = model.blocks[1].fc1.register_forward_pre_hook(boom)
        with pytest.raises(RuntimeError, match="layer 1 failed"):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t):
                model(batches[0])
        h.remove()
        n_packed, n_entries = len(packed), len(off.mover.entries_of(1))  # (the embedding's, before layer 0)
        a = torch.randn(64, 64, requires_grad=True)
        (a * a).sum().backward()  # no hooks of anyone's: neither the caller's (exited) nor layer 1's
        assert len(packed) == n_packed and len(off.mover.entries_of(1)) == n_entries
        for x, w in zip(batches, want):
            model.zero_grad()
            model(x).float().pow(2).mean().backward()
            off.end_step()
            for p, q in zip(model.parameters(), w):
                assert torch.equal(p.grad, q)
    finally:
        off.close()
        sched.close()


def test_a_tensor_moved_off_its_storage_by_data_is_not_matched_at_the_address_it_left(tmp_path):
    """``h.data = ...`` (as Megatron frees pipeline outputs) leaves ``h`` alive on another storage. Its old
    address, freed once the write ends, can come back as the next tensor of that size; saved then, that tensor
    must be moved as itself, not matched to ``h``'s bytes (the first saver never runs backward: legal).

    The next tensor is put on h's old storage here, as the allocator would: left to glibc, a block freed on
    the I/O thread went to that thread's cache, and whether the address came back depended on the suite's
    earlier tests (the guard below, that it came back, could then fail). With the dedup table's
    old check (the tensor alive, not on its storage) the gradient here is wrong."""
    seen = {"reused": 0}

    class Swap(torch.nn.Module):
        def forward(self, x):
            h = x * 2
            self.y = h.sin()  # saves h (moved); y is never backpropagated
            left = h.untyped_storage()
            old = left.data_ptr()
            h.data = torch.empty(1)
            for e in off.mover.entries_of(0):
                e.written.result()  # the write ended: h's old bytes are on the host
            z = x * 3  # (version 0, as h was saved at: only the storage check tells them apart)
            on_left = torch.empty(0, dtype=x.dtype).set_(left, 0, x.shape, x.stride())
            on_left.copy_(z.detach())
            z.data = on_left  # z keeps its graph and version; its bytes now sit where h's were
            seen["reused"] += z.untyped_storage().data_ptr() == old
            return z.cos()

    model = _Stack(Swap, n=1)
    off, sched = _off(model, tmp_path, ["host"])
    try:
        x = torch.randn(16, 16, requires_grad=True)
        want = -torch.sin(3 * x.detach()) * 3
        for _ in range(20):
            x.grad = None
            model(x).sum().backward()
            off.end_step()
            assert torch.equal(x.grad, want)
            if seen["reused"] >= 2:
                break
    finally:
        off.close()
        sched.close()
    assert seen["reused"] >= 1, "the allocator never gave the address back: the test checked nothing"


def test_a_full_pool_waits_for_staged_ssd_writes_to_give_their_slots_back(tmp_path):
    """SSD writes stage in the host pool until the drive has them. With a slow drive (each file write 0.2 s,
    later than a plan's rates would give) a small pool fills with staging; the next tensor then waits for a
    write to give its slot back (a ``pool-full`` stall) instead of staying on the device, where it would break
    the plan's memory budget: every tensor still reaches the SSD, and the gradients match a run that kept all.
    With the drive's gate shut (DeepSpeed's optimizer swap, maybe on this very thread) nothing waits."""
    from dsx.offload.align import align_up

    torch.manual_seed(0)
    ref = TinyGPT()
    x = torch.randint(0, 64, (2, 16))
    ref(x).float().pow(2).mean().backward()
    want = [p.grad.clone() for p in ref.parameters()]
    # the storages one forward moves, with a roomy pool
    (tmp_path / "roomy").mkdir()
    (tmp_path / "tight").mkdir()
    model = copy.deepcopy(ref)
    model.zero_grad()
    off, sched = _off(model, tmp_path / "roomy", ["ssd"], verify=False, write_barrier="off")
    try:
        y = model(x)
        sizes = [e.nbytes for layer in range(len(model.blocks)) for e in off.mover.entries_of(layer)]
        del y
    finally:
        off.close()
        sched.close()
    assert len(sizes) > 4
    # a pool of three of the largest slots, a slow drive
    model = copy.deepcopy(ref)
    model.zero_grad()
    pool_gb = 3 * align_up(max(sizes)) / 2**30
    off, sched = _off(
        model, tmp_path / "tight", ["ssd"], verify=False, write_barrier="off", host_pool_gb=pool_gb
    )
    pwrite = off.mover.ssd.io.pwrite

    def slow_pwrite(*args, **kw):
        time.sleep(0.2)
        return pwrite(*args, **kw)

    off.mover.ssd.io.pwrite = slow_pwrite
    safety = threading.Timer(10.0, sched.gate("ssd").set)
    try:
        loss = model(x).float().pow(2).mean()
        moved = [e for layer in range(len(model.blocks)) for e in off.mover.entries_of(layer)]
        assert len(moved) == len(sizes) and all(e.tier == "ssd" for e in moved)
        loss.backward()
        stalls = dict(sched.telemetry.current.stall_by)
        off.end_step()
        # the drive's gate shut: the tensors the pool cannot take stay on the device, nothing waits (a timer opens
        # the gate if something does, so that a regression fails here rather than hangs)
        with sched.paused("ssd"):
            safety.start()
            y = model(x)
            held = sum(len(off.mover.entries_of(layer)) for layer in range(len(model.blocks)))
            paused_stalls = dict(sched.telemetry.current.stall_by)
        del y
    finally:
        safety.cancel()
        off.close()
        sched.close()
    assert stalls.get("pool-full", 0) > 0, stalls
    assert held < len(sizes) and "pool-full" not in paused_stalls, (held, paused_stalls)
    for p, w in zip(model.parameters(), want):
        assert torch.equal(p.grad, w)
