"""NeighborLoader's prefetch belongs to the runtime scheduler: batches are prepared on its "loader" pool (and
stream), the caller's waits are the loader's stall, an early break leaves nothing running, and prefetching
never changes which batches come out."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import dsx
from dsx import defaults
from dsx.config import SchedulerConfig
from dsx.data.rmat import rmat_graph
from dsx.direct import NeighborLoader
from dsx.runtime.scheduler import Scheduler

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


@pytest.fixture
def sched():
    s = Scheduler(SchedulerConfig())
    yield s
    s.close()


@pytest.fixture(scope="module")
def data():
    return rmat_graph(1200, 9000, 6, 3, seed=11)


def _same(a, b) -> bool:
    return (
        torch.equal(a.n_id, b.n_id)
        and torch.equal(a.edge_index, b.edge_index)
        and torch.equal(a.e_id, b.e_id)
        and torch.equal(a.x, b.x)
        and torch.equal(a.y, b.y)
        and torch.equal(a.input_id, b.input_id)
        and a.num_sampled_nodes == b.num_sampled_nodes
        and a.num_sampled_edges == b.num_sampled_edges
    )


def _check_batches(loader, data, batches) -> None:
    """Right seeds in the right order, features and labels of the sampled nodes."""
    assert len(batches) == len(loader)
    assert torch.equal(torch.cat([b.input_id.cpu() for b in batches]), loader.rank_positions())
    for b in batches:
        n_id = b.n_id.cpu()
        # input_id: the seeds' positions in input_nodes, as PyG's loader gives them
        assert torch.equal(n_id[: b.batch_size], loader.input_nodes[b.input_id.cpu()])
        assert torch.equal(b.x.cpu(), data.x[n_id]) and torch.equal(b.y.cpu(), data.y[n_id])


def _spy_make(monkeypatch, loader, slow: dict[int, float] | None = None, fail_at: int | None = None):
    """Wrap loader._make: record each call's thread and input, optionally sleep or raise for a batch."""
    calls: list[tuple[str, int]] = []
    active = [0]
    real = loader._make
    index = {int(c[0]): i for i, c in enumerate(loader._batches())}  # first seed -> batch number

    def make(chunk):
        i = index.get(int(chunk[0]), -1)  # -1: a batch of another epoch
        calls.append((threading.current_thread().name, i))
        active[0] += 1
        try:
            if slow and i in slow:
                time.sleep(slow[i])
            if fail_at == i:
                raise RuntimeError(f"injected failure in batch {i}")
            return real(chunk)
        finally:
            active[0] -= 1

    monkeypatch.setattr(loader, "_make", make)
    return calls, active


def test_batches_are_prepared_on_the_schedulers_loader_pool(monkeypatch, data, sched) -> None:
    loader = NeighborLoader(data, [4, 3], batch_size=150, shuffle=True, prefetch=2, scheduler=sched)
    assert loader.scheduler is sched
    calls, _ = _spy_make(monkeypatch, loader)
    batches = list(loader)
    _check_batches(loader, data, batches)
    assert [i for _, i in calls] == list(range(len(loader)))  # in order: one thread, one generator
    assert all(name.startswith("dsx-loader") for name, _ in calls), calls
    # Without scheduler=: the process default's pool.
    other = NeighborLoader(data, [4, 3], batch_size=150, prefetch=1)
    assert other.scheduler is defaults.scheduler()
    calls, _ = _spy_make(monkeypatch, other)
    _check_batches(other, data, list(other))
    assert calls and all(name.startswith("dsx-loader") for name, _ in calls)


