"""The per-layer activation plan: keep, offload to host, offload to SSD, or recompute.

With ``recompute_modules`` set (Megatron's selective recompute: e.g. the core attention, whose scores,
softmax and mask are 5·a·s/h of the 34 + 5·a·s/h bytes per token and hidden unit a layer saves), each of
keep / host / SSD also comes as ``+sel``: those sub-modules run again in backward instead of storing, and
only the rest of the layer's bytes is kept or moved.

Cost model (one training step, per rank)
----------------------------------------
Forward runs layers 0..n-1 (times ``fwd_s``); an offloaded layer's saved bytes are copied to the host as
soon as the layer's forward ends and the device-to-host link is free (writes never stall compute; they hold
GPU memory until the copy is done); an SSD layer's copy lands in its staging slot in the pool, and its file
write follows on the drive's channel (the pool holds it until then; without a host tier the link's rate is
not measured, and the model holds an SSD layer on the device until its file write ends). Backward runs
layers n-1..0 (times ``bwd_s``); when layer ``i``'s backward starts, reads are issued for the offloaded
layers down to ``i - depth``; a layer whose read has not finished when its backward starts stalls. A
recomputed layer runs its forward again in backward. Reads of the two tiers are independent (host: PCIe,
per-rank share; SSD: the drive, per-rank share). The hideable bytes per step are
``B_write x T_fwd`` and ``B_read x T_bwd``, B being the device's link (the host tier's rates; the SSD
tier's without a host tier): every byte moved, to either tier, crosses it. The model reproduces that bound
when compute is the only thing to hide behind.

Peak activation memory is the largest footprint at these points, each relative to the allocated memory when
the step's first layer starts: during each layer's forward (its own forward peak on top of what earlier layers
keep or still write), in the gap after each layer's forward (for the last layer: the head, the loss and the
start of backward, with the last ``depth + 1`` layers' reads issued), and during each layer's backward (kept
layers below it, offloaded layers prefetched into ``[i - depth, i]`` or still being written, what a recomputed
layer or its recomputed sub-modules re-create, and its backward's workspace). On CUDA the profiling step
measures, for each of these points, what is allocated beyond the saved bytes (gradients, hidden states, what
the model outside the layers holds: LayerProfile's ``*_background_bytes``), so that with everything kept the
model reproduces the measured peaks; a recomputed layer's re-run forward peaks at ``fwd_peak_bytes``.

A plan never holds more in a tier than the tier can (``tier_usage`` within ``tier_capacity``: the host pool
also stages SSD writes; each storage whose size the profile recorded counts at its 4 KiB-aligned size, as
the pool and the file allocate it), and it carries ``write_barrier`` / ``write_barrier_bwd``: where in the
forward and the backward the runtime waits for the copies the model has finished by then, so that the
allocator, which sees frees in the host's order, frees what the model frees. Only where memory is the point
(``write_barrier``: "auto" sets it when ``memory_budget_gb`` is given; a hide-only plan runs without it).

Search: exhaustive over all c^n assignments when c^n <= ``exhaustive_limit``, c being the number of actions
(keep, recompute and one per tier; with ``recompute_modules`` also the ``+sel`` forms; with profiled layer
inputs also ``recompute+<tier>``: 9 with two tiers) — small models, and the tests' ground truth; otherwise a
local search from each uniform plan: passes that give each layer in turn its best action with the others
fixed, until a pass changes nothing, ordered by (memory over budget, step time, peak memory) — so it first
reaches the budget, then shortens the step. With no budget the order is (time over baseline, peak memory,
step time). When no plan the search considers meets the budget, the best-effort plan is the one of them with
the lowest peak (ranked by (over a tier's capacity, peak, step time)). Every prefetch depth 1..8 is
searched. On this project's 2-core CI machine a plan for 16 layers takes ~2-3 s and for 32 layers ~11 s
(steepest descent, evaluating every single-layer change per step, took 50-70 s for 16 layers).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import numbers
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from dsx.config import ActivationOffloadConfig
from dsx.offload.store import align_up

__all__ = [
    "Action",
    "LayerProfile",
    "Plan",
    "PlanError",
    "TierBandwidth",
    "floor_bytes",
    "make_plan",
    "movable",
    "simulate",
    "tier_capacity",
    "tier_usage",
    "write_barrier",
    "write_barrier_fixed",
]

GB = 1 << 30
# Deepest prefetch the search tries. A layer's read must be issued this many layers ahead when it takes
# longer than one layer's backward: on the H100, one megatron-core layer (hidden 2048, micro-batch 8) saves
# 4 GiB, 78 ms at 55 GB/s, against ~19 ms of backward per layer, so no whole layer could be hidden at depth 4.
MAX_DEPTH = 8


class Action(str, Enum):
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
    ``bwd_workspace_bytes`` is the peak its backward
    allocates above the level at its start. ``fwd_peak_bytes`` is the peak its forward allocates above its
    start (saved bytes included); the ``*_background_bytes`` are what is allocated beyond the saved bytes of
    the layers holding them at the start of its forward, in the gap after it (peak) and at the start of its
    backward (see the module docstring). All memory fields are measured on CUDA only (0 elsewhere).
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


@dataclass
class TierBandwidth:
    """Bandwidth one rank gets on a tier while every rank of its node uses it (bytes per second)."""

    tier: str
    write_Bps: float
    read_Bps: float


class PlanError(ValueError):
    """The budget cannot be met by any plan."""


@dataclass
class Plan:
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
    # layer -> bytes it moves when it moves only part of what it saves (the rest stays on the device)
    move_caps: dict[int, int] = field(default_factory=dict)
    search_s: float = 0.0  # wall time make_plan took (the search is once per run, plus re-plans)
    # per layer, then for the start of backward: the layers whose writes the runtime awaits there; and at
    # each layer's backward start (write_barrier())
    write_barrier: list[int] = field(default_factory=list)
    write_barrier_bwd: list[int] = field(default_factory=list)
    # the step's time outside the layers (embedding, head, loss, optimizer), as the profiling step measured
    # it; the same for every plan, so the search leaves it out and the printed prediction adds it
    outside_s: float = 0.0

    @property
    def predicted_total_step_s(self) -> float:
        """The whole step's predicted time: the layers' (``predicted_step_s``) plus ``outside_s``."""
        return self.predicted_step_s + self.outside_s

    def describe(self) -> str:
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
                    f" ({self.move_caps[i] / 2**20:.0f}Mi of {p.stored(a) / 2**20:.0f}Mi)"
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
                " as profiled)"
            )
        lines.append(
            f"{step} vs {(b['baseline_step_s'] + self.outside_s) * 1e3:.1f} ms keeping "
            f"everything (stall {self.stall_s * 1e3:.1f} ms); peak activations {self.peak_bytes / GB:.2f} GiB vs "
            f"{b['keep_all_bytes'] / GB:.2f} GiB kept, budget "
            + (f"{b['budget_bytes'] / GB:.2f} GiB" if b["budget_bytes"] is not None else "none (hide only)")
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


def _sizes(p: LayerProfile, a: Action) -> list[int]:
    """The storages layer ``p`` stores under ``a``, in the runtime's save order; empty where unknown (not
    profiled, or a recomputed layer's inputs)."""
    if a.recomputed:
        return []
    return p.sel_saved_sizes if a.sel else p.saved_sizes


