"""The unit every tier allocates in: 4 KiB, what O_DIRECT file I/O needs of offsets, sizes and buffers.

A leaf module, so that the planner counts bytes as the tiers hold them without importing the tiers."""

from __future__ import annotations

__all__ = ["ALIGN", "align_up"]

ALIGN = 4096


def align_up(n: int, a: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return -(-n // a) * a
