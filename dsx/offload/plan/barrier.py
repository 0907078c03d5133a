"""Write barriers: where in the forward and the backward the runtime waits for the copies off the device.

The cost model frees a moved layer's device memory when its copy ends on the GPU. The caching allocator sees
the free only when the host thread observes it, and the host runs ahead of the GPU, allocating later layers'
memory first. So a plan carries ``write_barrier`` / ``write_barrier_bwd``: the points where the runtime
(:meth:`~dsx.offload.hooks.LayerHooks.await_writes`) waits for the copies the model has finished by then, so
that the allocator frees what the model frees. They are placed only where memory is the point
(``write_barrier``: "auto" sets it when ``memory_budget_gb`` is given; a hide-only plan runs without it, where
the wait would cost step time for memory nobody asked for; docs/offload.md).
"""

from __future__ import annotations

from dsx.offload.plan.cost import _forward
from dsx.offload.plan.types import Action, LayerProfile
from dsx.runtime.bandwidth import TierBandwidth

__all__ = ["write_barrier", "write_barrier_fixed"]


def write_barrier(
    profiles: list[LayerProfile],
    actions: list[Action],
    bw: dict[str, TierBandwidth],
    caps: dict[int, int] | None = None,
) -> tuple[list[int], list[int]]:
    """Where the runtime waits for writes: (forward, backward). ``forward[j]`` for layer ``j``'s forward
    start and ``forward[n]`` for the end of the model's forward, ``backward[i]`` for layer ``i``'s backward
    start: the highest ``k`` such that the model has every moved layer ``<= k`` written off the device by then (-1 if
    none). Backward times leave out stalls, so they are never later than the model's.

    The runtime waits for those writes there (:meth:`LayerHooks.await_writes`). The model frees a layer's
    device memory when its copy ends on the GPU, but the caching allocator sees the free only when the host
    thread observes it, and the host runs ahead of the GPU, allocating later layers' memory first: without
    the wait, bytes the model had freed were still allocated at the peak.
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
            start += profiles[j].fwd_s + ((profiles[j].gap_s or 0.0) if j < n - 1 else 0.0)
    # forward[n] is awaited when the model's forward returns, before the head's backward: the gap after the last
    # layer (gap_s) counts for the backward's barriers only
    start += (profiles[-1].gap_s or 0.0) if n else 0.0
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
    the moved bytes in the allocator's order, and the step peaks far above what the moves leave on the device
    (docs/offload.md). The wait costs little time: the step is bound by the copies either way, since the first
    backward layer's read follows every write on the link.
    """
    if lag < 1:
        raise ValueError(f"lag must be >= 1, got {lag}")
    return [max(-1, j - lag) for j in range(n)] + [n - 1], []
