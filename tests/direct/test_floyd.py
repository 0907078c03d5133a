"""Floyd's k-subset draws: the Triton kernel (interpreter on CPU, compiled on CUDA) against the PyTorch
reference from the same uniforms, and what every draw must be (distinct, in range, all of a short row)."""

from __future__ import annotations

import pytest
import torch

from dsx.direct.floyd import floyd
from dsx.ops.triton_backend import triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="Triton does not import here")


def _degrees(n: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    deg = torch.randint(0, 40, (n,), generator=g)
    deg[::7] = torch.randint(1000, 100_000, (deg[::7].numel(),), generator=g)  # hubs
    deg[::11] = 0
    return deg.to(device)


def _check(deg: torch.Tensor, k: int, out: torch.Tensor) -> None:
    assert out.shape == (deg.numel(), k) and out.dtype == torch.long
    for d, row in zip(deg.tolist(), out.tolist()):
        if d <= k:  # short rows: 0 .. k-1, the caller keeps the first d
            assert row == list(range(k))
        else:
            assert len(set(row)) == k and min(row) >= 0 and max(row) < d


@needs_triton
@pytest.mark.parametrize("n,k", [(1, 1), (300, 5), (257, 25), (130, 33)])
def test_interpreted_kernel_equals_reference(n, k):
    deg = _degrees(n, seed=n + k)
    ref = floyd(deg, k, torch.Generator().manual_seed(k), backend="reference")
    got = floyd(deg, k, torch.Generator().manual_seed(k), backend="interpret")
    assert torch.equal(got, ref)
    _check(deg, k, got)


def test_no_rows_give_an_empty_draw():
    for backend in ("reference", "interpret") if triton_available() else ("reference",):
        assert floyd(torch.zeros(0, dtype=torch.long), 4, backend=backend).shape == (0, 4)


def test_reference_draws_are_subsets():
    deg = _degrees(500, seed=3)
    _check(deg, 15, floyd(deg, 15, torch.Generator().manual_seed(0), backend="reference"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [1, 10, 25, 64])
def test_cuda_kernel_equals_reference(k):
    deg = _degrees(100_003, seed=k, device="cuda")
    got = floyd(deg, k, torch.Generator("cuda").manual_seed(k), backend="triton")
    ref = floyd(deg, k, torch.Generator("cuda").manual_seed(k), backend="reference")
    assert torch.equal(got, ref)
    _check(deg[:2000].cpu(), k, got[:2000].cpu())


def _check_rows(deg: torch.Tensor, row_k: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """Each row drew its own fanout into its first ``row_k`` columns; the columns past it hold their index."""
    assert out.shape == (deg.numel(), k)
    for d, kr, row in zip(deg.tolist(), row_k.tolist(), out.tolist()):
        assert row[kr:] == list(range(kr, k))
        if d <= kr:
            assert row[:kr] == list(range(kr))
        else:
            assert len(set(row[:kr])) == kr and min(row[:kr], default=0) >= 0 and max(row[:kr], default=0) < d


@pytest.mark.parametrize("backend", ["reference", pytest.param("interpret", marks=needs_triton)])
def test_rows_draw_their_own_fanouts(backend):
    deg = _degrees(400, seed=5)
    row_k = torch.randint(0, 13, (400,), generator=torch.Generator().manual_seed(6))
    got = floyd(deg, 12, torch.Generator().manual_seed(2), row_k=row_k, backend=backend)
    _check_rows(deg, row_k, 12, got)
    if backend == "interpret":  # the kernel and the reference take the same steps from the same uniforms
        ref = floyd(deg, 12, torch.Generator().manual_seed(2), row_k=row_k, backend="reference")
        assert torch.equal(got, ref)
    # rows whose own fanout is the largest draw as a call at that fanout does
    full = floyd(deg, 12, torch.Generator().manual_seed(2), backend=backend)
    same = row_k == 12
    assert same.any() and torch.equal(got[same], full[same])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_with_row_fanouts_equals_reference():
    deg = _degrees(50_001, seed=9, device="cuda")
    row_k = torch.randint(0, 26, (50_001,), device="cuda")
    got = floyd(deg, 25, torch.Generator("cuda").manual_seed(1), row_k=row_k, backend="triton")
    ref = floyd(deg, 25, torch.Generator("cuda").manual_seed(1), row_k=row_k, backend="reference")
    assert torch.equal(got, ref)
    _check_rows(deg[:2000].cpu(), row_k[:2000].cpu(), 25, got[:2000].cpu())
