"""The unit every tier allocates in: 4 KiB, what O_DIRECT file I/O needs of offsets, sizes and buffers.

A leaf module of offload, so that the planner counts bytes as the tiers hold them without importing the tiers."""

from __future__ import annotations

from dsx.runtime.host_memory import PAGE, page_aligned_empty

__all__ = ["ALIGN", "align_up", "aligned_empty"]

ALIGN = PAGE
# (O_DIRECT's rule: the buffer, like the file offset and the length, ALIGN-aligned)
aligned_empty = page_aligned_empty


def align_up(n: int, a: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return -(-n // a) * a