def test_a_slow_batch_is_the_loaders_stall_in_the_telemetry(monkeypatch, data, tmp_path) -> None:
    sched = Scheduler(SchedulerConfig(enabled=True, trace_path=str(tmp_path / "trace.json")))  # keeps events
    try:
        loader = NeighborLoader(data, [4, 3], batch_size=200, prefetch=1, scheduler=sched)
        _spy_make(monkeypatch, loader, slow={2: 0.4})
        batches = list(loader)
        _check_batches(loader, data, batches)
        rec = sched.telemetry.current
        assert rec.stall_by["loader"] >= 0.3 and rec.stall_s >= rec.stall_by["loader"]
        waits = {name[len("stall:") :]: t1 - t0 for lane, name, t0, t1 in rec.events if lane == "compute"}
        labels = [f"{loader.label}:0:{i}" for i in range(len(loader))]
        assert sorted(waits) == sorted(labels)  # one deadline per batch, named after the loader
        assert waits[labels[2]] >= 0.3 and max(waits, key=waits.get) == labels[2]
        assert not any(k.startswith(loader.label) for k in sched._pending)  # every deadline was joined
    finally:
        sched.close()


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_the_loader_creates_no_thread_or_stream_of_its_own(monkeypatch, data, device) -> None:
    made_streams: list[object] = []
    real_stream = torch.cuda.Stream

    def stream(*args, **kwargs):
        if "stream_id" not in kwargs:  # (torch wraps existing streams, e.g. current_stream(), this way too)
            made_streams.append(args or kwargs)
        return real_stream(*args, **kwargs)

    started: list[str] = []
    real_start = threading.Thread.start

    def start(self):
        started.append(self.name)
        return real_start(self)

    monkeypatch.setattr(torch.cuda, "Stream", stream)
    monkeypatch.setattr(threading.Thread, "start", start)
    sched = Scheduler(SchedulerConfig(), device=torch.device(device, 0) if device == "cuda" else None)
    try:
        loader = NeighborLoader(data, [4, 3], batch_size=150, prefetch=3, scheduler=sched, device=device)
        for epoch in range(2):
            loader.set_epoch(epoch)
            for b in loader:
                assert torch.equal(b.x.cpu(), data.x[b.n_id.cpu()])
                assert not any(t.name == "dsx-neighbor-loader" for t in threading.enumerate())
        loader.close()
        assert "dsx-neighbor-loader" not in started
        assert started and all(name.startswith("dsx-loader") for name in started), started
        assert len(started) == 1  # the scheduler's one loader thread, for both epochs
        if device == "cuda":
            # the scheduler's streams: sampling's and the gathers'
            assert len(made_streams) == 2 and set(sched._streams) == {"loader", "gather"}
        else:
            assert made_streams == []
    finally:
        sched.close()


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("how", ["break", "close"])
def test_an_early_break_then_a_new_epoch_gives_correct_batches(monkeypatch, data, how, device) -> None:
    sched = Scheduler(SchedulerConfig(), device=torch.device(device, 0) if device == "cuda" else None)
    kw = dict(batch_size=100, shuffle=True, seed=2, device=device)
    loader = NeighborLoader(data, [4, 3], prefetch=3, scheduler=sched, **kw)
    ref = NeighborLoader(data, [4, 3], prefetch=0, **kw)
    calls, active = _spy_make(monkeypatch, loader, slow={i: 0.05 for i in range(len(loader))})
    if how == "break":
        for i, b in enumerate(loader):
            assert torch.equal(b.x.cpu(), data.x[b.n_id.cpu()])
            if i == 1:
                break
    else:
        it = iter(loader)
        next(it), next(it)
        it.close()
    # Nothing of the abandoned epoch runs on: the batch in progress finished, the others were dropped.
    assert active[0] == 0
    assert not any(k.startswith(loader.label) for k in sched._pending)
    n_prepared = len(calls)
    time.sleep(0.2)
    assert len(calls) == n_prepared and n_prepared <= 2 + 3
    # The next epoch: every batch correct, and exactly the batches an unpipelined loader in the same
    # random state gives (a leftover task of the old epoch would have drawn from the generator meanwhile).
    loader.set_epoch(1)
    ref.set_epoch(1)
    ref.sampler.generator.set_state(loader.sampler.generator.get_state())
    batches = list(loader)
    _check_batches(loader, data, batches)
    assert all(_same(a, b) for a, b in zip(batches, ref, strict=True))
    loader.close()
    ref.close()
    sched.close()


