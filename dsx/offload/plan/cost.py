"""The planner's cost model: one training step, per rank, under a plan.

Forward runs layers 0..n-1 (times ``fwd_s``); an offloaded layer's saved bytes are copied to the host as
soon as the layer's forward ends and the device-to-host link is free (writes never stall compute; they hold
GPU memory until the copy is done); an SSD layer's copy lands in its staging slot in the pool, and its file
write follows on the drive's channel (the pool holds it until then; without a host tier the link's rate is
not measured, and the model holds an SSD layer on the device until its file write ends). Backward runs
layers n-1..0 (times ``bwd_s``); when layer ``i``'s backward starts, reads are issued for the offloaded
layers down to ``i - depth``; a layer whose read has not finished when its backward starts stalls. The
gap after the last layer's forward (its ``gap_s``: the head, the loss and their backward) carries writes too;
its time is part of the step outside the layers, which the model's step leaves out. The model issues the last
layers' reads after that gap (the runtime issues them when the forward returns, earlier: the model is the more
cautious about stalls). A
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

Without a budget, each moved tensor also costs the step its hooks' host time (``TierBandwidth.per_tensor_s``,
from ``moved_tensor_host_us``), added at the end: the hooks run on the thread that queues the GPU's work.

A plan never holds more in a tier than the tier can (``tier_usage`` within ``tier_capacity``: the host pool
also stages SSD writes; each storage whose size the profile recorded counts at its 4 KiB-aligned size, as
the pool and the file allocate it).
"""

from __future__ import annotations

import bisect
import collections
import itertools

from dsx.config import ActivationOffloadConfig
from dsx.offload.align import align_up
from dsx.offload.plan.types import GB, Action, LayerProfile, cap_floor
from dsx.runtime.bandwidth import TierBandwidth

__all__ = ["footprints", "movable", "simulate", "tier_capacity", "tier_usage"]


def _sizes(p: LayerProfile, a: Action) -> list[int]:
    """The storages layer ``p`` stores under ``a``, in the runtime's save order; empty where unknown (not
    profiled, or a recomputed layer's inputs)."""
    if a.recomputed:
        return []
    return p.sel_saved_sizes if a.sel else p.saved_sizes


def _greedy(sizes: list[int], cap: int, floor: int = 0) -> list[int]:
    """The runtime's rule (``LayerHooks._pack``): in save order, each storage of at least ``floor`` bytes still
    fitting under ``cap``."""
    out, done = [], 0
    for n in sizes:
        if n >= floor and done + n <= cap:
            done += n
            out.append(n)
    return out


def movable(p: LayerProfile, a: Action, cap: int) -> int:
    """Bytes layer ``p`` moves under action ``a`` when at most ``cap`` may move: the runtime's rule
    (``LayerHooks._pack``) over its saved storages in save order (``saved_sizes``; ``sel_saved_sizes`` for
    ``+sel`` actions), each moving if it still fits under the cap (and is at least a
    :class:`~dsx.offload.plan.types.MoveCap`'s ``floor``). A storage is not split, so a cap between storage
    sizes moves less than the cap (much less for a layer of a few large storages, as a megatron-core layer's
    softmax block). Where the order is unknown (profiles without those sizes, recomputed layers' inputs), the
    cap itself."""
    s, floor = p.stored(a), cap_floor(cap)
    if cap >= s and not floor:
        return s
    sizes = _sizes(p, a)
    return sum(_greedy(sizes, cap, floor)) if sizes else min(cap, s)


def _moved_tensors(p: LayerProfile, a: Action, cap: int | None) -> int:
    """How many storages layer ``p`` moves under ``a`` (``cap``: a partial layer's); one where the profile
    does not know them."""
    sizes = _sizes(p, a)
    if not sizes:
        return 1
    return len(sizes) if cap is None else len(_greedy(sizes, cap, cap_floor(cap)))


def _held(p: LayerProfile, a: Action, cap: int | None) -> int:
    """Bytes a tier gives what layer ``p`` moves under ``a`` (at most ``cap``): the pool and the SSD file
    allocate each storage at its 4 KiB-aligned size (``Arena``); where the storages are unknown, the bytes
    moved (``tier_capacity``'s reserve covers their alignment)."""
    sizes = _sizes(p, a)
    if not sizes:
        return p.stored(a) if cap is None else movable(p, a, cap)
    if cap is not None and (cap < p.stored(a) or cap_floor(cap)):
        sizes = _greedy(sizes, cap, cap_floor(cap))
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
        if a.moved:
            tier = a.tier.value
            if link is not None:
                link_free = off_device[i] = max(t, link_free) + moved[i] / link.write_Bps
                if tier == "ssd":
                    free[tier] = write_done[i] = (
                        max(off_device[i], free[tier]) + moved[i] / bw[tier].write_Bps
                    )
                else:
                    free[tier] = write_done[i] = off_device[i]
            else:
                free[tier] = write_done[i] = off_device[i] = (
                    max(t, free[tier]) + moved[i] / bw[tier].write_Bps
                )
        t += p.gap_s or 0.0
    if link is not None:
        free["host"] = max(free["host"], link_free)
    return t, free, write_done, off_device


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
    """(step time, exposed stall, peak activation bytes) of one assignment under the cost model (the module
    docstring); ``caps[i]`` bounds the bytes an offloaded layer ``i`` moves (the rest of its saved bytes stays)."""
    t, stall, footprints = _timeline(profiles, actions, bw, depth, caps)
    return t, stall, max(footprints)


def footprints(profiles: list[LayerProfile], actions: list[Action] | None = None) -> list[int]:
    """The activation footprint at every point the module docstring lists, in step order: each layer's
    forward and the gap after it (layers 0..n-1), then each layer's backward (n-1..0). ``actions`` default to
    keeping every layer (no tier is then needed)."""
    actions = actions or [Action.KEEP] * len(profiles)
    if any(a.moved for a in actions):
        raise ValueError("footprints() takes keep / recompute actions only: moves need the tiers' bandwidths")
    return _timeline(profiles, actions, {}, 0)[2]


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
        # after the last layer's forward, its reads and the next depth layers' are issued; the gap's footprint
        # is taken at its start (its peak may come at once), and writes run on through it
        feet.append(p.gap_background_bytes + on_device(i + 1, clock, i - depth if i == n - 1 else i + 1))
        clock += p.gap_s or 0.0
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
    # the gaps are outside the layers, in the step's outside time (Profiler.outside_s) that the plan adds
    t -= sum(p.gap_s or 0.0 for p in profiles)
    # the host time of the moved tensors' hooks, on the thread that queues the GPU's work: the step waits for it
    t += sum(
        bw[a.tier.value].per_tensor_s * _moved_tensors(p, a, caps.get(i) if caps else None)
        for i, (p, a) in enumerate(zip(profiles, actions))
        if a.moved and bw[a.tier.value].per_tensor_s
    )
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
