"""benchmarks/_kernel_trace.py: the step summary read from a torch.profiler Chrome trace."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from benchmarks import _kernel_trace


def _brute_union(intervals: list[tuple[int, int]]) -> int:
    covered: set[int] = set()
    for a, b in intervals:
        covered.update(range(a, b))
    return len(covered)


def test_union_matches_counting_covered_points() -> None:
    rng = random.Random(3)
    for _ in range(50):
        iv = [(a, a + rng.randint(1, 40)) for a in (rng.randint(0, 400) for _ in range(rng.randint(1, 30)))]
        assert _kernel_trace.union_s([(float(a), float(b)) for a, b in iv]) == _brute_union(iv)


def test_summary_of_a_trace(tmp_path) -> None:
    rng = random.Random(7)
    events, compute, t = [], [], 0.0
    for _ in range(200):  # the compute stream: kernels with gaps, some under 20 us
        t += rng.choice([1.0, 5.0, 30.0, 100.0])
        d = rng.uniform(10, 300)
        events.append({"ph": "X", "cat": "kernel", "name": "k", "ts": t, "dur": d, "args": {"stream": 7}})
        compute.append((t, t + d))
        t += d
    side = [(rng.uniform(0, t), rng.uniform(1, 50)) for _ in range(40)]
    events += [
        {"ph": "X", "cat": "kernel", "name": "s", "ts": a, "dur": d, "args": {"stream": 20}} for a, d in side
    ]
    events += [
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 5.0, "dur": 1000.0,
         "args": {"bytes": 2e9}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 0.0, "dur": 250.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0.0, "dur": 5.0},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 1.0},
    ]  # fmt: skip
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = _kernel_trace.summarize(path)
    assert s["compute_stream"] == 7
    assert s["compute_stream_busy_s"] == pytest.approx(sum(b - a for a, b in compute) / 1e6)
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(compute)]
    assert s["compute_stream_gaps"] == sum(g >= 20 for g in gaps)
    assert s["compute_stream_idle_in_gaps_ge_20us_s"] == pytest.approx(sum(g for g in gaps if g >= 20) / 1e6)
    everything = compute + [(a, a + d) for a, d in side] + [(5.0, 1005.0)]
    assert s["gpu_busy_all_streams_s"] == pytest.approx(_kernel_trace.union_s(everything) / 1e6)
    assert s["copies"]["DtoH (Device -> Pinned)"]["gb"] == pytest.approx(2.0)
    assert s["host_blocked_in_cuda_s"] == {"cudaStreamSynchronize": pytest.approx(250e-6)}


def test_a_trace_without_gpu_activity_says_so(tmp_path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(
        json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 3}]})
    )
    assert "error" in _kernel_trace.summarize(path)
