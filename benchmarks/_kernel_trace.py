"""Where a step's time goes on the GPU and on the host (a diagnostic for the benchmarks).

One step runs under ``torch.profiler`` with CUDA activity; :func:`summarize` reads the Chrome trace it
exports and reports, for the step: how long the GPU was busy on the stream that ran the most kernel time
(the compute stream) and on all streams together, how long that stream sat idle in gaps of 20 µs or more, the
copies by direction, and how long the host spent blocked in CUDA runtime calls (synchronizations, and
copies, which block on pageable host memory). A step slower than its kernels with the compute stream idle
and the host not blocked in CUDA is host-bound: Python (hooks, I/O threads holding the GIL) is slow to launch.
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["summarize", "union_s"]

_BLOCKING = ("Synchronize", "cudaMemcpy", "cudaMalloc", "cudaFree", "cudaHostAlloc")
_API = ("cuda_runtime", "cuda_driver")  # the host-side CUDA calls of a trace: runtime and driver API


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
        elif cat in _API:
            host.append((a, b))
            name = e.get("name", "")
            if any(k in name for k in _BLOCKING):
                blocked[name] += (b - a) / 1e6
    if not gpu:
        return {"error": "no GPU activity in the trace"}
    compute_stream, compute = max(by_stream.items(), key=lambda kv: sum(b - a for a, b in kv[1]))
    gap_causes = _gap_causes(events, compute_stream, gap_us)
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
        "gap_causes": gap_causes,
    }


def _gap_causes(events: list[dict[str, Any]], stream: Any, gap_us: float) -> dict[str, Any]:
    """Why the compute stream sat idle, gap by gap: the kernel ending a gap was either launched after the gap
    began (``host_late``: the host was behind; split by launching thread and by the outermost CPU op running
    the launch) or queued before it (``queued_early``: the stream waited on the GPU, for an event or a copy)."""
    kernels: list[tuple[float, float, Any]] = []  # the compute stream's
    launches: dict[Any, tuple[float, Any]] = {}  # correlation -> (host end of the launch call, thread)
    ops: dict[Any, list[tuple[float, float, str]]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        a, b, cat, args = (
            float(e["ts"]),
            float(e["ts"]) + float(e["dur"]),
            e.get("cat", ""),
            e.get("args", {}),
        )
        if cat == "kernel" and args.get("stream") == stream:
            kernels.append((a, b, args.get("correlation")))
        elif cat in _API and "correlation" in args:  # (cuBLASLt and Triton launch through the driver API)
            launches[args["correlation"]] = (b, e.get("tid"))
        elif cat in ("cpu_op", "user_annotation"):
            ops[e.get("tid")].append((a, b, e.get("name", "?")))
    tops = {tid: _top_level(lst) for tid, lst in ops.items()}
    late: dict[str, float] = defaultdict(float)
    late_ops: dict[str, float] = defaultdict(float)
    out = {"host_late": [0.0, 0], "queued_early": [0.0, 0], "launch_unknown": [0.0, 0]}
    end = None
    for a, b, corr in sorted(kernels):
        if end is not None and a - end >= gap_us:
            gap = a - end
            launch = launches.get(corr)
            kind = "launch_unknown" if launch is None else "host_late" if launch[0] > end else "queued_early"
            out[kind][0] += gap / 1e6
            out[kind][1] += 1
            if kind == "host_late":
                late[f"thread {launch[1]}"] += gap / 1e6
                late_ops[_outermost(tops.get(launch[1], ([], [])), launch[0])] += gap / 1e6
        end = b if end is None else max(end, b)
    top = sorted(late_ops.items(), key=lambda kv: -kv[1])[:10]
    return {**{k: {"s": v[0], "gaps": v[1]} for k, v in out.items()},
            "host_late_by_thread_s": dict(late), "host_late_by_outer_op_s": dict(top)}  # fmt: skip


def _top_level(ops: list[tuple[float, float, str]]) -> tuple[list[float], list[tuple[float, float, str]]]:
    """A thread's CPU ops that no other op of the thread contains, in time order (and their starts)."""
    top: list[tuple[float, float, str]] = []
    for a, b, name in sorted(ops, key=lambda o: (o[0], -o[1])):
        if not top or a >= top[-1][1]:
            top.append((a, b, name))
    return [a for a, _, _ in top], top


def _outermost(tops: tuple[list[float], list[tuple[float, float, str]]], t: float) -> str:
    """The name of the top-level CPU op running at host time ``t`` (``"(no op)"``: Python between ops)."""
    starts, top = tops
    i = bisect.bisect_right(starts, t) - 1
    return top[i][2] if i >= 0 and top[i][1] >= t else "(no op)"