def test_an_error_in_a_batch_surfaces_in_the_caller(monkeypatch, data, sched) -> None:
    loader = NeighborLoader(data, [4, 3], batch_size=100, prefetch=2, scheduler=sched)
    _, active = _spy_make(monkeypatch, loader, fail_at=3)
    got = []
    with pytest.raises(RuntimeError, match="injected failure in batch 3"):
        for b in loader:
            got.append(b)
    assert len(got) == 3 and active[0] == 0
    assert not any(k.startswith(loader.label) for k in sched._pending)
    monkeypatch.undo()
    _check_batches(loader, data, list(loader))  # the loader (and the pool) still work


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_same_seed_same_batches_with_and_without_prefetch(data, device) -> None:
    sched = Scheduler(SchedulerConfig(), device=torch.device(device, 0) if device == "cuda" else None)
    kw = dict(batch_size=128, shuffle=True, seed=5, input_nodes=data.train_mask, device=device)
    loaders = [NeighborLoader(data, [5, 4], prefetch=p, scheduler=sched, **kw) for p in (0, 1, 4)]
    for epoch in range(2):
        runs = []
        for ld in loaders:
            ld.set_epoch(epoch)
            runs.append(list(ld))
        _check_batches(loaders[0], data, runs[0])
        for other in runs[1:]:
            assert all(_same(a, b) for a, b in zip(runs[0], other, strict=True))
    for ld in loaders:
        ld.close()
    sched.close()


def _engine(dsx_section: dict | None):
    """A real DeepSpeed engine through dsx.initialize (a plain DeepSpeed engine when ``dsx_section`` is None)."""
    model = torch.nn.Linear(4, 4)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"torch_adam": True}},
    }
    if dsx_section is not None:
        config["dsx"] = dsx_section
    engine, _, _, _ = dsx.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def test_prefetch_and_scheduler_come_from_the_engine_or_the_defaults(data) -> None:
    engine = _engine({"unified": {"enabled": True, "prefetch_batches": 3}})
    try:
        sched = engine.dsx.scheduler
        ld = NeighborLoader(data, [2], batch_size=300, engine=engine)
        assert ld.prefetch == 3 and ld.scheduler is sched
        assert NeighborLoader(data, [2], engine=engine, prefetch=0).prefetch == 0  # an explicit value wins
        other = Scheduler()
        try:
            assert NeighborLoader(data, [2], engine=engine, scheduler=other).scheduler is other
        finally:
            other.close()
        _check_batches(ld, data, list(ld))
    finally:
        engine.dsx.close()
    off = _engine({"scheduler": {"enabled": True}})  # dsx attached, its unified section not enabled
    try:
        assert NeighborLoader(data, [2], engine=off).prefetch == defaults.get("unified").prefetch_batches == 1
    finally:
        off.dsx.close()
    plain = _engine(None)  # plain DeepSpeed: no engine.dsx
    assert NeighborLoader(data, [2], engine=plain).scheduler is defaults.scheduler()
    with defaults.set("unified", prefetch_batches=2):
        assert NeighborLoader(data, [2]).prefetch == 2


def test_every_rank_gets_as_many_batches_however_few_the_seeds(data) -> None:
    """Fewer seeds than ranks: the seeds are repeated so that every rank runs the same number of steps (a
    rank without a batch would leave the others waiting in their collectives)."""
    for n_seeds in (1, 3):
        seeds = torch.arange(n_seeds)
        loaders = [NeighborLoader(data, [2], batch_size=2, input_nodes=seeds, rank=r, world_size=4, prefetch=0)
                   for r in range(4)]  # fmt: skip
        assert [len(ld) for ld in loaders] == [1] * 4
        for ld in loaders:
            (b,) = list(ld)
            assert b.batch_size == 1 and torch.equal(ld.input_nodes[b.input_id.cpu()], b.n_id[:1].cpu())