def _greedy(sizes: list[int], cap: int) -> list[int]:
    """The runtime's rule (``LayerHooks._pack``): in save order, each storage still fitting under ``cap``."""
    out, done = [], 0
    for n in sizes:
        if done + n <= cap:
            done += n
            out.append(n)
    return out


def movable(p: LayerProfile, a: Action, cap: int) -> int:
    """Bytes layer ``p`` moves under action ``a`` when at most ``cap`` may move: the runtime's rule
    (``LayerHooks._pack``) over its saved storages in save order (``saved_sizes``; ``sel_saved_sizes`` for
    ``+sel`` actions), each moving if it still fits under the cap. A storage is not split, so a cap between
    storage sizes moves less than the cap (at hidden 2048 a megatron-core layer saves a 2 GiB block and
    several of 64-192 MiB: caps of ~1 GiB moved 0.79-0.85 of the bytes planned). Where the order is unknown
    (profiles without those sizes, recomputed layers' inputs), the cap itself."""
    s = p.stored(a)
    if cap >= s:
        return s
    sizes = _sizes(p, a)
    return sum(_greedy(sizes, cap)) if sizes else cap


def _held(p: LayerProfile, a: Action, cap: int | None) -> int:
    """Bytes a tier gives what layer ``p`` moves under ``a`` (at most ``cap``): the pool and the SSD file
    allocate each storage at its 4 KiB-aligned size (``Arena``); where the storages are unknown, the bytes
    moved (``tier_capacity``'s reserve covers their alignment)."""
    sizes = _sizes(p, a)
    if not sizes:
        return p.stored(a) if cap is None else movable(p, a, cap)
    if cap is not None and cap < p.stored(a):
        sizes = _greedy(sizes, cap)
    return sum(align_up(max(n, 1)) for n in sizes)


def _split(
    profiles: list[LayerProfile], actions: list[Action], caps: dict[int, int] | None
) -> tuple[list[int], list[int]]:
    """(bytes moved, bytes kept on the device) per layer; ``caps`` limits what a moved layer moves."""
    moved, kept = [], []
    for i, (p, a) in enumerate(zip(profiles, actions)):
        s = p.stored(a)
        m = (movable(p, a, caps[i]) if caps and i in caps else s) if a.moved else 0
        moved.append(m)
        kept.append(s - m)
    return moved, kept


