"""Host buffers that start on a page (4 KiB): what O_DIRECT file I/O needs of its buffers, and where a table that
the GPU reads in place should start, so that its rows sit on PCIe's 128-byte lines (docs/unified.md, "Where the
table starts"). torch's own host allocations start on 64-byte boundaries."""

from __future__ import annotations

import torch

__all__ = ["PAGE", "page_aligned_empty"]

PAGE = 4096


def page_aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """An uninitialised uint8 host buffer of ``nbytes`` whose first byte starts a page, pinned when ``pin``; at
    most one page more than ``torch.empty`` takes.

    Pinned, it is asked for at ``nbytes`` first: torch's pinned-memory cache rounds a block up to a power of
    two (``pinned_max_round_threshold``), so that one page more would double a buffer whose size is one, and
    its blocks come whole from ``cudaHostAlloc``, which starts them on a page."""
    if pin:
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % PAGE == 0:
            return raw
        del raw
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % PAGE
    return raw[skip : skip + nbytes]