@pytest.mark.gpu
def test_a_closed_loader_still_gives_correct_batches(data) -> None:
    """close() unregisters the host features the loader pinned; a later epoch indexes the host table."""
    loader = NeighborLoader(data, [3], batch_size=100, device="cuda", prefetch=0)
    first = list(loader)
    loader.close()
    again = list(loader)
    assert len(again) == len(first)
    for b in again:
        assert torch.equal(b.x.cpu(), data.x[b.n_id.cpu()])


@pytest.mark.gpu
def test_auto_csr_placement_counts_memory_torch_holds_unused() -> None:
    """Blocks torch's allocator holds unused (the scratch of a graph built on the GPU) are free for a CSR:
    counting only the memory the driver reports free would send a CSR that fits to host memory, sampling on
    the CPU. A CSR that does not fit goes there with a warning that says so."""
    from dsx.direct.pipeline import csr_device

    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    free0, _ = torch.cuda.mem_get_info(dev)
    block = torch.empty(int(free0 * 0.6), dtype=torch.uint8, device=dev)
    del block  # cached by torch, unused
    free, _ = torch.cuda.mem_get_info(dev)
    need = int(0.45 * free0)
    assert need > free // 2  # what the driver alone reports would send it to the host
    assert csr_device("auto", dev, need) == dev
    with pytest.warns(UserWarning, match="sampling runs on the CPU"):
        assert csr_device("auto", dev, 2 * free0) == torch.device("cpu")
    assert csr_device("gpu", dev, 2 * free0) == dev and csr_device("host", dev, 1) == torch.device("cpu")
    torch.cuda.empty_cache()


def test_a_given_csr_samples_as_the_edge_list_and_a_bad_one_is_named(data) -> None:
    from dsx.direct.sampler import to_csr

    rowptr, col, perm = to_csr(data.edge_index, data.num_nodes)
    csr = {"rowptr": rowptr, "col": col.int(), "x": data.x, "y": data.y}
    kw = dict(batch_size=64, shuffle=True, seed=3, prefetch=0)
    for a, b in zip(NeighborLoader(data, [4, 3], **kw), NeighborLoader(csr, [4, 3], **kw), strict=True):
        assert torch.equal(a.n_id, b.n_id) and torch.equal(a.edge_index, b.edge_index)
        assert torch.equal(a.e_id, perm[b.e_id])  # the CSR's positions, the edge list's ids
    bad = {
        "rowptr without col": {"rowptr": rowptr},
        "1-D of num_nodes": {"rowptr": rowptr.view(1, -1), "col": col},
        "int32 or int64": {"rowptr": rowptr, "col": col.float()},
        "never decrease": {"rowptr": rowptr.flip(0), "col": col},
        r"outside \[0, 1200\)": {"rowptr": rowptr, "col": col.index_fill(0, torch.tensor([7]), 1200)},
    }
    for message, given in bad.items():
        with pytest.raises(ValueError, match=message):
            NeighborLoader({**given, "x": data.x}, [2])


def test_a_loader_pickles_and_copies_into_one_that_makes_the_same_batches(data) -> None:
    """A loader holds no per-thread or per-process state (the pipeline's is kept off it): pickled, or deep-copied,
    it makes the batches the original makes."""
    import copy
    import pickle

    loader = NeighborLoader(data, [4, 3], batch_size=200, shuffle=True, seed=2, prefetch=0)
    twins = [pickle.loads(pickle.dumps(loader)), copy.deepcopy(loader)]
    want = list(loader)
    for twin in twins:
        assert all(_same(a, b) for a, b in zip(want, twin, strict=True))