def _forward(
    profiles: list[LayerProfile],
    actions: list[Action],
    bw: dict[str, TierBandwidth],
    caps: dict[int, int] | None = None,
) -> tuple[float, dict[str, float], list[float], list[float]]:
    """Forward pass of the cost model: (end time, when each tier's channel frees, when each write is done,
    when each moved layer's bytes have left the device).

    A host layer leaves the device when its copy to the pool ends. An SSD layer is first copied to its
    staging slot in the pool, on the same device-to-host link as the host layers (one side stream), and
    leaves the device then; its file write follows on the drive's channel. Without a host tier the link's
    rate is unknown and an SSD layer is held on the device until its file write ends (conservative).
    """
    moved, _ = _split(profiles, actions, caps)
    free = dict.fromkeys(bw, 0.0)
    link = bw.get("host")
    link_free = 0.0
    write_done = [0.0] * len(profiles)
    off_device = [0.0] * len(profiles)
    t = 0.0
    for i, p in enumerate(profiles):
        t += p.fwd_s
        a = actions[i]
        if not a.moved:
            continue
        tier = a.tier.value
        if link is not None:
            link_free = off_device[i] = max(t, link_free) + moved[i] / link.write_Bps
            if tier == "ssd":
                free[tier] = write_done[i] = max(off_device[i], free[tier]) + moved[i] / bw[tier].write_Bps
            else:
                free[tier] = write_done[i] = off_device[i]
        else:
            free[tier] = write_done[i] = off_device[i] = max(t, free[tier]) + moved[i] / bw[tier].write_Bps
    if link is not None:
        free["host"] = max(free["host"], link_free)
    return t, free, write_done, off_device


def write_barrier(
    profiles: list[LayerProfile],
    actions: list[Action],
    bw: dict[str, TierBandwidth],
    caps: dict[int, int] | None = None,
) -> tuple[list[int], list[int]]:
    """Where the runtime waits for writes: (forward, backward). ``forward[j]`` for layer ``j``'s forward
    start and ``forward[n]`` for the start of backward, ``backward[i]`` for layer ``i``'s backward start: the
    highest ``k`` such that the model has every moved layer ``<= k`` written off the device by then (-1 if
    none). Backward times leave out stalls, so they are never later than the model's.

    The runtime waits for those writes there (:meth:`LayerHooks.await_writes`). The model frees a layer's
    device memory when its copy ends on the GPU, but the caching allocator sees the free only when the host
    thread observes it, and the host runs ahead of the GPU, allocating later layers' memory first: without
    the wait, bytes the model had freed were still allocated at the peak (half the moved bytes on the H100).
    """
    n = len(profiles)
    _, _, _, off_device = _forward(profiles, actions, bw, caps)
    k = -1

    def done_by(at: float, below: int) -> int:
        nonlocal k
        while k + 1 < below and (not actions[k + 1].moved or off_device[k + 1] <= at + 1e-12):
            k += 1
        return k

    forward, start = [], 0.0
    for j in range(n + 1):
        forward.append(done_by(start, j))
        if j < n:
            start += profiles[j].fwd_s
    backward = [0] * n
    for i in range(n - 1, -1, -1):
        backward[i] = done_by(start, n)
        start += profiles[i].bwd_s + profiles[i].extra_bwd_s(actions[i])
    return forward, backward


def write_barrier_fixed(n: int, lag: int = 2) -> tuple[list[int], list[int]]:
    """The write barrier of a fixed policy (``offload_all``), which has no timing model to place it by:
    layer ``j``'s forward waits until the bytes of layers ``<= j - lag`` have left the device (one layer's
    copies overlap the next layer's compute), and backward starts once every layer's have; the layers'
    backward starts then have nothing left to wait for. Same shape as :func:`write_barrier`.

    Without it the host queues the backward (read buffers, gradients) while the forward's copies still hold
    the moved bytes in the allocator's order: ``offload_all`` with ``recompute_modules`` on the H100 (hidden
    2048) peaked at 16.6-17.9 GB, and at 11.8 GB with it, at 413 against 402 ms a step (the step is bound by
    the copies either way: the first backward layer's read follows every write on the link).
    """
    if lag < 1:
        raise ValueError(f"lag must be >= 1, got {lag}")
    return [max(-1, j - lag) for j in range(n)] + [n - 1], []


