"""What is allocated at a step's memory peak, and where it was allocated (a diagnostic for the benchmarks).

``torch.cuda.memory._record_memory_history`` logs every allocation and free of the caching allocator with the
Python stack that made it. :func:`live_at_peak` replays that log: it follows the bytes allocated since
recording started (blocks allocated before it are not in the log and are left out), finds the highest point,
and groups the blocks live there by the innermost frame outside torch (the model's or dsx's line that asked
for the memory). The planner's predicted peak can then be set against what really was resident.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

__all__ = ["live_at_peak", "start", "stop_and_write"]


def start(max_entries: int = 400_000) -> None:
    """Record allocations from now on (Python stacks only: C++ symbolisation takes minutes)."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")


def _where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame outside torch and the standard library, plus the innermost dsx frame if any (the
    dsx code that ran the model's line: a recomputation, a prefetch)."""

    def library(fn: str) -> bool:  # torch itself, or the standard library (not site-/dist-packages)
        return "/torch/" in fn or ("/lib/python3" in fn and "-packages/" not in fn)

    # frames run innermost first
    outer = next((f for f in frames if not library(f["filename"])), None)
    ours = next((f for f in frames if "/dsx/" in f["filename"]), None)
    parts = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in (outer, ours) if f is not None]
    return " <- ".join(dict.fromkeys(parts)) or "?"


def live_at_peak(snapshot: dict[str, Any], top: int = 40, at: str = "peak") -> dict[str, Any]:
    """Replay the allocator trace of ``snapshot`` (``torch.cuda.memory._snapshot()``): the peak of the bytes
    allocated while recording, and the blocks live at it grouped by where they were allocated; ``at="end"``:
    the blocks live at the trace's end instead (after an allocation failed, what held the memory then: one
    large request can fail below an earlier peak)."""
    events = [e for trace in snapshot.get("device_traces", []) for e in trace]

    def replay(upto: int) -> tuple[dict[int, tuple[int, Any]], int, int]:
        """Blocks live after event ``upto``, and the peak (and its event) on the way there."""
        live: dict[int, tuple[int, Any]] = {}
        cur = peak = 0
        at = -1
        for k, e in enumerate(events[: upto + 1]):
            if e["action"] == "alloc":
                live[e["addr"]] = (e["size"], e.get("frames", []))
                cur += e["size"]
                if cur > peak:
                    peak, at = cur, k
            elif e["action"] == "free_requested" and e["addr"] in live:
                cur -= live.pop(e["addr"])[0]
        return live, peak, at

    live_end, peak, peak_at = replay(len(events) - 1)  # where the peak is, then what was live there
    at_peak = live_end if at == "end" else (replay(peak_at)[0] if peak_at >= 0 else {})
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, frames in at_peak.values():
        where = _where(frames)
        groups[where][0] += size
        groups[where][1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {
        "peak_bytes_since_recording": peak,
        "events": len(events),
        "live_at_peak": [{"where": w, "bytes": b, "blocks": n} for w, (b, n) in rows[:top]],
        "other_bytes": sum(b for _, (b, _) in rows[top:]),
    }


def stop_and_write(path: str, label: str, at: str = "peak") -> dict[str, Any]:
    """Take the snapshot, stop recording, write the summary (:func:`live_at_peak` ``at`` the peak or the end) to
    ``path`` (JSON) and return it."""
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    out = {"label": label, "at": at, **live_at_peak(snap, at=at)}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1))
    return out
