"""Checksums of moved bytes, computed where the bytes are: on the GPU, on the side stream that moves them.

A checksum is three int64s: the byte count, the sum of the buffer's 32-bit words and the sum of each word times
an odd weight that grows with its position (``2 i + 1``), both modulo 2^64 (integer sums wrap, so the order a
device reduces in does not matter). A changed word changes the first sum; words swapped, shifted or replaced
by others whose sum is the same change the second, since every position has its own weight. It is one read of
the bytes (a Triton kernel on CUDA, which keeps per-block partial sums and needs no copy of the bytes), queued
on the stream that copies them, so it runs beside compute rather than on the host, and its 24 bytes come to the
host with the copy. Elsewhere the same sums are taken with torch operations, in slices, so that the widened
words never take more than a few tens of MiB.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["checksum", "mismatch"]

_BLOCK = 4096  # words per Triton program: one partial (s1, s2) per 16 KiB
_SLICE = 1 << 22  # words per torch slice: 16 MiB of bytes, three int64 temporaries of 32 MiB


@functools.cache
def _kernel():
    """The Triton kernel, or None where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # an ImportError, or a broken install raising anything else at import
        return None

    @triton.jit
    def partial_sums(words, n, out, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(words + offs, mask=offs < n, other=0).to(tl.int64)
        tl.store(out + 2 * pid, tl.sum(x, axis=0))
        tl.store(out + 2 * pid + 1, tl.sum(x * (2 * offs + 1), axis=0))

    return partial_sums


def _sums_torch(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s1 = torch.zeros((), dtype=torch.int64, device=words.device)
    s2 = torch.zeros((), dtype=torch.int64, device=words.device)
    for a in range(0, words.numel(), _SLICE):
        x = words[a : a + _SLICE].to(torch.int64)
        w = torch.arange(2 * a + 1, 2 * (a + x.numel()) + 1, 2, dtype=torch.int64, device=words.device)
        s1 += x.sum()
        s2 += (x * w).sum()
    return s1, s2


def _sums_triton(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = max(1, -(-words.numel() // _BLOCK))
    out = torch.empty(blocks, 2, dtype=torch.int64, device=words.device)
    _kernel()[(blocks,)](words, words.numel(), out, BLOCK=_BLOCK)
    s = out.sum(0)
    return s[0], s[1]


def checksum(buf: torch.Tensor, kernel: str = "auto") -> torch.Tensor:
    """``int64[3]`` checksum of the flat uint8 tensor ``buf`` (4-byte aligned start) on ``buf``'s device,
    queued on the current stream. ``kernel``: ``"triton"``, ``"torch"`` or ``"auto"`` (Triton for CUDA
    tensors where it imports); both give the same sums."""
    n = buf.numel()
    n4 = n - n % 4
    words = buf[:n4].view(torch.int32)
    # the last 1-3 bytes count as one more word (little-endian, zero-padded), after the others
    tail = buf[n4:].to(torch.int64)
    tail_word = (tail << (8 * torch.arange(tail.numel(), device=buf.device))).sum()
    if kernel == "triton" and _kernel() is None:
        raise RuntimeError(
            "dsx checksum: kernel='triton' needs Triton, which does not import here; use 'torch'"
        )
    if kernel not in ("auto", "triton", "torch"):
        raise ValueError(f"dsx checksum: kernel must be 'auto', 'triton' or 'torch', got {kernel!r}")
    use_triton = kernel == "triton" or (kernel == "auto" and buf.is_cuda and _kernel() is not None)
    s1, s2 = _sums_triton(words) if use_triton else _sums_torch(words)
    idx = words.numel()
    s1 = s1 + tail_word
    s2 = s2 + tail_word * (2 * idx + 1)
    # (new_full is a fill on the device: no host-to-device copy that would block the queueing thread)
    return torch.stack([s1.new_full((), n), s1, s2])


def mismatch(written: torch.Tensor, read: torch.Tensor) -> bool:
    """Whether two checksums (host tensors, their copies complete) differ."""
    return not torch.equal(written, read)
