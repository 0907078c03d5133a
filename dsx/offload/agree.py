"""One plan for all ranks: the planner's inputs are agreed on before each rank plans.

Each rank profiles its own step, and timings differ between ranks (clocks, the host threads beside them, a
straggler). Planned separately, two ranks could recompute different layers, and a recomputed layer re-runs
its forward in backward, with ZeRO-3's parameter gathers and any tensor-parallel collectives in it: ranks
that disagree would issue those in different orders and hang. So the ranks gather their profiles and take,
per layer and field, the largest (the slowest layer, the most bytes; but the shortest gap after the last
layer's forward, the writes' time there): every rank then plans from the same numbers, and the planner is
deterministic. Budget calibration agrees on the largest measured peak the same way. Ranks with another number
of layers (pipeline stages) agree among themselves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dsx.runtime.process import all_gather

__all__ = ["agree_peak", "agree_profiles"]


def _merge(rows: list[Any]) -> Any:
    """Per field the largest value (the gap after the last layer's forward: the shortest); a size list comes
    with the byte count it sums to."""
    first = rows[0]
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(first):
        values = [getattr(r, f.name) for r in rows]
        if f.name in ("saved_sizes", "sel_saved_sizes"):
            total = "saved_bytes" if f.name == "saved_sizes" else "sel_saved_bytes"
            kw[f.name] = getattr(max(rows, key=lambda r: getattr(r, total) or 0), f.name)
        elif f.name in ("index", "name"):
            kw[f.name] = values[0]
        elif f.name in ("sel_saved_bytes", "gap_s"):
            present = [v for v in values if v is not None]
            # a gap is time the link has for writes: the shortest, as the most bytes and the slowest layer are
            # the cautious values of the others
            pick = min if f.name == "gap_s" else max
            kw[f.name] = pick(present) if present else None
        elif f.name == "recompute_only":
            kw[f.name] = any(values)
        else:
            kw[f.name] = max(values)
    return type(first)(**kw)


def agree_profiles(
    profiles: list[Any], outside_s: float, outside_peak: int = 0
) -> tuple[list[Any], float, int]:
    """The profiles (``LayerProfile``), outside time and outside peak every rank with as many layers plans
    from: per layer and field the largest any of them measured, and the largest of the others. A collective:
    every rank calls it at the same step."""
    peers = [
        p
        for p in all_gather((profiles, outside_s, outside_peak), "agreeing on layer profiles")
        if len(p[0]) == len(profiles)
    ]
    merged = [_merge([p[0][i] for p in peers]) for i in range(len(profiles))]
    return merged, max(p[1] for p in peers), max(p[2] for p in peers)


def agree_peak(peak: int | None, layers: int) -> int | None:
    """The largest activation peak measured by the ranks with ``layers`` layers (None where none measured).
    A collective."""
    peaks = [
        p
        for p, n in all_gather((peak, layers), "agreeing on the activation peak")
        if n == layers and p is not None
    ]
    return max(peaks) if peaks else None
