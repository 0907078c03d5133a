"""The planner's vocabulary: what a layer can do with its saved bytes, what the profiling step measured of it,
and the plan that comes out.

Each layer keeps what it saves, moves it to a tier (host or SSD), or recomputes the layer in backward. With
``recompute_modules`` set (Megatron's selective recompute: e.g. the core attention, whose scores, softmax and
mask are 5·a·s/h of the 34 + 5·a·s/h bytes per token and hidden unit a layer saves), each of keep / host / SSD
also comes as ``+sel``: those sub-modules run again in backward instead of storing, and only the rest of the
layer's bytes is kept or moved. A recomputed layer may also move the inputs its recomputation starts from
(``recompute+<tier>``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["GB", "Action", "LayerProfile", "MoveCap", "Plan", "PlanError", "cap_floor", "check_profiles"]

GB = 1 << 30


class MoveCap(int):
    """What a partial layer moves: at most this many bytes (it is the byte count), of its storages of at least
    ``floor`` bytes, each in save order while it still fits (``LayerHooks._pack``; the cost model's
    ``movable``). A floor moves the same bytes as fewer, larger tensors: each moved tensor costs the host its
    hooks' time (``moved_tensor_host_us``), whatever its size."""

    floor: int

    def __new__(cls, cap: int, floor: int = 0) -> MoveCap:
        if cap < 0 or floor < 0:
            raise ValueError(f"MoveCap({cap}, floor={floor}): both must be >= 0")
        obj = super().__new__(cls, cap)
        obj.floor = int(floor)
        return obj

    def __repr__(self) -> str:
        return f"MoveCap({int(self)}, floor={self.floor})"

    # printed as the byte count it is (equality, hashing and arithmetic are the int's too: the floor rides along)
    __str__ = int.__repr__


def cap_floor(cap: int | None) -> int:
    """The smallest storage a partial layer's cap moves: a :class:`MoveCap`'s floor, 0 for a plain byte count."""
    return getattr(cap, "floor", 0)


class Action(str, Enum):
    """One layer's action; the value is its name in plans and logs (``"host+sel"``)."""

    KEEP = "keep"
    HOST = "host"
    SSD = "ssd"
    RECOMPUTE = "recompute"
    KEEP_SEL = "keep+sel"
    HOST_SEL = "host+sel"
    SSD_SEL = "ssd+sel"
    # recomputed, and the inputs recomputation starts from (what the checkpoint keeps) moved to a tier
    RECOMPUTE_HOST = "recompute+host"
    RECOMPUTE_SSD = "recompute+ssd"

    # The properties read attributes set once below the class: the search asks them millions of times,
    # and parsing the value each time was half of the planner's run time.
    @property
    def base(self) -> Action:
        """What happens to the layer's saved bytes: keep, host, ssd or recompute."""
        return self._base

    @property
    def sel(self) -> bool:
        """Whether the layer's ``recompute_modules`` run again in backward instead of storing."""
        return self._sel

    @property
    def tier(self) -> Action | None:
        """The tier what the layer stores moves to (host or ssd), or None if it stays on the device."""
        return self._tier

    @property
    def moved(self) -> bool:
        return self._tier is not None

    @property
    def recomputed(self) -> bool:
        return self._recomputed


for _a in Action:
    _parts = _a._value_.split("+")
    _a._base = Action(_parts[0])
    _a._sel = _parts[-1] == "sel"
    _a._tier = next((Action(t) for t in _parts if t in ("host", "ssd")), None)
    _a._recomputed = _parts[0] == "recompute"


