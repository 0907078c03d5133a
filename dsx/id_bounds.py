"""Index tensors whose producer vouches that their ids are in range, so that a consumer may skip its check.

dsx's samplers make edge lists whose node ids are below the batch's node counts by construction, and the
relational layers range-check every edge list they lay out: a few launches and a host synchronisation a
batch, which on a GPU also drains the work queued before it. A sampler records its bounds on each tensor it
makes (:func:`vouch`); :func:`vouched_within` lets a consumer skip the check while the tensor is unchanged
(the same object over the same memory, at the same in-place version) and the counts it is checked against
are at least those bounds. Anything else is checked: a copy, a slice, a tensor edited in place or given other
memory (``t.data = ...``, ``set_``), an inference tensor (it keeps no version counter, so an edit could not be
seen). Writes that bypass the version counter are not seen, as autograd does not see them either: through
``t.data[...]``, a NumPy view or DLPack.
"""

from __future__ import annotations

import torch

__all__ = ["vouch", "vouched_within"]

_ATTR = "_dsx_id_bounds"


def vouch(t: torch.Tensor, bounds: tuple[int, ...]) -> None:
    """Record that every id in row ``i`` of ``t`` lies in ``[0, bounds[i])`` (one bound per row of a 2-D
    tensor, or one for a 1-D tensor), as ``t`` is now."""
    if not t.is_inference():
        setattr(t, _ATTR, (tuple(int(b) for b in bounds), _state(t)))


def vouched_within(t: torch.Tensor, bounds: tuple[int, ...]) -> bool:
    """Whether ``t``'s producer vouched (:func:`vouch`) for ids within ``bounds``, row by row, and ``t`` has not
    changed since."""
    mark = getattr(t, _ATTR, None)
    if mark is None or t.is_inference() or mark[1] != _state(t) or len(mark[0]) != len(bounds):
        return False
    return all(have <= limit for have, limit in zip(mark[0], bounds))


def _state(t: torch.Tensor) -> tuple:
    # the memory the tensor reads and its in-place version: the ids are those vouched for while both hold
    return t._version, t.data_ptr(), t.shape, t.stride()
