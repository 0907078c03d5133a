"""bench_hetero.py --quick runs on the CPU and writes its JSON + PNG (the real run is on the H100): every dsx
pipeline timed over interleaved repeats, the per-batch preparation share, the learning comparison, and PyG's
pipeline measured or the reason it could not run recorded."""

from __future__ import annotations

import json
import time

import torch

from tests.harness import load_example


def test_bench_hetero_quick(tmp_path) -> None:
    mod = load_example("benchmarks/bench_hetero.py")
    mod.main(["--quick", "--models", "rgcn,hgt", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_hetero.json").read_text())
    assert (tmp_path / "bench_hetero.png").stat().st_size > 0
    for model in ("rgcn", "hgt"):
        out = saved["models"][model]
        for name in ("dsx_host", "dsx_gpu"):
            r = out["runs"][name]
            assert len(r["batch_ms_all"]) == 3 and r["batch_ms_min"] <= r["batch_ms"] <= r["batch_ms_max"]
            assert r["epoch_s"] > 0
        assert "pyg_w0" in out["runs"]  # measured, or why PyG could not sample
        assert 0 < out["prep_share_of_batch"]
        learned = out["learning"]["runs"]["dsx_gpu"]
        assert [r["seed"] for r in learned] == [0, 1]  # one run per seed, each from its own weights
        assert all(len(r["losses"]) == 6 and r["val_seeds"] > 0 for r in learned)
        assert out["learning"]["val_acc"]["dsx_gpu"]["all"] == [r["val_acc"] for r in learned]
    # --merge keeps the models this run does not run
    mod.main(["--quick", "--models", "rgat", "--out", str(tmp_path), "--merge", "--learn-steps", "0"])
    merged = json.loads((tmp_path / "bench_hetero.json").read_text())
    assert list(merged["models"]) == ["rgcn", "rgat", "hgt"]
    assert merged["models"]["hgt"] == saved["models"]["hgt"]
    # each model keeps the time of the run that measured it
    assert merged["model_runs_utc"]["hgt"] == saved["model_runs_utc"]["hgt"]
    assert sorted(merged["model_runs_utc"]) == ["hgt", "rgat", "rgcn"]
    assert merged["model_runs_utc"]["rgat"] >= saved["model_runs_utc"]["hgt"]


class _SlowRows(torch.utils.data.Dataset):
    """Rows that take ``delay`` seconds each to make: a loader whose workers fall behind a fast step."""

    def __init__(self, delay: float, slow: float = 0.0, workers: int = 1) -> None:
        self.delay, self.slow, self.workers = delay, slow, workers

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> torch.Tensor:
        # torch hands batch i to worker i % workers: worker 0 makes every slow one
        time.sleep(self.slow if self.slow and i % self.workers == 0 else self.delay)
        return torch.full((4,), float(i))


def _pipe(name: str, loader: object, step_s: float):
    """bench_hetero's pipeline over ``loader`` with a step that takes the next batch and ``step_s`` seconds."""
    mod = load_example("benchmarks/bench_hetero.py")

    class Pipe(mod._Pipeline):
        def step(self, b=None) -> torch.Tensor:
            self.next_batch()
            time.sleep(step_s)
            return torch.zeros(())

    return Pipe(name, loader, torch.nn.Linear(1, 1), torch.device("cpu"), "paper")


def _drained(delay: float, step_s: float, warmup: int = 1, workers: int = 2, prefetch: int = 2,
             slow: float = 0.0) -> tuple[int, int, float, float]:  # fmt: skip
    """(batches drain() trained, the loader's buffered batches, the wait of the drain's last step, the waits of
    the 4 batches after the drain) for a real DataLoader whose queue filled while nothing consumed it; with
    ``slow``, worker 0's batches take that long instead of ``delay``."""
    loader = torch.utils.data.DataLoader(_SlowRows(delay, slow, workers), batch_size=None, num_workers=workers,
                                         prefetch_factor=prefetch, persistent_workers=True)  # fmt: skip
    pipe = _pipe("pyg_w2", loader, step_s)
    pipe.next_batch()  # starts the workers
    time.sleep(0.2 + 3 * prefetch * max(delay, slow))  # they fill the queue
    n = pipe.drain(warmup=warmup)
    last = pipe.last_wait
    wait = 0.0
    for _ in range(4):
        pipe.next_batch()
        wait += pipe.last_wait
    pipe._it._shutdown_workers()
    return n, pipe.buffered(), last, wait


def test_drain_stops_when_the_queue_is_empty() -> None:
    # workers 20x slower than the step: the filled queue (4 batches) is all that is served without waiting
    n, buffered, _, wait = _drained(delay=0.1, step_s=0.002)
    assert buffered == 4
    assert buffered <= n <= buffered + 3 < 1 + 4 * buffered
    assert wait > 0.12  # what follows the drain comes at the workers' pace: 2 batches per 0.1 s


def test_drain_stops_a_round_after_the_queued_batches_when_workers_keep_ahead() -> None:
    # workers 10x faster than the step: once the filled queue is trained, a worker is idle after each of the
    # next 2 steps (a round of both workers); the step sets the pace, there is nothing to drain (no run to the
    # cap of 17)
    n, buffered, _, wait = _drained(delay=0.002, step_s=0.02)
    assert buffered == 4 and n == buffered + 2
    assert wait < 0.02  # and what follows comes from the refilled queue without waiting
    # a warm-up longer than the queue is still trained
    assert _drained(delay=0.002, step_s=0.02, warmup=6)[0] == 6 + 2


def test_drain_counts_a_worker_idle_only_with_all_its_prefetched_batches_ready() -> None:
    # 3 batches prefetched per worker, workers slower than the step (30 ms a batch against 20): more ready
    # batches than workers is no idle worker, so the drain goes on past the queue to the first wait
    n, buffered, _, wait = _drained(delay=0.06, step_s=0.02, prefetch=3)
    assert buffered == 6 and n > buffered
    assert wait > 0.01  # what follows comes at the workers' pace (about 10 ms a batch more than the step)


def test_drain_is_not_ended_by_batches_a_slow_one_holds_back() -> None:
    # worker 0's batches take 0.3 s, the other three's 0.01: the others' finished batches wait behind each
    # slow one (idle workers, but the loader sets the pace: 75 ms a batch); within a round the step waits for
    # the slow batch, and that wait, not the idle workers, ends the drain
    n, buffered, last, wait = _drained(delay=0.01, step_s=0.03, workers=4, slow=0.3)
    assert n > buffered
    assert (
        last > 0.01
    )  # the drain's last step waited (ready batches come in about 1 ms; a wait that ends it, 10+)
    assert wait > 0.05  # and the next round comes at the slow worker's pace (ready ones: about 4 ms for four)


class _ReadyLoader:
    """A loader that is always ahead of the step, as dsx's is when the step is the slower stage: every batch
    is ready (``prefetch`` is what the bench reads as its queue)."""

    prefetch = 3

    def __iter__(self):
        return (torch.full((4,), float(i)) for i in range(10_000))


def test_drain_stops_at_its_cap_when_the_loader_keeps_ahead() -> None:
    pipe = _pipe("dsx_gpu", _ReadyLoader(), 0.005)
    assert pipe.buffered() == 3
    assert pipe.drain(warmup=2) == 2 + 4 * 3


class _PacedLoader:
    """A loader that makes each batch in ``delay`` seconds, ``batches`` an epoch, in a generator (as dsx's
    loaders iterate), and counts the iterations closed and the batches its ``transform`` saw."""

    prefetch = 0

    def __init__(self, delay: float, batches: int = 10_000) -> None:
        self.delay, self.batches, self.closed, self.transformed = delay, batches, 0, 0

    def transform(self, b: torch.Tensor) -> torch.Tensor:
        self.transformed += 1
        return b

    def __iter__(self):
        try:
            for i in range(self.batches):
                time.sleep(self.delay)
                yield torch.full((4,), float(i))
        finally:
            self.closed += 1


def test_alone_times_the_loader_and_the_step_apart() -> None:
    """--breakdown's loader-alone and step-alone figures: a 30 ms loader and a 5 ms step are told apart (the
    pipeline's time is near the larger when they overlap, near the sum when they do not); the iteration the
    pipeline had open and those the measure opened are closed, epochs shorter than the measure roll over, and
    the loader's transform runs again before each step (its cache may have dropped the batch's work)."""
    mod = load_example("benchmarks/bench_hetero.py")
    steps: list[torch.Tensor] = []

    class Pipe(mod._Pipeline):
        def step(self, b=None) -> torch.Tensor:
            steps.append(b)
            time.sleep(0.005)
            return torch.zeros(())

    loader = _PacedLoader(0.03)
    pipe = Pipe("dsx_gpu", loader, torch.nn.Linear(1, 1), torch.device("cpu"), "paper")
    pipe.next_batch()  # an open iteration, as after the timed batches
    got = pipe.alone(4)
    assert 25 <= got["loader_alone"] < 200 and got["step_alone"] < 20, got
    assert loader.closed == 2 and pipe._it is None
    assert len(steps) == 5 and loader.transformed == 5  # the step ran on the batches taken first
    short = _PacedLoader(0.001, batches=3)  # 11 batches needed: four epochs
    Pipe("dsx_host", short, torch.nn.Linear(1, 1), torch.device("cpu"), "paper").alone(4)
    assert short.closed == 4 and [float(b[0]) for b in steps[-5:]] == [0.0, 1.0, 2.0, 0.0, 1.0]