@dataclass
class LayerProfile:
    """One layer, measured in the profiling step.

    ``sel_saved_bytes`` is what the layer saves when its ``recompute_modules`` are recomputed (the bytes
    saved outside them plus their inputs, which checkpointing saves); ``sel_recompute_s`` is their forward
    time. ``None`` when the layer has no such sub-module. ``input_bytes`` is what a recomputed layer keeps
    to start from: the storages of its tensor inputs (the hidden states; not parameters, not tensors under
    ``min_tensor_bytes``). ``recompute_only`` marks a layer the profiling step could only time, not see
    save (profiled under recomputation through the non-reentrant checkpoint); plans recompute it.
    ``gap_s``, on the last layer, is the time from the end of its forward to its own backward (the head, the
    loss and their backward): writes cross the link through it. ``None`` on the other layers (what lies between
    two layers is host time a normal step overlaps) and where not measured: the cost model then puts no time
    there, and the lower bound, after the last layer, all of the step's time outside the layers.
    ``bwd_workspace_bytes`` is the peak its backward allocates above the level at its start. ``fwd_peak_bytes`` is the peak its forward allocates above its
    start (saved bytes included); the ``*_background_bytes`` are what is allocated beyond the saved bytes of
    the layers holding them at the start of its forward, in the gap after it (peak) and at the start of its
    backward (the points :mod:`dsx.offload.plan.cost` lists). All memory fields are measured on CUDA only
    (0 elsewhere).
    """

    index: int
    name: str
    saved_bytes: int
    fwd_s: float
    bwd_s: float
    sel_saved_bytes: int | None = None
    sel_recompute_s: float = 0.0
    bwd_workspace_bytes: int = 0
    fwd_peak_bytes: int = 0
    fwd_background_bytes: int = 0
    gap_background_bytes: int = 0
    bwd_background_bytes: int = 0
    input_bytes: int = 0
    recompute_only: bool = False
    gap_s: float | None = None
    # the storages it saves, in save order (what a partial move takes first); empty where not profiled
    saved_sizes: list[int] = field(default_factory=list)
    # the same when its recompute_modules are recomputed (the storages of sel_saved_bytes, in the runtime's
    # save order): what a partial ``+sel`` move takes first; empty where not profiled
    sel_saved_sizes: list[int] = field(default_factory=list)

    def stored(self, a: Action) -> int:
        """Bytes kept on the device or moved to ``a.tier`` between the layer's forward and its backward."""
        if a.recomputed:
            return self.input_bytes
        return self.sel_saved_bytes if a.sel and self.sel_saved_bytes is not None else self.saved_bytes

    def transient(self, a: Action) -> int:
        """Bytes the layer re-creates in its own backward (recomputed layer or sub-modules)."""
        if a.recomputed:
            return self.saved_bytes
        return self.saved_bytes - self.stored(a) if a.sel else 0

    def bwd_own(self, a: Action) -> int:
        """What the layer's backward adds on top of the bytes it stores: a recomputed layer first re-runs its
        forward (peak ``fwd_peak_bytes``), then holds what it saves plus the backward's workspace."""
        if a.recomputed:
            # on top of its inputs, which it stores (they are among its saved bytes, not in its forward peak)
            return max(self.fwd_peak_bytes, self.saved_bytes - self.input_bytes + self.bwd_workspace_bytes)
        return self.transient(a) + self.bwd_workspace_bytes

    def fwd_own(self, a: Action) -> int:
        """The forward's own peak; a recomputed layer's first forward runs without saving anything."""
        if a.recomputed:  # the inputs were allocated before the forward started
            return max(0, self.fwd_peak_bytes - (self.saved_bytes - self.input_bytes))
        return self.fwd_peak_bytes

    def extra_bwd_s(self, a: Action) -> float:
        if a.recomputed:
            return self.fwd_s
        return self.sel_recompute_s if a.sel else 0.0


class PlanError(ValueError):
    """The budget cannot be met by any plan."""


