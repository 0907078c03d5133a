"""Where a step's time goes on the GPU and on the host (a diagnostic for the benchmarks).

One step runs under ``torch.profiler`` with CUDA activity; :func:`summarize` reads the Chrome trace it
exports and reports, for the step: how long the GPU was busy on the stream that ran the most kernel time
(the compute stream) and on all streams together, how long that stream sat idle in gaps of 20 µs or more, the
copies by direction, and how long the host spent blocked in CUDA runtime calls (synchronizations, and
copies, which block on pageable host memory). A step slower than its kernels with the compute stream idle
and the host not blocked in CUDA is host-bound: Python (hooks, I/O threads holding the GIL) is slow to launch.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["summarize", "union_s"]

_BLOCKING = ("Synchronize", "cudaMemcpy", "cudaMalloc", "cudaFree", "cudaHostAlloc")


def union_s(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals (same unit as given)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _gaps(intervals: list[tuple[float, float]], at_least: float) -> tuple[float, int]:
    """Idle time between the merged ``intervals`` in gaps of ``at_least`` or more, and how many."""
    idle, n, end = 0.0, 0, None
    for a, b in sorted(intervals):
        if end is not None and a - end >= at_least:
            idle += a - end
            n += 1
        end = b if end is None else max(end, b)
    return idle, n


def summarize(trace: str | Path, gap_us: float = 20.0) -> dict[str, Any]:
    """Summarise a Chrome trace of one step exported by ``torch.profiler`` (times in seconds)."""
    events = json.loads(Path(trace).read_text())["traceEvents"]
    by_stream: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    gpu: list[tuple[float, float]] = []
    copies: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # kind -> [seconds, bytes]
    blocked: dict[str, float] = defaultdict(float)
    host: list[tuple[float, float]] = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        a, b = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        cat = e.get("cat", "")
        if cat == "kernel":
            by_stream[e.get("args", {}).get("stream")].append((a, b))
            gpu.append((a, b))
        elif cat == "gpu_memcpy":
            gpu.append((a, b))
            # e.g. "Memcpy DtoH (Device -> Pinned)": direction and kind of host memory (pageable copies block)
            c = copies[e.get("name", "Memcpy ?").removeprefix("Memcpy ")]
            c[0] += (b - a) / 1e6
            c[1] += float(e.get("args", {}).get("bytes", 0))
        elif cat == "cuda_runtime":
            host.append((a, b))
            name = e.get("name", "")
            if any(k in name for k in _BLOCKING):
                blocked[name] += (b - a) / 1e6
    if not gpu:
        return {"error": "no GPU activity in the trace"}
    compute_stream, compute = max(by_stream.items(), key=lambda kv: sum(b - a for a, b in kv[1]))
    start, end = min(a for a, _ in gpu), max(b for _, b in gpu)
    idle, n_gaps = _gaps(compute, gap_us)
    return {
        "gpu_span_s": (end - start) / 1e6,
        "compute_stream": compute_stream,
        "compute_stream_busy_s": union_s(compute) / 1e6,
        f"compute_stream_idle_in_gaps_ge_{gap_us:g}us_s": idle / 1e6,
        "compute_stream_gaps": n_gaps,
        "gpu_busy_all_streams_s": union_s(gpu) / 1e6,
        "kernel_s_by_stream": {str(k): sum(b - a for a, b in v) / 1e6 for k, v in by_stream.items()},
        "copies": {k: {"s": v[0], "gb": v[1] / 1e9} for k, v in copies.items()},
        "host_blocked_in_cuda_s": dict(sorted(blocked.items(), key=lambda kv: -kv[1])),
    }
