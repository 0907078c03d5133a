"""Opt-in index validation for the rgnn kernels (host-synchronising; for debugging and graph preparation).

The kernels never check index ranges themselves: a check needs a device-to-host copy, and the forward and
backward are meant to run without one. Pass ``check_indices=True`` to ``gather_gemm`` / ``fused_edge`` (or
call these functions once per prepared graph) to turn an out-of-range index into an error that names it.
"""

from __future__ import annotations

import torch

__all__ = ["check_index", "check_ptr"]


def check_index(name: str, idx: torch.Tensor | None, bound: int, what: str) -> None:
    """Raise if ``idx`` has a value outside ``[0, bound)`` (``bound`` = rows of ``what``)."""
    if idx is None or idx.numel() == 0:
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= bound:
        raise IndexError(
            f"{name} holds values in [{lo}, {hi}] but {what} has {bound} rows; every {name} value must be in "
            f"[0, {bound}). Rebuild the graph maps (e.g. relation ids >= num_relations or nodes past the node count)."
        )


def check_ptr(name: str, ptr: torch.Tensor, total: int) -> None:
    """Raise unless ``ptr`` is a non-decreasing CSR pointer starting at 0 and ending at ``total``."""
    if ptr.numel() == 0:
        raise ValueError(f"{name} is empty; it needs at least one entry (0)")
    first, last = int(ptr[0]), int(ptr[-1])
    if first != 0 or last != total:
        raise ValueError(
            f"{name} must start at 0 and end at {total} (the number of rows/edges); got {first}..{last}"
        )
    if ptr.numel() > 1 and bool((ptr[1:] < ptr[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing (a CSR pointer over sorted rows/edges)")