def tier_usage(
    profiles: list[LayerProfile],
    actions: list[Action],
    bw: dict[str, TierBandwidth],
    caps: dict[int, int] | None = None,
) -> dict[str, int]:
    """Peak bytes each tier holds in a step: every moved byte stays there until its layer's backward, and
    the host pool also stages the SSD writes not yet on the drive (a slot is the aligned O_DIRECT buffer
    until its write completes), so a drive slower than the forward pass fills the pool with its backlog.
    Each storage a profile recorded counts at its 4 KiB-aligned size, as the pool and the SSD file allocate
    it (storages of a few KiB take up to twice their bytes)."""
    moved = [
        _held(p, a, caps.get(i) if caps else None) if a.moved else 0
        for i, (p, a) in enumerate(zip(profiles, actions))
    ]
    _, _, write_done, _ = _forward(profiles, actions, bw, caps)
    host = ssd = staged = peak_host = 0
    pending: collections.deque[int] = collections.deque()  # SSD writes in order: one channel, FIFO
    clock = 0.0
    for i, (p, a) in enumerate(zip(profiles, actions)):
        clock += p.fwd_s
        if a.tier == Action.HOST:
            host += moved[i]
        elif a.tier == Action.SSD:
            ssd += moved[i]
            staged += moved[i]
            pending.append(i)
        while pending and write_done[pending[0]] <= clock:
            staged -= moved[pending.popleft()]
        peak_host = max(peak_host, host + staged)
    # after the forward the drive drains the backlog: the pool then holds the host layers only
    return {"host": peak_host, "ssd": ssd}


def simulate(
    profiles: list[LayerProfile],
    actions: list[Action],
    bw: dict[str, TierBandwidth],
    depth: int,
    caps: dict[int, int] | None = None,
) -> tuple[float, float, int]:
    """(step time, exposed stall, peak activation bytes) of one assignment under the cost model above;
    ``caps[i]`` bounds the bytes an offloaded layer ``i`` moves (the rest of its saved bytes stays)."""
    t, stall, footprints = _timeline(profiles, actions, bw, depth, caps)
    return t, stall, max(footprints)


def _timeline(
    profiles: list[LayerProfile],
    actions: list[Action],
    bw: dict[str, TierBandwidth],
    depth: int,
    caps: dict[int, int] | None = None,
) -> tuple[float, float, list[int]]:
    """(step time, exposed stall, the activation footprint at every point the module docstring lists)."""
    n = len(profiles)
    t, free, write_done, off_device = _forward(profiles, actions, bw, caps)
    moved, kept = _split(profiles, actions, caps)
    kept_upto = list(itertools.accumulate(kept, initial=0))
    moved_upto = list(itertools.accumulate(moved, initial=0))
    by_done = sorted((off_device[j], j) for j in range(n) if moved[j])
    done_times = [d for d, _ in by_done]

    def on_device(upto: int, at: float, lo: int) -> int:
        """Bytes of layers ``j < upto`` on the device at time ``at``: what they keep, what they move if it
        has been read back (``j >= lo``) or has not left the device yet. Prefix sums and the writes still under
        way keep this O(writes in flight), not O(layers): the search calls it for every point of every plan."""
        lo = min(max(lo, 0), upto)
        total = kept_upto[upto] + moved_upto[upto] - moved_upto[lo]
        for k in range(bisect.bisect_right(done_times, at), len(by_done)):
            j = by_done[k][1]
            if j < lo:
                total += moved[j]
        return total

    feet: list[int] = []
    clock = 0.0
    for i, p in enumerate(profiles):
        feet.append(p.fwd_background_bytes + on_device(i, clock, i) + p.fwd_own(actions[i]))
        clock += p.fwd_s
        # after the last layer's forward, its reads and the next depth layers' are issued
        feet.append(p.gap_background_bytes + on_device(i + 1, clock, i - depth if i == n - 1 else i + 1))
    for k in free:
        free[k] = max(free[k], t)
    read_done: dict[int, float] = {}
    next_issue = n - 1  # reads are issued in backward order
    stall = 0.0
    for i in range(n - 1, -1, -1):
        while next_issue >= max(0, i - depth):
            j = next_issue
            a = actions[j]
            if a.moved:
                tier = a.tier.value
                start = max(t, free[tier], write_done[j])
                free[tier] = start + moved[j] / bw[tier].read_Bps
                read_done[j] = free[tier]
            next_issue -= 1
        if i in read_done and read_done[i] > t:
            stall += read_done[i] - t
            t = read_done[i]
        # kept bytes of layers <= i, moved ones prefetched into [i - depth, i] or still being written
        p = profiles[i]
        feet.append(p.bwd_background_bytes + on_device(i + 1, t, i - depth) + p.bwd_own(actions[i]))
        t += p.bwd_s + p.extra_bwd_s(actions[i])
    return t, stall, feet


def _overflow(
    profiles: list[LayerProfile],
    actions: list[Action],
    bw: dict[str, TierBandwidth],
    depth: int,
    budget: float,
) -> tuple[float, float, int]:
    """(step time, summed footprint over budget, peak): the sum, unlike the peak, falls when any of several
    equal peaks falls, which keeps the descent off plateaus."""
    t, _, feet = _timeline(profiles, actions, bw, depth)
    return t, sum(max(0.0, m - budget) for m in feet), max(feet)


