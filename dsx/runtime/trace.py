"""The scheduler's timeline as a Chrome trace-event file, one per rank (``scheduler.trace_path``).

The file is the JSON object format of the Trace Event Format (``{"traceEvents": [...]}``): complete
(``"X"``) events in microseconds from the start of the first step in the file, one thread id per lane
(``compute``, ``io:<tier>``, ``gate:<device>``), a process named ``rank <r>``. Each step is an ``X`` event
on the ``compute`` lane carrying the step's scalars; stalls are nested inside it. It opens in Perfetto
(ui.perfetto.dev) or ``chrome://tracing``, and ``dsx trace`` draws it as a PNG.

Only the last ``trace_steps`` steps are kept; the whole file is rewritten (to a temporary file, then
renamed) every ``log_interval`` steps and at close, so a killed run leaves a complete file of its
recent steps.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

from dsx.runtime.telemetry import StepRecord

__all__ = ["TRACE_FORMAT", "TraceWriter", "chrome_trace", "rank_path"]

logger = logging.getLogger("dsx")

TRACE_FORMAT = "dsx-trace"  # otherData.format: how `dsx trace` tells a dsx trace from any other
_VERSION = 1


def rank_path(path: str | os.PathLike[str], rank: int, world_size: int) -> Path:
    """``path`` itself on one rank; ``name.rank<r>.ext`` beside it when there are several ranks."""
    p = Path(path)
    if world_size <= 1:
        return p
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix}")


def _lanes(steps: list[StepRecord]) -> list[str]:
    # compute first, so that the step row sits on top in every viewer; the rest in a stable order
    others = sorted({lane for r in steps for lane, *_ in r.events} - {"compute"})
    return ["compute", *others]


def chrome_trace(
    steps: list[StepRecord], rank: int = 0, world_size: int = 1, origin: float | None = None
) -> dict[str, Any]:
    """The trace-event document of ``steps`` (records with their events).

    Parameters
    ----------
    steps
        Ended steps, oldest first.
    rank, world_size
        Name the process (``rank <r>``) and go into ``otherData``.
    origin
        ``perf_counter()`` time that becomes ts 0; by default the first step's start.
    """
    t_zero = origin if origin is not None else (steps[0].t0 if steps else 0.0)

    def us(t: float) -> float:
        return round((t - t_zero) * 1e6, 3)

    def meta(kind: str, tid: int, **args: Any) -> dict[str, Any]:
        return {"ph": "M", "name": kind, "pid": rank, "tid": tid, "args": args}

    def span(cat: str, name: str, tid: int, t0: float, t1: float, **args: Any) -> dict[str, Any]:
        ev = {"ph": "X", "cat": cat, "name": name, "pid": rank, "tid": tid, "ts": us(t0)}
        ev["dur"] = round(us(t1) - ev["ts"], 3)
        return {**ev, "args": args} if args else ev

    lanes = _lanes(steps)
    tid = {lane: i for i, lane in enumerate(lanes)}
    events = [meta("process_name", 0, name=f"rank {rank}"), meta("process_sort_index", 0, sort_index=rank)]
    for lane, i in tid.items():
        events += [meta("thread_name", i, name=lane), meta("thread_sort_index", i, sort_index=i)]
    for r in steps:
        events.append(span("step", f"step {r.step}", 0, r.t0, r.t1, step=r.step, **r.as_scalars()))
        for lane, name, t0, t1 in r.events:
            cat = "stall" if name.startswith("stall:") else lane.split(":", 1)[0]
            events.append(span(cat, name, tid[lane], t0, t1))
    wall_zero = time.time() - (time.perf_counter() - t_zero)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "format": TRACE_FORMAT,
            "version": _VERSION,
            "rank": rank,
            "world_size": world_size,
            "lanes": lanes,
            "start_unix_s": wall_zero,
        },
    }


class TraceWriter:
    """A step sink of the scheduler that keeps the last ``keep_steps`` steps and rewrites the file.

    Parameters
    ----------
    path
        ``scheduler.trace_path``; the rank suffix is added here (see :func:`rank_path`).
    rank, world_size
        This process's global rank and the number of ranks.
    flush_every
        Rewrite the file every this many steps (``log_interval``).
    keep_steps
        Steps held in memory and written (``trace_steps``); older ones are dropped.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        rank: int = 0,
        world_size: int = 1,
        flush_every: int = 10,
        keep_steps: int = 50,
    ) -> None:
        self.path = rank_path(path, rank, world_size)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank, self.world_size, self.flush_every = rank, world_size, flush_every
        self._steps: deque[StepRecord] = deque(maxlen=keep_steps)
        self._unflushed = 0
        self._warned = False

    def on_step(self, record: StepRecord) -> None:
        self._steps.append(record)
        self._unflushed += 1
        if self._unflushed >= self.flush_every:
            try:
                self.flush()
            except OSError as exc:  # a full disk must not stop training; close() tries again and raises
                if not self._warned:
                    logger.warning("dsx: could not write the trace %s (%s); will retry", self.path, exc)
                    self._warned = True

    def flush(self) -> None:
        """Write every kept step now (atomically: a reader never sees half a file)."""
        doc = chrome_trace(list(self._steps), self.rank, self.world_size)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(doc, separators=(",", ":")))
        os.replace(tmp, self.path)
        self._unflushed = 0

    def close(self) -> None:
        self.flush()
