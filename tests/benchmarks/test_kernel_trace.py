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


def test_gap_causes_split_host_late_from_queued_early(tmp_path) -> None:
    """Each compute-stream gap of 20 us or more goes to the host (the kernel ending it was launched after the
    gap began: by thread, by the top-level op around the launch) or to the GPU (it was queued before)."""
    rng = random.Random(11)
    events, t, want = [], 0.0, {"host_late": 0.0, "queued_early": 0.0}
    by_thread: dict[str, float] = {}
    by_op: dict[str, float] = {}
    prev_end = None
    for corr in range(300):
        t += rng.choice([2.0, 25.0, 80.0])
        d = rng.uniform(10, 200)
        late = rng.random() < 0.5
        tid = rng.choice([1, 2])
        # launched after the previous kernel ended (late) or well before it (early)
        launch_end = (
            (prev_end + rng.uniform(0.5, t - prev_end)) if (late and prev_end is not None) else t - 1e4
        )
        events.append(
            {"ph": "X", "cat": "kernel", "ts": t, "dur": d, "args": {"stream": 7, "correlation": corr}}
        )
        api = (
            ("cuda_driver", "cuLaunchKernelEx")
            if rng.random() < 0.3
            else ("cuda_runtime", "cudaLaunchKernel")
        )
        events.append({"ph": "X", "cat": api[0], "name": api[1], "ts": launch_end - 1.0,
                       "dur": 1.0, "tid": tid, "args": {"correlation": corr}})  # fmt: skip
        op = f"op{corr % 3}"
        events.append(
            {"ph": "X", "cat": "cpu_op", "name": op, "ts": launch_end - 1.5, "dur": 1.6, "tid": tid}
        )
        events.append(
            {"ph": "X", "cat": "cpu_op", "name": "inner", "ts": launch_end - 1.2, "dur": 1.0, "tid": tid}
        )
        if prev_end is not None and t - prev_end >= 20:
            kind = "host_late" if launch_end > prev_end else "queued_early"
            want[kind] += (t - prev_end) / 1e6
            if kind == "host_late":
                by_thread[f"thread {tid}"] = by_thread.get(f"thread {tid}", 0.0) + (t - prev_end) / 1e6
                by_op[op] = by_op.get(op, 0.0) + (t - prev_end) / 1e6
        t += d
        prev_end = t
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    g = _kernel_trace.summarize(path)["gap_causes"]
    assert want["host_late"] > 0 and want["queued_early"] > 0
    assert g["host_late"]["s"] == pytest.approx(want["host_late"])
    assert g["queued_early"]["s"] == pytest.approx(want["queued_early"])
    assert g["host_late_by_thread_s"] == pytest.approx(by_thread)
    assert g["host_late_by_outer_op_s"] == pytest.approx(by_op)
