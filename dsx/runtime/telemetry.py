"""Per-step counters the scheduler keeps: compute, transfer, exposed stall, bytes per tier."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["StepRecord", "StepTelemetry", "union_s"]


@dataclass
class StepRecord:
    """What one training step cost and moved."""

    step: int
    t0: float = 0.0  # perf_counter() at the step's start and end
    t1: float = 0.0
    compute_s: float = 0.0
    transfer_s: float = 0.0
    stall_s: float = 0.0
    # exposed stall by what waited: the stall name's part before ":" ("write-barrier", "unpack", "pool-full", a gate)
    stall_by: dict[str, float] = field(default_factory=dict)
    # how long the compute stream itself waited, by the same kind of name: for a read's copy, or idle while the
    # host waited for a read ("unpack") or at the write barrier; timed with CUDA events, so known only once the
    # GPU has run the step (filled in at a later end_step or summary)
    gpu_wait_s: float = 0.0
    gpu_wait_by: dict[str, float] = field(default_factory=dict)
    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    # per tier, the wall time during which at least one of its transfers ran (overlapping transfers count
    # once): bytes_by_tier over it is the rate the tier moved data at while it had work. A transfer counts,
    # bytes and whole span, in the step it ends in, so a span begun in the step before can be counted in
    # both steps' time: a rate summed over steps errs low, never high
    busy_by_tier: dict[str, float] = field(default_factory=dict)
    # activation offload's host time: its saved-tensor hooks inside the layers it hooks (each pack there, each
    # unpack of a moved tensor) and the reads it issues where a backward starts. Waits in them are included
    # (stall_by says how long: "unpack", "write-barrier"); the layers' forward hooks are not
    hook_s: float = 0.0
    hooks: int = 0  # how many of those calls hook_s covers
    events: list[tuple[str, str, float, float]] = field(default_factory=list)  # (lane, name, t0, t1)

    def as_scalars(self) -> dict[str, float]:
        # (no gpu_wait_s: at the step's end the GPU has not run it yet)
        out = {"compute_s": self.compute_s, "transfer_s": self.transfer_s, "stall_s": self.stall_s,
               "hook_s": self.hook_s}  # fmt: skip
        for tier, n in self.bytes_by_tier.items():
            out[f"bytes_{tier}"] = float(n)
        return out


class StepTelemetry:
    """Thread-safe accumulator; I/O threads add transfer time and bytes, the compute thread adds stalls.

    Times are wall-clock seconds from :func:`time.perf_counter`; transfer time (queued to seen done; for the SSD
    tier the drive's call alone), summed over transfers, can exceed the step time when transfers overlap each
    other.
    """

    def __init__(self, keep_events: bool = False) -> None:
        self._lock = threading.Lock()
        self._keep_events = keep_events
        self._step = 0
        self._t_step = time.perf_counter()
        self._cur = StepRecord(step=0)
        self._bytes: dict[str, int] = defaultdict(int)
        self._spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self.history: list[StepRecord] = []
        # device-side waits not yet resolved: (step, reached, ready, name)
        self._gpu_waits: list[tuple[int, Any, Any, str]] = []
        self._stalled: dict[str, float] = {}  # by kind, over every step (stalled_s)
        self._gpu_waited: dict[str, float] = {}  # the same for the device-side waits (gpu_waited_s)

    @property
    def current(self) -> StepRecord:
        return self._cur

    def stalled_s(self, *kinds: str) -> float:
        """Exposed stall of ``kinds`` (all where none is named: "unpack", "write-barrier", ...) since this
        object was made, over every step: the difference between two readings is what was waited between
        them."""
        with self._lock:
            return sum(v for k, v in self._stalled.items() if not kinds or k in kinds)

    def gpu_waited_s(self, *kinds: str) -> float:
        """Device-side wait (``add_gpu_wait``) of ``kinds`` (all where none is named) since this object was made,
        over every step. Blocks until the GPU has run past every wait added so far, to time them."""
        self._resolve_gpu_waits(block=True)
        with self._lock:
            return sum(v for k, v in self._gpu_waited.items() if not kinds or k in kinds)

    @property
    def steps(self) -> int:
        """How many steps have ended."""
        return self._step

    def add_transfer(self, tier: str, nbytes: int, t0: float, t1: float, name: str = "") -> None:
        with self._lock:
            self._cur.transfer_s += t1 - t0
            self._bytes[tier] += nbytes
            self._spans[tier].append((t0, t1))
            if self._keep_events:
                self._cur.events.append((f"io:{tier}", name or tier, t0, t1))

    def add_hook(self, seconds: float) -> None:
        """One of activation offload's hook calls took ``seconds`` of host time (see ``StepRecord.hook_s``)."""
        with self._lock:
            self._cur.hook_s += seconds
            self._cur.hooks += 1

    def add_stall(self, t0: float, t1: float, name: str = "wait") -> None:
        with self._lock:
            self._cur.stall_s += t1 - t0
            _add_by_kind(self._stalled, name, t1 - t0)
            _add_by_kind(self._cur.stall_by, name, t1 - t0)
            if self._keep_events:
                self._cur.events.append(("compute", f"stall:{name}", t0, t1))

    def add_gpu_wait(self, reached: Any, ready: Any, name: str = "wait") -> None:
        """A device-side wait: the stream reached ``reached`` and then waited until ``ready``.

        Both are CUDA events created with ``enable_timing=True``; the wait is ``reached → ready`` when
        positive, else zero. For a read, ``ready`` is recorded after its copy on the side stream (positive:
        the data were late); for a host wait, ``ready`` is recorded on the same stream once the host goes on
        (positive: the GPU ran out of queued work and idled). Resolved without blocking at each
        :meth:`end_step` once both events have completed, and with blocking by :meth:`summary`.
        """
        with self._lock:
            self._gpu_waits.append((self._step, reached, ready, name))

    def _resolve_gpu_waits(self, block: bool) -> None:
        with self._lock:
            pending, self._gpu_waits = self._gpu_waits, []
        keep = []
        for item in pending:
            step, reached, ready, name = item
            if block:
                ready.synchronize()
                reached.synchronize()
            elif not (ready.query() and reached.query()):
                keep.append(item)
                continue
            dt = max(0.0, reached.elapsed_time(ready)) / 1e3
            rec = self.history[step] if step < len(self.history) else self._cur
            rec.gpu_wait_s += dt
            _add_by_kind(rec.gpu_wait_by, name, dt)
            with self._lock:
                _add_by_kind(self._gpu_waited, name, dt)
        with self._lock:
            self._gpu_waits[:0] = keep

    def add_event(self, lane: str, name: str, t0: float, t1: float) -> None:
        if self._keep_events:
            with self._lock:
                self._cur.events.append((lane, name, t0, t1))

    def end_step(self) -> StepRecord:
        """Close the current step; compute time is the step's wall time less the exposed stall.

        The returned record carries the step's events (when kept); :attr:`history` keeps the scalars
        only, so that a long traced run does not hold every event in memory.
        """
        now = time.perf_counter()
        with self._lock:
            rec = self._cur
            rec.t0, rec.t1 = self._t_step, now
            rec.compute_s = max(0.0, (now - self._t_step) - rec.stall_s)
            rec.bytes_by_tier = dict(self._bytes)
            rec.busy_by_tier = {tier: union_s(spans) for tier, spans in self._spans.items()}
            self.history.append(replace(rec, events=[]))
            self._step += 1
            self._cur = StepRecord(step=self._step)
            self._bytes = defaultdict(int)
            self._spans = defaultdict(list)
            self._t_step = now
        self._resolve_gpu_waits(block=False)
        return rec

    def summary(self) -> dict[str, Any]:
        self._resolve_gpu_waits(block=True)
        steps = self.history[1:] or self.history  # the first step profiles and warms up
        if not steps:
            return {}
        n = len(steps)
        tiers = sorted({t for r in steps for t in r.bytes_by_tier})
        return {
            "steps": n,
            "compute_s": sum(r.compute_s for r in steps) / n,
            "transfer_s": sum(r.transfer_s for r in steps) / n,
            "stall_s": sum(r.stall_s for r in steps) / n,
            "stall_by": _mean_by_kind([r.stall_by for r in steps]),
            "gpu_wait_s": sum(r.gpu_wait_s for r in steps) / n,
            "gpu_wait_by": _mean_by_kind([r.gpu_wait_by for r in steps]),
            "hook_s": sum(r.hook_s for r in steps) / n,
            "hooks": sum(r.hooks for r in steps) / n,
            "bytes_by_tier": {t: sum(r.bytes_by_tier.get(t, 0) for r in steps) / n for t in tiers},
            "busy_s_by_tier": {t: sum(r.busy_by_tier.get(t, 0.0) for r in steps) / n for t in tiers},
            # bytes over busy time, summed over the steps: the rate each tier moved data at while it had work
            "GBps_by_tier": {
                t: sum(r.bytes_by_tier.get(t, 0) for r in steps) / busy / 1e9
                for t in tiers
                if (busy := sum(r.busy_by_tier.get(t, 0.0) for r in steps)) > 0
            },
        }


def union_s(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the ``(t0, t1)`` spans."""
    total, end = 0.0, float("-inf")
    for t0, t1 in sorted(spans):
        if t1 > end:
            total += t1 - max(t0, end)
            end = t1
    return total


def _add_by_kind(acc: dict[str, float], name: str, seconds: float) -> None:
    """Add to the kind a wait's name starts with (before ":"; "unpack:layer3" counts as "unpack")."""
    kind = name.split(":", 1)[0]
    acc[kind] = acc.get(kind, 0.0) + seconds


def _mean_by_kind(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Per kind, the mean over the steps (a step without it counts zero)."""
    return {
        k: sum(d.get(k, 0.0) for d in per_step) / len(per_step)
        for k in sorted({k for d in per_step for k in d})
    }