@dataclass
class Plan:
    """An action per layer, the prefetch depth and write barriers the runtime installs with them, and what the
    cost model predicts of them (``bound``: the hideable bytes, tier usage and the keep-everything baseline)."""

    actions: list[Action]
    prefetch_depth: int
    predicted_step_s: float
    bound: dict[str, Any]
    profiles: list[LayerProfile] = field(default_factory=list, repr=False)
    peak_bytes: int = 0
    stall_s: float = 0.0
    # the predicted peak exceeds memory_budget_gb (auto, best effort: no plan the search considered fits the
    # budget, and this one peaks lowest among them; or a fixed policy over the budget)
    over_budget: bool = False
    # layer -> bytes it moves when it moves only part of what it saves (the rest stays on the device); a
    # MoveCap also names the smallest storage that moves
    move_caps: dict[int, int] = field(default_factory=dict)
    search_s: float = 0.0  # wall time make_plan took (the search is once per run, plus re-plans)
    # how policy auto chose the actions: "exhaustive" (every assignment, at every depth searched) or "local" (the
    # descent from each uniform plan); "" for the fixed policies
    search: str = ""
    # per layer, then for the start of backward: the layers whose writes the runtime awaits there; and at
    # each layer's backward start (write_barrier())
    write_barrier: list[int] = field(default_factory=list)
    write_barrier_bwd: list[int] = field(default_factory=list)
    # the step's time outside the layers (embedding, head, loss, optimizer), as the profiler measured it
    # (Profiler.outside_s); the same for every plan, so the search leaves it out and the printed prediction adds it
    outside_s: float = 0.0
    # the step's peak after the layers' backward (gradients' reduction, optimizer step), as the profiler
    # measured it (Profiler.outside_peak, CUDA; 0 elsewhere): the same for every plan
    outside_peak_bytes: int = 0

    @property
    def predicted_total_step_s(self) -> float:
        """The whole step's predicted time: the layers' (``predicted_step_s``) plus ``outside_s``."""
        return self.predicted_step_s + self.outside_s

    @property
    def predicted_step_peak_bytes(self) -> int:
        """The whole step's predicted peak: the layers' (``peak_bytes``) or, where higher, the peak after
        their backward (``outside_peak_bytes``), which no plan changes."""
        return max(self.peak_bytes, self.outside_peak_bytes)

    def describe(self) -> str:
        """The plan as a table, one row per layer, then the bound and the prediction (what dsx logs)."""
        b = self.bound
        sel = any(p.sel_saved_bytes is not None for p in self.profiles)
        extra = f" {'+sel':>10} {'sub ms':>7}" if sel else ""
        lines = [f"{'layer':<22} {'saved':>10} {'fwd ms':>8} {'bwd ms':>8}{extra}  action"]
        for i, (p, a) in enumerate(zip(self.profiles, self.actions)):
            col = ""
            if sel:
                col = (
                    f" {p.sel_saved_bytes / 2**20:>8.1f}Mi {p.sel_recompute_s * 1e3:>7.2f}"
                    if p.sel_saved_bytes is not None
                    else f" {'-':>10} {'-':>7}"
                )
            lines.append(
                f"{p.name:<22} {p.saved_bytes / 2**20:>8.1f}Mi {p.fwd_s * 1e3:>8.2f} {p.bwd_s * 1e3:>8.2f}{col}  "
                f"{a.value}"
                + (
                    f" ({self.move_caps[i] / 2**20:.0f}Mi of {p.stored(a) / 2**20:.0f}Mi"
                    + (
                        f", tensors >= {floor / 2**20:.0f}Mi"
                        if (floor := getattr(self.move_caps[i], "floor", 0))
                        else ""
                    )
                    + ")"
                    if i in self.move_caps
                    else ""
                )
            )
        lines.append(
            f"bound: hideable writes {b['hideable_write_bytes'] / GB:.2f} GiB (B_w x T_fwd), reads "
            f"{b['hideable_read_bytes'] / GB:.2f} GiB (B_r x T_bwd) per step; planned to move "
            f"{b['planned_bytes'] / GB:.2f} GiB ({b['fraction_of_bound']:.0%} of the bound)"
            + "".join(
                f"; {t} holds {used / GB:.2f} of {b['tier_capacity_bytes'][t] / GB:.2f} GiB"
                + (
                    f" -- OVER {_CAPACITY_KEY[t]}: the rest stays on the device"
                    if used > b["tier_capacity_bytes"][t]
                    else ""
                )
                for t, used in b.get("tier_bytes", {}).items()
                if used
            )
        )
        step = f"predicted step {self.predicted_total_step_s * 1e3:.1f} ms"
        if self.outside_s:
            step += (
                f" ({self.predicted_step_s * 1e3:.1f} in the layers + {self.outside_s * 1e3:.1f} outside them,"
                " as measured)"
            )
        lines.append(
            f"{step} vs {(b['baseline_step_s'] + self.outside_s) * 1e3:.1f} ms keeping "
            f"everything (stall {self.stall_s * 1e3:.1f} ms); peak activations {self.peak_bytes / GB:.2f} GiB vs "
            f"{b['keep_all_bytes'] / GB:.2f} GiB keeping everything "
            f"({abs(b['keep_all_bytes'] - self.peak_bytes) / GB:.2f} GiB "
            f"{'higher' if self.peak_bytes > b['keep_all_bytes'] else 'lower'}), budget "
            + (f"{b['budget_bytes'] / GB:.2f} GiB" if b["budget_bytes"] is not None else "none (hide only)")
            + (
                f"; after the layers' backward the step peaks at {self.outside_peak_bytes / GB:.2f} GiB"
                if self.outside_peak_bytes
                else ""
            )
            + f"; prefetch depth {self.prefetch_depth}; write barrier {'on' if self.write_barrier else 'off'}"
            + f"; searched in {self.search_s:.1f} s"
            + (
                " -- OVER BUDGET: the least-over plan the model found (best effort)"
                if self.over_budget
                else ""
            )
        )
        return "\n".join(lines)


_CAPACITY_KEY = {"host": "host_pool_gb", "ssd": "ssd_capacity_gb"}


_TIME_FIELDS = ("fwd_s", "bwd_s", "sel_recompute_s", "gap_s")
_BYTE_FIELDS = ("saved_bytes", "sel_saved_bytes", "bwd_workspace_bytes", "fwd_peak_bytes", "input_bytes")
# differences between measured memory levels (what is allocated beyond the saved bytes): may be negative
_SIGNED_FIELDS = ("fwd_background_bytes", "gap_background_bytes", "bwd_background_bytes")


def check_profiles(profiles: list[LayerProfile]) -> None:
    """ValueError naming the layer and the field where a time or a byte count is not a finite number, or is
    negative (the background fields, differences of measured levels, may be)."""
    for p in profiles:
        values = [(f, getattr(p, f)) for f in (*_TIME_FIELDS, *_BYTE_FIELDS, *_SIGNED_FIELDS)]
        values += [
            (f"{f}[{k}]", v) for f in ("saved_sizes", "sel_saved_sizes") for k, v in enumerate(getattr(p, f))
        ]
        for name, v in values:
            if v is None and name in ("sel_saved_bytes", "gap_s"):
                continue
            if (
                isinstance(v, bool)
                or not isinstance(v, numbers.Real)
                or not math.isfinite(v)
                or (v < 0 and name not in _SIGNED_FIELDS)
            ):
                kind = "a finite number" if name in _SIGNED_FIELDS else "a finite number >= 0"
                raise ValueError(
                    f"activation offload profile of layer {p.index} ({p.name!r}): {name} is {v!r}, not {kind}"
                )
