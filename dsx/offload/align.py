"""The unit every tier allocates in: 4 KiB, what O_DIRECT file I/O needs of offsets, sizes and buffers.

A leaf module, so that the planner counts bytes as the tiers hold them without importing the tiers."""

from __future__ import annotations

import torch

__all__ = ["ALIGN", "align_up", "aligned_empty"]

ALIGN = 4096


def align_up(n: int, a: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return -(-n // a) * a


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """An uninitialised uint8 host buffer of ``nbytes`` whose start is ``ALIGN``-aligned (O_DIRECT's rule),
    pinned when ``pin``."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip : skip + nbytes]
