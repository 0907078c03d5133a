"""``dsx trace``: a scheduler trace file (see :mod:`dsx.runtime.trace`) drawn as a timeline PNG.

Lanes are rows (``compute`` on top: each step a bar, exposed stalls in red over it; then one row per
I/O tier and gate), dashed lines mark step boundaries, the time axis is in milliseconds from the start
of the first step shown. One summary line per lane gives its busy time and share of the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dsx.runtime.telemetry import union_s
from dsx.runtime.trace import TRACE_FORMAT

__all__ = ["Timeline", "TraceError", "cli", "lane_summary", "load_timeline", "plot_timeline", "select_steps"]

Interval = tuple[str, float, float]  # (name, t0_ms, t1_ms)


class TraceError(ValueError):
    """The file is missing, is not a dsx trace, or the step range selects nothing."""


@dataclass
class Timeline:
    """One rank's steps and lane events, times in milliseconds."""

    rank: int
    steps: list[tuple[int, float, float]]  # (step, t0_ms, t1_ms), in time order
    lanes: dict[str, list[Interval]] = field(default_factory=dict)  # compute first


def load_timeline(path: str | os.PathLike[str]) -> Timeline:
    """Read a trace written by ``scheduler.trace_path``; :class:`TraceError` says what is wrong."""
    p = Path(path)
    if not p.is_file():
        ranks = sorted(p.parent.glob(f"{p.stem}.rank*{p.suffix}"))  # a multi-rank run writes one file a rank
        hint = (
            f" (a multi-rank run wrote {', '.join(r.name for r in ranks)}: give one of those)"
            if ranks
            else ""
        )
        raise TraceError(f"{p}: no such file{hint}")
    try:
        doc = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceError(f"{p}: not a JSON file ({exc})") from exc
    other = doc.get("otherData") if isinstance(doc, dict) else None
    if not isinstance(other, dict) or other.get("format") != TRACE_FORMAT:
        raise TraceError(
            f"{p}: not a dsx trace (no otherData.format {TRACE_FORMAT!r}); dsx writes one per rank "
            "when the config sets dsx.scheduler.trace_path"
        )
    try:
        events = doc["traceEvents"]
        lane_of = {
            e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"
        }
        tl = Timeline(rank=int(other.get("rank", 0)), steps=[], lanes={lane: [] for lane in other["lanes"]})
        for e in events:
            if e.get("ph") != "X":
                continue
            t0 = e["ts"] / 1e3
            t1 = t0 + e["dur"] / 1e3
            if e.get("cat") == "step":
                tl.steps.append((int(e["args"]["step"]), t0, t1))
            else:
                tl.lanes[lane_of[e["tid"]]].append((e["name"], t0, t1))
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"{p}: malformed dsx trace ({type(exc).__name__}: {exc})") from exc
    tl.steps.sort(key=lambda s: s[1])
    return tl


def select_steps(tl: Timeline, spec: str | None) -> Timeline:
    """Steps ``A <= step < B`` for ``spec`` ``"A:B"`` (either end may be left out); events clipped to them."""
    if not tl.steps:
        raise TraceError("the trace holds no steps yet (it is written every log_interval steps)")
    lo, hi = -1, sys.maxsize
    if spec:
        a, sep, b = spec.partition(":")
        try:
            if not sep:
                raise ValueError
            lo = int(a) if a.strip() else lo
            hi = int(b) if b.strip() else hi
        except ValueError:
            raise TraceError(
                f"--steps {spec!r}: expected A:B, e.g. 10:20 (step A up to, not including, B)"
            ) from None
    steps = [s for s in tl.steps if lo <= s[0] < hi]
    if not steps:
        held = f"{tl.steps[0][0]}..{tl.steps[-1][0]}"
        raise TraceError(f"--steps {spec}: no steps in that range; the trace holds steps {held}")
    w0, w1 = steps[0][1], steps[-1][2]
    lanes = {
        lane: [(n, max(t0, w0), min(t1, w1)) for n, t0, t1 in evs if t1 >= w0 and t0 <= w1]
        for lane, evs in tl.lanes.items()
    }
    return Timeline(rank=tl.rank, steps=steps, lanes=lanes)


def _union_ms(intervals: list[Interval]) -> float:
    """Time covered by at least one interval (I/O threads overlap one another)."""
    return union_s([(t0, t1) for _, t0, t1 in intervals])