def _choices(
    cfg: ActivationOffloadConfig, bw: dict[str, TierBandwidth], profiles: list[LayerProfile]
) -> list[Action]:
    tiers = [t for t in cfg.tiers if t in bw]
    out = [Action.KEEP, Action.RECOMPUTE, *(Action(t) for t in tiers)]
    if any(p.sel_saved_bytes is not None for p in profiles):
        out += [Action(f"{a.value}+sel") for a in out if a != Action.RECOMPUTE]
    if any(p.input_bytes for p in profiles):
        out += [Action(f"recompute+{t}") for t in tiers]
    return out


def _usable(a: Action, p: LayerProfile) -> bool:
    if p.recompute_only:  # its inputs cannot move either: the non-reentrant checkpoint holds them itself
        return a == Action.RECOMPUTE
    return not a.sel or p.sel_saved_bytes is not None


def _fit(a: Action, p: LayerProfile) -> Action:
    """``a`` where the layer can take it, else the nearest it can: drop ``+sel``; recompute if it must."""
    if _usable(a, p):
        return a
    return Action.RECOMPUTE if p.recompute_only else a.base


def _depth(profiles: list[LayerProfile], bw: dict[str, TierBandwidth]) -> int:
    """Enough layers in flight that one layer's read fits in the backward time of those ahead of it."""
    if not bw or not profiles:
        return 1
    slowest = min(b.read_Bps for b in bw.values())
    read_s = max(p.saved_bytes for p in profiles) / slowest
    bwd = sorted(p.bwd_s for p in profiles)[len(profiles) // 2] or 1e-9
    return int(min(MAX_DEPTH, max(1, -(-read_s // bwd))))


def tier_capacity(cfg: ActivationOffloadConfig) -> dict[str, int]:
    """Bytes a plan may keep in each tier: ``host_pool_gb`` and ``ssd_capacity_gb`` less 1/128. ``tier_usage``
    counts the storages a profile recorded at their aligned sizes; the reserve is still needed for those it
    did not record (older profiles, ``+sel`` without ``sel_saved_sizes``, recomputed layers' inputs), whose
    alignment ``tier_usage`` cannot count, and for the SSD reads' staging slots in the pool during backward
    (a read that finds the pool full stages in a buffer of its own, allocated per read)."""
    return {
        tier: int(gb * GB) - int(gb * GB) // 128
        for tier, gb in (("host", cfg.host_pool_gb), ("ssd", cfg.ssd_capacity_gb))
    }


def _over_capacity(usage: dict[str, int], capacity: dict[str, int]) -> int:
    return sum(max(0, usage[t] - capacity[t]) for t in usage)


def make_plan(
    profiles: list[LayerProfile],
    bandwidths: list[TierBandwidth],
    cfg: ActivationOffloadConfig,
    *,
    exhaustive_limit: int = 4**7,
    best_effort: bool = False,
    outside_s: float = 0.0,
) -> Plan:
    """Pick an action per layer: least predicted step time under ``cfg.memory_budget_gb``.

    With no budget, offload only what the bound hides: the plan that saves the most memory among those
    predicted no slower than keeping everything (within 0.5%).

    Raises
    ------
    PlanError
        If no plan the search considers meets the budget (policy ``auto``); the message gives the lowest
        peak the planner reaches (as ``floor_bytes``: the most frugal uniform plan's or the lowest-peak
        plan's the search considered, if lower). With ``best_effort`` the plan of lowest peak among those
        considered is returned instead, with ``over_budget`` set (training then measures whether the
        model's estimate was pessimistic).
    ValueError
        If a profile's time or byte count is NaN, infinite or negative (naming the layer and the field), or
        policy ``offload_all`` has no bandwidth for its tier (the last of ``cfg.tiers``, as the runtime).

    Policies ``none``, ``recompute_all`` and ``offload_all`` give the runtime's fixed plans (``offload_all``:
    every layer to the last tier of ``cfg.tiers``, at ``cfg.prefetch_depth`` or 1), with ``over_budget`` set
    where a budget is given and their predicted peak exceeds it.

    ``outside_s`` (the profiling step's time outside the layers: ``Profiler.outside_s``) does not enter the
    search; it is carried into ``Plan.predicted_total_step_s`` and the printed plan.

    Notes
    -----
    Cost grows about as n^3 in the number of layers: on a 2-core machine 16 layers take ~2-3 s, 32 ~11 s,
    64 ~45-70 s (``Plan.search_s``).
    """
    t_start = time.perf_counter()
    _check_profiles(profiles)
    bw = _bandwidths(bandwidths, cfg)
    n = len(profiles)
    depth = cfg.prefetch_depth or _depth(profiles, bw)
    keep_all = [Action.KEEP] * n
    base_t, _, keep_bytes = simulate(profiles, keep_all, bw, depth)
    budget_bytes = None if cfg.memory_budget_gb is None else int(cfg.memory_budget_gb * GB)
    if cfg.policy == "none":
        actions = keep_all
    elif cfg.policy == "recompute_all":
        actions = [Action.RECOMPUTE] * n
    elif cfg.policy == "offload_all":
        # the runtime's rule (ActivationOffload): every layer to the last tier, at prefetch_depth or 1
        last = Action(cfg.tiers[-1])
        if last.value not in bw:
            raise ValueError(
                f"policy 'offload_all' moves every layer to the last tier, {last.value!r}, and no bandwidth "
                f"was given for it (bandwidths measured: {sorted(bw) or 'none'})"
            )
        depth = cfg.prefetch_depth or 1
        actions = [last] * n
        if cfg.recompute_modules:
            actions = [
                Action(f"{last.value}+sel") if p.sel_saved_bytes is not None else last for p in profiles
            ]
    else:
        # The prefetch depth trades stall (too shallow) against memory (too deep): search it too.
        depths = [cfg.prefetch_depth] if cfg.prefetch_depth else list(range(1, min(n, MAX_DEPTH) + 1))
        found = {d: _search(profiles, bw, cfg, d, base_t, exhaustive_limit) for d in depths}
        budget = None if cfg.memory_budget_gb is None else cfg.memory_budget_gb * GB
        fits = [d for d in depths if budget is None or found[d].peak <= budget]
        if fits:
            depth = min(fits, key=lambda d: found[d].score)
            actions = found[depth].actions
        else:
            # no plan considered meets the budget: the lowest peak among them (what best effort installs)
            depth = min(depths, key=lambda d: found[d].lowest[0])
            actions = found[depth].lowest[1]
            if not best_effort:
                choices, capacity = _choices(cfg, bw, profiles), tier_capacity(cfg)
                uniform = min(_floor(profiles, bw, choices, d, capacity) for d in depths)
                floor = min(uniform, found[depth].lowest[0][1])
                raise PlanError(
                    f"memory_budget_gb={cfg.memory_budget_gb} cannot be met: the most frugal plan found "
                    f"keeps {floor / GB:.2f} GiB of activations (raise the budget, add a tier, or lower the "
                    "micro-batch)"
                )
    t_fwd = sum(p.fwd_s for p in profiles)
    t_bwd = sum(p.bwd_s for p in profiles)
    # every moved byte, to either tier, crosses the device's link first (_forward): the host tier's, or the
    # SSD tier's where there is no host tier
    link = bw.get("host") or bw.get("ssd")
    hide_w = link.write_Bps * t_fwd if link else 0.0
    hide_r = link.read_Bps * t_bwd if link else 0.0
    caps: dict[int, int] = {}
    if cfg.policy == "auto" and cfg.memory_budget_gb is None and bw:
        # Fill no further than the bound (past it, writes spilling into backward are the model's guess, not
        # measured), at each prefetch depth: a partial layer's read may need a deeper one than the whole-layer
        # plan chose. _fill_bound only keeps caps whose plan stays within the limit and does not peak higher
        # than the plan it fills; a fill is kept only if it peaks no higher than the whole-layer plan.
        whole_peak = simulate(profiles, actions, bw, depth)[2]
        room = int(min(hide_w, hide_r) - sum(_split(profiles, actions, None)[0]))
        fills = [
            (*_fill_bound(profiles, actions, bw, d, base_t * 1.005, room, tier_capacity(cfg)), d)
            for d in depths
        ]
        fills = [f for f in fills if f[1] and simulate(profiles, f[0], bw, f[2], f[1])[2] <= whole_peak]
        if fills:
            actions, caps, depth = max(fills, key=lambda f: (sum(f[1].values()), -f[2]))
    t, stall, peak = simulate(profiles, actions, bw, depth, caps)
    planned = sum(_split(profiles, actions, caps)[0])
    usage, capacity = tier_usage(profiles, actions, bw, caps), tier_capacity(cfg)
    bound = {
        "hideable_write_bytes": hide_w,
        "hideable_read_bytes": hide_r,
        "planned_bytes": planned,
        "fraction_of_bound": planned / min(hide_w, hide_r) if min(hide_w, hide_r) > 0 else 0.0,
        "baseline_step_s": base_t,
        "keep_all_bytes": keep_bytes,
        "budget_bytes": budget_bytes,
        "tiers": {k: {"write_Bps": v.write_Bps, "read_Bps": v.read_Bps} for k, v in bw.items()},
        "tier_bytes": {k: usage[k] for k in bw},
        "tier_capacity_bytes": {k: capacity[k] for k in bw},
    }
    over = budget_bytes is not None and peak > budget_bytes
    barrier = cfg.resolved("write_barrier") == "on"
    fwd_barrier, bwd_barrier = write_barrier(profiles, actions, bw, caps) if barrier else ([], [])
    return Plan(actions, depth, t, bound, profiles, peak, stall, over_budget=over, move_caps=caps,
                search_s=time.perf_counter() - t_start, write_barrier=fwd_barrier,
                write_barrier_bwd=bwd_barrier, outside_s=outside_s)  # fmt: skip


_TIME_FIELDS = ("fwd_s", "bwd_s", "sel_recompute_s")
_BYTE_FIELDS = ("saved_bytes", "sel_saved_bytes", "bwd_workspace_bytes", "fwd_peak_bytes", "input_bytes")
# differences between measured memory levels (what is allocated beyond the saved bytes): may be negative
_SIGNED_FIELDS = ("fwd_background_bytes", "gap_background_bytes", "bwd_background_bytes")


def _check_profiles(profiles: list[LayerProfile]) -> None:
    """ValueError naming the layer and the field where a time or a byte count is not a finite number, or is
    negative (the background fields, differences of measured levels, may be)."""
    for p in profiles:
        values = [(f, getattr(p, f)) for f in (*_TIME_FIELDS, *_BYTE_FIELDS, *_SIGNED_FIELDS)]
        values += [
            (f"{f}[{k}]", v) for f in ("saved_sizes", "sel_saved_sizes") for k, v in enumerate(getattr(p, f))
        ]
        for name, v in values:
            if v is None and name == "sel_saved_bytes":
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


def _bandwidths(bandwidths: list[TierBandwidth], cfg: ActivationOffloadConfig) -> dict[str, TierBandwidth]:
    """The configured tiers with a measured bandwidth."""
    return {b.tier: b for b in bandwidths if b.tier in cfg.tiers and b.write_Bps > 0 and b.read_Bps > 0}


def _floor(
    profiles: list[LayerProfile],
    bw: dict[str, TierBandwidth],
    choices: list[Action],
    depth: int,
    capacity: dict[str, int],
) -> int:
    """The peak of the most frugal uniform plan (every layer the same action, where it can take it) that
    its tiers can hold."""
    plans = ([_fit(a, p) for p in profiles] for a in choices)
    return min(
        simulate(profiles, plan, bw, depth)[2]
        for plan in plans
        if not _over_capacity(tier_usage(profiles, plan, bw), capacity)
    )


def floor_bytes(
    profiles: list[LayerProfile], bandwidths: list[TierBandwidth], cfg: ActivationOffloadConfig
) -> int:
    """The lowest activation peak the planner reaches, over prefetch depths 1..``MAX_DEPTH`` (or
    ``cfg.prefetch_depth``): the lower of the most frugal uniform plan's peak and the peak of the lowest-peak
    plan policy ``auto``'s search considers (``make_plan`` under a zero budget, best effort). Where the search
    is exhaustive no plan peaks lower, so budgets below it have no plan; the local search may miss lower ones.
    """
    _check_profiles(profiles)
    bw = _bandwidths(bandwidths, cfg)
    choices = _choices(cfg, bw, profiles)
    depths = [cfg.prefetch_depth] if cfg.prefetch_depth else range(1, min(len(profiles), MAX_DEPTH) + 1)
    uniform = min(_floor(profiles, bw, choices, d, tier_capacity(cfg)) for d in depths)
    lowest = make_plan(
        profiles,
        bandwidths,
        cfg.model_copy(update={"policy": "auto", "memory_budget_gb": 0.0}),
        best_effort=True,
    )
    return min(uniform, lowest.peak_bytes)


def _fill_bound(
    profiles: list[LayerProfile],
    actions: list[Action],
    bw: dict[str, TierBandwidth],
    depth: int,
    limit_s: float,
    room: int,
    capacity: dict[str, int],
) -> tuple[list[Action], dict[int, int]]:
    """Hide-only plans move whole layers, so they stop short of the bound by up to one layer (on the H100 a
    megatron-core layer is 4 GiB of a 4.9 GiB bound). Move part of more kept layers, one at a time: each
    time the most bytes any single kept layer can move, up to the ``room`` left under the bound, while the
    step stays within ``limit_s`` (bisection on the byte count), the tier within ``capacity`` and the peak
    no higher than the plan's so far (moving part of a layer can hold the link while another layer's write
    would have ended), until no layer adds a MiB."""
    actions, caps = list(actions), {}
    tier = next(iter(bw))
    room = min(room, capacity[tier] - tier_usage(profiles, actions, bw)[tier])
    cur_peak = simulate(profiles, actions, bw, depth)[2]
    while room >= 1 << 20:
        best: tuple[int, int, int, Action] | None = None
        for i, a in enumerate(actions):
            if a.base != Action.KEEP:
                continue
            act = Action(f"{tier}+sel") if a.sel else Action(tier)
            cand = [*actions[:i], act, *actions[i + 1 :]]

            def fits(cap: int, cand: list[Action] = cand, i: int = i) -> tuple[bool, int]:
                """(within the step limit, the peak so far and the capacity; the peak) with layer i capped."""
                trial = {**caps, i: cap}
                t, _, peak = simulate(profiles, cand, bw, depth, trial)
                ok = t <= limit_s and peak <= cur_peak  # noqa: B023 (called in this iteration only)
                return ok and not _over_capacity(tier_usage(profiles, cand, bw, trial), capacity), peak

            lo, hi = 0, min(profiles[i].stored(act), room)
            while hi - lo > max(1 << 20, hi // 256):
                mid = (lo + hi) // 2
                if fits(mid)[0]:
                    lo = mid
                else:
                    hi = mid
            # what the runtime moves under that cap (a cap is then exactly the bytes it moves)
            lo = movable(profiles[i], act, lo & ~((1 << 20) - 1))
            if lo < 1 << 20:  # storages under a MiB only (norm statistics): not worth a layer's hooks
                continue
            ok, peak = fits(lo)  # rounded down, it moves fewer bytes: checked again
            if ok and (best is None or (lo, -peak) > (best[0], -best[1])):
                best = (lo, peak, i, act)
        if best is None:
            break
        lo, cur_peak, i, act = best
        actions[i], caps[i] = act, lo
        room -= lo
    return actions, caps


@dataclass
class _Found:
    """One depth's search: its best plan, that plan's score and peak, and the lowest-peak plan it considered,
    ranked by (over a tier's capacity, peak, step time) (with a budget only; the best-effort plan)."""

    actions: list[Action]
    score: tuple[float, ...]
    peak: int
    lowest: tuple[tuple[float, ...], list[Action]] | None


def _search(
    profiles: list[LayerProfile],
    bw: dict[str, TierBandwidth],
    cfg: ActivationOffloadConfig,
    depth: int,
    base_t: float,
    exhaustive_limit: int,
) -> _Found:
    choices = _choices(cfg, bw, profiles)
    n = len(profiles)
    budget = None if cfg.memory_budget_gb is None else cfg.memory_budget_gb * GB
    capacity = tier_capacity(cfg)
    roomy = min(capacity.values())
    held: dict[tuple[int, Action], int] = {}
    lowest: tuple[tuple[float, ...], list[Action]] | None = None

    def score(actions: list[Action]) -> tuple[float, ...]:
        nonlocal lowest
        # first what no tier can hold (the mover would leave those bytes on the device, over the plan); a
        # tier never holds more than all moved bytes, so most plans skip the second forward pass
        moved = 0
        for i, a in enumerate(actions):
            if a.moved:
                if (i, a) not in held:
                    held[i, a] = _held(profiles[i], a, None)
                moved += held[i, a]
        full = _over_capacity(tier_usage(profiles, actions, bw), capacity) if moved > roomy else 0
        if budget is None:  # hide only: no slower than baseline, then least memory, then least time
            t, _, peak = simulate(profiles, actions, bw, depth)
            return (full, max(0.0, t - base_t * 1.005), peak, t)
        t, over, peak = _overflow(profiles, actions, bw, depth, budget)
        if lowest is None or (full, peak, t) < lowest[0]:
            lowest = ((full, peak, t), list(actions))
        return (full, over, t, peak)

    if len(choices) ** n <= exhaustive_limit:
        plans = (list(c) for c in itertools.product(choices, repeat=n))
        best = min((c for c in plans if all(map(_usable, c, profiles))), key=score)
    else:
        # Descend from every uniform plan (keep all, recompute all, all to one tier) and keep the best end
        # point: from "keep all" alone a tight budget can leave the descent in a local minimum. Each pass
        # gives every layer in turn its best action with the others fixed, until a pass changes nothing: a
        # local minimum over single-layer changes, like steepest descent, in a few passes rather than one
        # evaluation of all n x c changes per step (which made 16 layers take a minute).
        ends = []
        starts = {tuple(_fit(start, p) for p in profiles) for start in choices}
        # in a fixed order: the plans considered, and so the lowest-peak one among ties, do not depend on
        # the set's (hash-seeded) order
        for start_plan in sorted(starts, key=lambda s: [a.value for a in s]):
            cur_plan = list(start_plan)
            cur = score(cur_plan)
            changed = True
            while changed:
                changed = False
                for i in range(n):
                    for a in choices:
                        if a == cur_plan[i] or not _usable(a, profiles[i]):
                            continue
                        cand = score([*cur_plan[:i], a, *cur_plan[i + 1 :]])
                        if cand < cur:
                            cur, cur_plan[i], changed = cand, a, True
            ends.append((cur, cur_plan))
        best = min(ends, key=lambda e: (e[0], [a.value for a in e[1]]))[1]
    sc = score(best)
    return _Found(best, sc, int(sc[3] if budget is not None else sc[2]), lowest)
