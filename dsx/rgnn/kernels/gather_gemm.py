"""Gather-GEMM: ``out[i] = x[row_idx[i]] @ weight[r(i)]`` for all relations in one launch, with autograd."""

from __future__ import annotations

import functools
import weakref

import torch

from dsx.ops.triton_backend import resolve_backend
from dsx.ops.triton_source import load_source
from dsx.rgnn.codegen import generate_gather_gemm_source
from dsx.rgnn.graph import tensor_version
from dsx.rgnn.kernels.reference import gather_gemm_ref
from dsx.rgnn.kernels.validate import check_index, check_ptr

__all__ = ["build_tile_map", "cached_tile_map", "gather_gemm"]

_BLOCK_M = 64
_BLOCK_K = 32


def _dw_rows_per_tile(num_rows: int) -> int:
    # Rows summed by one weight-gradient program before its atomic add into dW[r]: about 2K tiles in all,
    # enough programs to fill the GPU while keeping the atomics on the (R, K, N) weights few.
    return max(256, min(4096, triton_next_pow2(max(1, num_rows // 2048))))


@functools.cache
def _module(precision: str, backend: str):
    interpret = backend == "interpret"
    source = generate_gather_gemm_source(precision, interpret=interpret)
    return load_source(f"gemm_{precision}", source, interpret=interpret)


def build_tile_map(
    rel_ptr: torch.Tensor, num_rows: int, rows_per_tile: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map each of ``cdiv(num_rows, rows_per_tile) + R`` tiles to (relation, first row), on the device.

    Relation ``r`` gets ``cdiv(count_r, rows_per_tile)`` tiles, so the total never exceeds the bound and the
    grid can be sized on the host from ``num_rows`` alone (no ``.item()``). Spare tiles get relation ``R``
    and exit at once.
    """
    num_rel = rel_ptr.numel() - 1
    counts = rel_ptr[1:] - rel_ptr[:-1]
    tiles = (counts + rows_per_tile - 1) // rows_per_tile
    tile_end = torch.cumsum(tiles, 0)
    bound = -(-num_rows // rows_per_tile) + num_rel
    t = torch.arange(bound, device=rel_ptr.device, dtype=torch.int64)
    tile_rel = torch.searchsorted(tile_end, t, right=True)
    safe = tile_rel.clamp(max=max(num_rel - 1, 0))
    first_tile = tile_end.index_select(0, safe) - tiles.index_select(0, safe)
    tile_row = rel_ptr.index_select(0, safe) + (t - first_tile) * rows_per_tile
    return tile_rel.contiguous(), tile_row.contiguous()


# (id(rel_ptr), tensor_version(rel_ptr), num_rows, rows_per_tile) -> (weakref to rel_ptr, (tile_rel, tile_row)).
_TILE_MAPS: dict[tuple, tuple] = {}


def cached_tile_map(rel_ptr: torch.Tensor, num_rows: int, rows_per_tile: int):
    """:func:`build_tile_map`, memoised per ``rel_ptr`` tensor (identity and in-place version).

    A prepared graph passes the same ``rel_ptr`` every call, so its tile maps are built once per graph
    instead of twice per forward + backward (~10 small ops each). An entry dies with its ``rel_ptr``.
    """
    key = (id(rel_ptr), tensor_version(rel_ptr), num_rows, rows_per_tile)
    hit = _TILE_MAPS.get(key)
    if hit is not None and hit[0]() is rel_ptr:
        return hit[1]
    tile_map = build_tile_map(rel_ptr, num_rows, rows_per_tile)
    try:
        ref = weakref.ref(rel_ptr, lambda _, key=key: _TILE_MAPS.pop(key, None))
    except TypeError:  # a tensor subclass without weak references: do not cache
        return tile_map
    _TILE_MAPS[key] = (ref, tile_map)
    return tile_map


def _block_n(n: int) -> int:
    return max(16, min(128, triton_next_pow2(n)))


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _launch_mm(mod, a, a_idx, w_strides, w, out, out_idx, rel_ptr, tile_map, k, n, gather, scatter):
    tile_rel, tile_row = tile_map
    block_n = _block_n(n)
    grid = (tile_rel.numel(), -(-n // block_n))
    mod.gather_gemm_kernel[grid](
        a, a_idx, w, out, out_idx, rel_ptr, tile_rel, tile_row,
        k, n, rel_ptr.numel() - 1, a.stride(0), *w_strides, out.stride(0),
        GATHER_A=gather, SCATTER_OUT=scatter, BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_K=_BLOCK_K,
    )  # fmt: skip


class _GatherGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, row_idx, rel_ptr, precision, backend):
        x = x.contiguous()
        weight = weight.contiguous()
        mod = _module(precision, backend)
        m, (num_rel, k, n) = row_idx.numel(), weight.shape
        out = torch.empty((m, n), device=x.device, dtype=x.dtype)
        empty = torch.empty(0, dtype=torch.int64, device=x.device)
        tile_map = cached_tile_map(rel_ptr, m, _BLOCK_M) if m > 0 and num_rel > 0 else (empty, empty)
        if m > 0 and num_rel > 0:
            strides = (weight.stride(0), weight.stride(1), weight.stride(2))
            _launch_mm(mod, x, row_idx, strides, weight, out, row_idx, rel_ptr, tile_map, k, n, True, False)
        ctx.save_for_backward(x, weight, row_idx, rel_ptr, *tile_map)
        ctx.precision, ctx.backend = precision, backend
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, row_idx, rel_ptr, tile_rel, tile_row = ctx.saved_tensors
        mod = _module(ctx.precision, ctx.backend)
        grad = grad.contiguous()
        m, (num_rel, k, n) = row_idx.numel(), weight.shape
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx32 = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
            if m > 0 and num_rel > 0:
                # dx[row_idx[i]] += g[i] @ W[r]^T: W^T is W with its last two strides swapped.
                strides = (weight.stride(0), weight.stride(2), weight.stride(1))
                _launch_mm(
                    mod, grad, row_idx, strides, weight, dx32, row_idx, rel_ptr, (tile_rel, tile_row), n, k,
                    False, True,
                )  # fmt: skip
            dx = dx32.to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw32 = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
            if m > 0 and num_rel > 0:
                rows_per_tile = _dw_rows_per_tile(m)
                t_rel, t_row = cached_tile_map(rel_ptr, m, rows_per_tile)
                bn = _block_n(n)
                grid = (t_rel.numel(), -(-k // _BLOCK_K), -(-n // bn))
                mod.gather_gemm_dw_kernel[grid](
                    x, row_idx, grad, dw32, rel_ptr, t_rel, t_row,
                    k, n, num_rel, x.stride(0), grad.stride(0), dw32.stride(0), dw32.stride(1),
                    ROWS_PER_TILE=rows_per_tile, BLOCK_M=_BLOCK_M, BLOCK_N=bn, BLOCK_K=_BLOCK_K,
                )  # fmt: skip
            dw = dw32.to(weight.dtype)
        return dx, dw, None, None, None, None


def gather_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    row_idx: torch.Tensor,
    rel_ptr: torch.Tensor,
    *,
    precision: str = "fp32",
    max_rows_per_rel: int | None = None,
    backend: str | None = None,
    check_indices: bool = False,
) -> torch.Tensor:
    """Typed linear over relation segments; see :mod:`dsx.rgnn.kernels` for the full contract.

    Parameters
    ----------
    x : Tensor [N, K]
    weight : Tensor [R, K, Nout]
    row_idx : int64 Tensor [M]
        Row of ``x`` feeding output position ``i``; positions are grouped by relation.
    rel_ptr : int64 Tensor [R + 1]
        Relation ``r`` owns positions ``rel_ptr[r]:rel_ptr[r+1]`` (non-decreasing, ``rel_ptr[-1] == M``).
    precision : {"fp32", "tf32", "bf16"}
    max_rows_per_rel : int, optional
        Unused (kept for interface stability): the grid is sized from ``M`` and ``R`` alone.
    backend : {"triton", "interpret", "reference"}, optional
    check_indices : bool
        Validate ``rel_ptr`` and the range of ``row_idx`` first (synchronises with the host); off by default
        because the kernels never check indices themselves.

    Returns
    -------
    Tensor [M, Nout] in ``x.dtype``.
    """
    del max_rows_per_rel
    _check_gemm_args(x, weight, row_idx, rel_ptr, precision)
    if check_indices:
        check_ptr("rel_ptr", rel_ptr, row_idx.numel())
        check_index("row_idx", row_idx, x.shape[0], "x")
    chosen = resolve_backend(backend, x.device)
    if chosen == "reference":
        return gather_gemm_ref(x, weight, row_idx, rel_ptr)
    return _GatherGemm.apply(x, weight, row_idx, rel_ptr, precision, chosen)


def _check_gemm_args(x, weight, row_idx, rel_ptr, precision) -> None:
    if precision not in ("fp32", "tf32", "bf16"):
        raise ValueError(f"precision={precision!r} is not one of ('fp32', 'tf32', 'bf16')")
    if x.dim() != 2 or weight.dim() != 3 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"gather_gemm needs x [N, K] and weight [R, K, Nout] with the same K; got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if rel_ptr.numel() != weight.shape[0] + 1:
        raise ValueError(
            f"rel_ptr has {rel_ptr.numel()} entries; weight has R={weight.shape[0]}, so it needs R+1"
        )
    for name, t in (("row_idx", row_idx), ("rel_ptr", rel_ptr)):
        if t.dtype != torch.int64 or t.device != x.device:
            raise ValueError(
                f"{name} must be int64 on {x.device}; got {t.dtype} on {t.device} (use .long().to())"
            )