def _stalls(evs: list[Interval]) -> list[Interval]:
    return [e for e in evs if e[0].startswith("stall:")]


def lane_summary(tl: Timeline) -> list[str]:
    """A header line, then per lane: busy ms and share of the wall time (compute: less its stalls)."""
    wall = tl.steps[-1][2] - tl.steps[0][1]
    first, last = tl.steps[0][0], tl.steps[-1][0]
    lines = [f"rank {tl.rank}: steps {first}..{last} ({len(tl.steps)}), wall {wall:.1f} ms"]
    width = max(len(lane) for lane in tl.lanes)
    for lane, evs in tl.lanes.items():
        if lane == "compute":
            stall = _union_ms(_stalls(evs))
            busy = sum(t1 - t0 for _, t0, t1 in tl.steps) - stall
            extra = f", stall {stall:.1f} ms ({100 * stall / wall:.1f}%)"
        else:
            busy, extra = _union_ms(evs), f", {len(evs)} events"
        lines.append(f"{lane:<{width}}  busy {busy:10.1f} ms ({100 * busy / wall:5.1f}% of wall){extra}")
    return lines


_IO_COLORS = ["tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:olive", "tab:cyan"]


def plot_timeline(tl: Timeline, out: str | os.PathLike[str], title: str = "") -> Path:
    """Draw ``tl`` to the PNG ``out`` (matplotlib, no display needed); returns the path.

    ``title`` (e.g. the file name) goes before the rank and step range in the heading.
    """
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    w0 = tl.steps[0][1]
    lanes = list(tl.lanes)
    fig = Figure(figsize=(12, 1.4 + 0.55 * len(lanes)))
    ax = fig.add_subplot()
    handles = []
    for row, lane in enumerate(lanes):
        y = (len(lanes) - 1 - row - 0.38, 0.76)
        evs = tl.lanes[lane]
        # a hairline edge keeps sub-pixel transfers visible at the scale of a whole step
        bar = {"linewidth": 0.4}
        if lane == "compute":
            ax.broken_barh([(t0 - w0, t1 - t0) for _, t0, t1 in tl.steps], y, color="tab:blue", **bar)
            spans = [(t0 - w0, t1 - t0) for _, t0, t1 in _stalls(evs)]
            ax.broken_barh(spans, y, color="tab:red", **bar)
            handles += [
                Patch(color="tab:blue", label="compute"),
                Patch(color="tab:red", label="stall (exposed)"),
            ]
            continue
        color = "0.55" if lane.startswith("gate:") else _IO_COLORS[(row - 1) % len(_IO_COLORS)]
        ax.broken_barh([(t0 - w0, t1 - t0) for _, t0, t1 in evs], y, color=color, **bar)
        handles.append(Patch(color=color, label=lane))
    bounds = [t0 - w0 for _, t0, _ in tl.steps] + [tl.steps[-1][2] - w0]
    every = max(1, len(tl.steps) // 20)  # at most ~20 step labels
    for i, x in enumerate(bounds):
        ax.axvline(x, color="black", linestyle="--", linewidth=0.7, alpha=0.6)
        if i < len(tl.steps) and i % every == 0:
            ax.text(x, len(lanes) - 0.5, f" step {tl.steps[i][0]}", fontsize=7, va="bottom", ha="left")
    handles.append(Line2D([], [], color="black", linestyle="--", linewidth=0.7, label="step boundary"))
    ax.set_yticks(range(len(lanes)), list(reversed(lanes)))
    ax.set_ylim(-0.6, len(lanes) - 0.1)
    ax.set_xlim(0, bounds[-1])
    ax.set_xlabel("time (ms)")
    heading = f"rank {tl.rank}, steps {tl.steps[0][0]}..{tl.steps[-1][0]}"
    ax.set_title(f"{title}: {heading}" if title else heading, pad=14)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    out = Path(out)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    return out


def cli(args: argparse.Namespace) -> int:
    """``dsx trace TRACE.json [-o out.png] [--steps A:B]``: draw the PNG and print the lane summary."""
    out = Path(args.output) if args.output else Path(args.trace).with_suffix(".png")
    try:
        tl = select_steps(load_timeline(args.trace), args.steps)
        plot_timeline(tl, out, title=Path(args.trace).name)
    except (TraceError, OSError) as exc:
        print(f"dsx trace: error: {exc}", file=sys.stderr)
        return 2
    for line in lane_summary(tl):
        print(line)
    print(f"wrote {out}")
    return 0
