"""Checksums of moved bytes, computed where the bytes are: on the GPU, on the side stream that moves them.

A checksum is three int64s: the byte count, the sum of the buffer's 32-bit words, and the sum of its 4 KiB
chunks' word sums weighted by chunk position (sums wrap modulo 2^64, so the order a device reduces in does not
matter). Any changed word changes the first sum; a zeroed, truncated, stale or misplaced page changes the
second. It is one read of the bytes, queued on the stream that copies them (the copy out on the offload
stream, the copy back on the prefetch stream), so it runs beside compute rather than on the host, and its
result, 24 bytes, comes to the host with the copy. On CPU the same torch operations run on the CPU tensors.
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK_WORDS", "checksum", "mismatch"]

CHUNK_WORDS = 1024  # 4 KiB: one page, the unit a drive or the page cache loses or misplaces


def checksum(buf: torch.Tensor) -> torch.Tensor:
    """``int64[3]`` checksum of the flat uint8 tensor ``buf`` (4-byte aligned start), on ``buf``'s device,
    queued on the current stream."""
    n = buf.numel()
    n4 = n - n % 4
    words = buf[:n4].view(torch.int32)
    full = words.numel() - words.numel() % CHUNK_WORDS
    chunks = words[:full].view(-1, CHUNK_WORDS).sum(1, dtype=torch.int64)
    tail = torch.cat([words[full:].to(torch.int64), buf[n4:].to(torch.int64) << 32]).sum().view(1)
    sums = torch.cat([chunks, tail])
    pos = torch.arange(1, sums.numel() + 1, dtype=torch.int64, device=buf.device)
    # (new_full is a fill on the device: no host-to-device copy that would block the queueing thread)
    return torch.stack([sums.new_full((), n), sums.sum(), (sums * pos).sum()])


def mismatch(written: torch.Tensor, read: torch.Tensor) -> bool:
    """Whether two checksums (host tensors, their copies complete) differ."""
    return not torch.equal(written, read)
