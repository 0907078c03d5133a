"""Row gathers from a host table: the CUDA zero-copy kernel and its pure-PyTorch twin.

Both paths share one contract: ``gather_rows(table, index)`` equals ``table[index]`` placed on the index's
device; indices are int32 or int64 of any shape; an index outside ``[0, rows)`` raises
:class:`IndexOutOfRangeError` naming it (never garbage). Both sort the indices first (``sort=True``): the
kernel so that consecutive warps read neighbouring host addresses (whole 128-byte PCIe requests rather than
scattered partial ones), the twin so that each distinct row is read and transferred once.

The kernel is bound by the PCIe link and reaches a plain pinned copy's bandwidth for rows of a few hundred
bytes and more; the twin is bound by the host memory bandwidth of the CPU threads that gather into pinned
staging memory. Measured figures, by row size and index count: docs/unified.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dsx.runtime.host_memory import page_aligned_empty

__all__ = [
    "IndexOutOfRangeError",
    "PendingCheck",
    "bad_index_message",
    "check_index",
    "cuda_gather",
    "host_empty",
    "padded_row_stride",
    "row_bytes_of",
    "row_stride_of",
    "rows_contiguous",
    "strided_rows",
    "torch_gather",
]

_INDEX_DTYPES = (torch.int32, torch.int64)
_I32_MAX = 2**31 - 1


class IndexOutOfRangeError(IndexError):
    """A gather index outside ``[0, rows)``."""


def bad_index_message(value: int, count: int, rows: int) -> str:
    return (
        f"unified gather: index {value} is out of range for a table of {rows} rows (valid: 0..{rows - 1}); "
        f"{count} of the requested indices are out of range. The output of this gather is invalid."
    )


def check_index(index: torch.Tensor) -> None:
    """Raise TypeError for an index that is not an int32/int64 tensor."""
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"unified gather: index must be a torch.Tensor, got {type(index).__name__}")
    if index.dtype not in _INDEX_DTYPES:
        raise TypeError(
            f"unified gather: index dtype {index.dtype} is not supported; use torch.int32 or torch.int64 "
            "(e.g. index.long())"
        )


def _check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"unified gather: out has shape {tuple(out.shape)}, dtype {out.dtype} on {out.device}; "
            f"expected shape {shape}, dtype {dtype} on {device}"
        )
    if not out.is_contiguous():
        raise ValueError("unified gather: out must be contiguous")


def rows_contiguous(table: torch.Tensor) -> bool:
    """Whether ``table``'s rows are each contiguous and equally spaced, at least a row apart: a contiguous
    tensor, or the leading columns of a wider one (a row-padded table)."""
    if table.dim() == 0:
        return False
    inner = table.shape[1:]
    expect = 1
    for size, stride in zip(reversed(inner), reversed(table.stride()[1:])):
        if size > 1 and stride != expect:
            return False
        expect *= size
    return table.shape[0] <= 1 or table.stride(0) >= expect


def host_empty(shape: int | tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor whose first byte starts a page (4096 bytes), as a feature table
    for :func:`dsx.direct.unified` should: torch's own host allocations start on 64-byte boundaries, often
    half-way into a 128-byte line, and then every row of a multiple of 128 bytes costs the GPU gather one line
    read more than it needs (docs/unified.md, "Where the table starts"). At most one page more than
    ``torch.empty``."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"host_empty: negative dimension in shape {shape}")
    return page_aligned_empty(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)


def padded_row_stride(row_bytes: int, align: int) -> int:
    """Bytes from one row to the next when rows of ``row_bytes`` start ``align`` bytes apart (0: unpadded)."""
    return -(-row_bytes // align) * align if align > 0 else row_bytes


def row_bytes_of(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> int:
    """Bytes in one row of a table of ``shape`` and ``dtype``."""
    return math.prod(shape[1:]) * dtype.itemsize


def row_stride_of(table: torch.Tensor) -> int:
    """Bytes from one row of ``table`` to the next (a table of one row: its row's size)."""
    if table.dim() > 0 and table.shape[0] > 1:
        return table.stride(0) * table.element_size()
    return row_bytes_of(table.shape, table.dtype)


def strided_rows(
    buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], row_stride: int
) -> torch.Tensor:
    """The table of ``shape`` and ``dtype`` whose rows lie ``row_stride`` bytes apart in the byte buffer
    ``buf`` (a view: each row contiguous, the padding between rows not part of it)."""
    size = dtype.itemsize
    if row_stride % size:
        raise ValueError(f"a row stride of {row_stride} bytes is not a whole number of {dtype} elements")
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    inner = torch.empty(tuple(shape[1:]), dtype=dtype, device="meta").stride()
    return buf.view(dtype).as_strided(tuple(shape), (row_stride // size, *inner))


# ------------------------------------------------------------------------------------- PyTorch twin


def torch_gather(
    table: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None, *, sort: bool = True
) -> torch.Tensor:
    """``table[index]`` on ``index.device`` through CPU ``index_select`` (the fallback and the reference).

    With ``sort``: indices are sorted and deduplicated on the CPU, each distinct row is gathered once into
    (pinned, when the destination is a GPU) staging memory, copied with ``non_blocking``, and un-permuted on
    the destination device. Synchronises with the index's stream when the index is on a GPU (the indices
    must be read on the host).
    """
    check_index(index)
    dev = index.device
    shape = (*index.shape, *table.shape[1:])
    if out is not None:
        _check_out(out, shape, table.dtype, dev)
    idx = index.reshape(-1).to("cpu")
    rows = table.shape[0]
    res = out if out is not None else torch.empty(shape, dtype=table.dtype, device=dev)
    if idx.numel() == 0:
        return res
    if sort:
        sidx, perm = torch.sort(idx)
        lo, hi = int(sidx[0]), int(sidx[-1])
    else:
        lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= rows:
        count = int(((idx < 0) | (idx >= rows)).sum())
        raise IndexOutOfRangeError(bad_index_message(lo if lo < 0 else hi, count, rows))
    flat = res.view(idx.numel(), *table.shape[1:])
    pinned = dev.type == "cuda"
    if not sort:
        if dev.type == "cpu":
            torch.index_select(table, 0, idx, out=flat)
            return res
        staged = torch.empty((idx.numel(), *table.shape[1:]), dtype=table.dtype, pin_memory=pinned)
        torch.index_select(table, 0, idx, out=staged)
        flat.copy_(staged, non_blocking=True)
        return res
    uniq, inv = torch.unique_consecutive(sidx, return_inverse=True)
    staged = torch.empty((uniq.numel(), *table.shape[1:]), dtype=table.dtype, pin_memory=pinned)
    torch.index_select(table, 0, uniq, out=staged)
    if dev.type != "cpu":
        # Only distinct rows cross PCIe; the caching host allocator keeps ``staged`` alive until the copy ends.
        staged = staged.to(dev, non_blocking=True)
        perm, inv = perm.to(dev, non_blocking=True), inv.to(dev, non_blocking=True)
    flat.index_copy_(0, perm, staged.index_select(0, inv))
    return res


# --------------------------------------------------------------------------------------- CUDA kernel


@dataclass
class PendingCheck:
    """The error flag of a launched gather: ``[count, index]`` copied to pinned host memory after an event."""

    event: torch.cuda.Event
    host_flag: torch.Tensor
    rows: int
    keep: list[torch.Tensor] = field(default_factory=list)

    def ready(self) -> bool:
        return bool(self.event.query())

    def raise_if_bad(self) -> None:
        self.event.synchronize()
        count, value = (int(v) for v in self.host_flag.tolist())
        if count:
            raise IndexOutOfRangeError(bad_index_message(value, count, self.rows))


def cuda_gather(
    ext: object,
    table: torch.Tensor,
    index: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    sort: bool = True,
    max_sms: int = 0,
) -> tuple[torch.Tensor, PendingCheck]:
    """Launch the zero-copy kernel on the current stream of ``index.device``; return ``(out, check)``.

    ``table`` must be a CPU tensor registered with ``cudaHostRegister`` (see :func:`dsx.direct.unified`)
    whose rows are contiguous and equally spaced: contiguous, or a row-padded table (:func:`strided_rows`).
    The indices are sorted on the GPU (``torch.sort``, part of the op); the kernel reads each distinct row
    once and writes it to every output position that asked for it. An
    out-of-range index makes the kernel zero that output row and set a device flag; ``check`` holds the flag
    (copied to pinned host memory behind an event) — call ``check.raise_if_bad()`` at a sync point.
    """
    check_index(index)
    if index.device.type != "cuda":
        raise ValueError(f"unified gather: the CUDA backend needs the index on a GPU, got {index.device}")
    if table.device.type != "cpu" or not rows_contiguous(table):
        raise ValueError(
            "unified gather: the table must be a registered CPU tensor whose rows are contiguous "
            "(contiguous, or the leading columns of a wider table)"
        )
    dev = index.device
    shape = (*index.shape, *table.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=table.dtype, device=dev)
    else:
        _check_out(out, shape, table.dtype, dev)
    idx = index.reshape(-1)
    if not idx.is_contiguous():
        idx = idx.contiguous()
    row_bytes, row_stride = row_bytes_of(table.shape, table.dtype), row_stride_of(table)
    flag = torch.zeros(2, dtype=torch.int64, device=dev)
    keep = [table]
    if idx.numel() and row_bytes:
        if sort:
            if idx.dtype == torch.int64 and table.shape[0] <= _I32_MAX:
                # Sorting 32-bit keys takes half the radix passes of 64-bit ones. The clamp keeps every
                # in-range id exact and every out-of-range id out of range (reported at the int32 bound).
                idx = idx.clamp(-_I32_MAX - 1, _I32_MAX).int()
            sidx, perm = torch.sort(idx)
            ext.gather(  # type: ignore[attr-defined]
                table, sidx, perm, out, flag, row_bytes, row_stride, table.shape[0], max_sms, True
            )
            keep += [sidx, perm]
        else:
            ext.gather(  # type: ignore[attr-defined]
                table, idx, None, out, flag, row_bytes, row_stride, table.shape[0], max_sms, False
            )
    host_flag = torch.empty(2, dtype=torch.int64, pin_memory=True)
    host_flag.copy_(flag, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(dev))
    return out, PendingCheck(event=event, host_flag=host_flag, rows=table.shape[0], keep=keep)
