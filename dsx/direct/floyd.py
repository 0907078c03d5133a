"""Uniform ``k``-subsets without replacement per row (Robert Floyd's algorithm): the neighbor samplers' draws.

Step ``t`` of Floyd's algorithm draws ``r`` uniform in ``[0, j_t]`` (``j_t = max(deg - k, 0) + t``) and takes
``j_t`` instead when ``r`` was taken by an earlier step. The draws do not depend on earlier choices (only the
collision rule does), so all ``k`` of them are made at once from one ``[n, k]`` tensor of uniforms; what is left
is resolving the collisions, step after step.

Two paths resolve them with the same arithmetic, so the same uniforms give the same subsets on both:

* a Triton kernel (CUDA, or the Triton interpreter on CPU tensors): one launch, each row's ``k`` steps in one
  thread, ``O(k^2)`` comparisons against the row's earlier choices;
* the PyTorch reference: ``k - 1`` steps of four kernels each over all rows.

A per-row fanout (``row_k``, at most ``k``) lets one call draw for rows of several edge types whose fanouts
differ: row ``i`` runs Floyd's algorithm for ``row_k[i]`` steps in its first ``row_k[i]`` columns.

The reference's ``4 (k - 1)`` launches per call are what made a sampled heterogeneous batch host-bound (eight
edge types, fanouts 25 and 20: over a thousand launches a batch); the kernel makes it one.
"""

from __future__ import annotations

import functools

import torch

from dsx.ops.triton_backend import resolve_backend
from dsx.ops.triton_source import load_source

__all__ = ["floyd", "floyd_ref"]

_BLOCK = 128

# A fixed kernel kept as text: Triton's interpreter needs a source file, written by ``load_source``. Only
# loads, stores, ``where`` and arithmetic: no standard-library ``@jit`` helpers (see dsx.ops.triton_source).
# ``K`` is a compile-time constant (one variant per fanout, and a model has a few): older interpreters cannot
# loop over a runtime scalar.
_SOURCE = """
import triton
import triton.language as tl


@triton.jit
def floyd_kernel(u_ptr, deg_ptr, k_ptr, out_ptr, n, K: tl.constexpr, ROW_K: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < n
    base = rows.to(tl.int64) * K
    deg = tl.load(deg_ptr + rows, mask=mask, other=0)
    if ROW_K:
        kr = tl.load(k_ptr + rows, mask=mask, other=0)
    else:
        kr = deg * 0 + K
    low = tl.where(deg > kr, deg - kr, 0)
    for t in range(0, K):
        j = low + t
        u = tl.load(u_ptr + base + t, mask=mask, other=0.0)
        r = (u * (j + 1).to(tl.float64)).to(tl.int64)
        r = tl.where(r < j, r, j)
        hit = r < 0
        # The row's earlier choices were stored by this thread (the loads and stores share one layout of
        # ``rows``), so program order makes them visible here.
        for s in range(0, t):
            c = tl.load(out_ptr + base + s, mask=mask, other=-1)
            hit = hit | (c == r)
        # (columns past a row's own fanout hold their index, as the reference leaves them)
        tl.store(out_ptr + base + t, tl.where(t < kr, tl.where(hit, j, r), t), mask=mask)
"""


@functools.cache
def _kernel(interpret: bool):
    return load_source("floyd", _SOURCE, interpret=interpret).floyd_kernel


def floyd_ref(u: torch.Tensor, deg: torch.Tensor, k: int, row_k: torch.Tensor | None = None) -> torch.Tensor:
    """The PyTorch reference: ``[n, k]`` choices from uniforms ``u`` (``[n, k]`` float64) and degrees ``deg``
    (``row_k``: each row's own fanout, at most ``k``)."""
    dev = deg.device
    cols = torch.arange(k, device=dev)
    jj = (deg - (k if row_k is None else row_k)).clamp(min=0).unsqueeze(1) + cols
    rr = torch.minimum((u * (jj + 1)).long(), jj)
    # Rows with deg <= k: low 0, j_t = t, and every r < t is taken already: the result is 0 .. k-1.
    chosen = rr.clone()  # column t is final once the collisions of columns < t are resolved
    for t in range(1, k):
        hit = (chosen[:, :t] == rr[:, t : t + 1]).any(1)
        chosen[:, t] = torch.where(hit, jj[:, t], rr[:, t])
    # a row's steps past its own fanout were never taken: those columns hold their index
    if row_k is not None:
        chosen = torch.where(cols < row_k.unsqueeze(1), chosen, cols)
    return chosen


def floyd(
    deg: torch.Tensor,
    k: int,
    generator: torch.Generator | None = None,
    *,
    row_k: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``[n, k]`` distinct positions in ``[0, deg)`` per row, a uniform ``k``-subset (rows with ``deg <= k``
    hold ``0 .. k-1``; callers use only the first ``deg`` of those). Draws on ``deg``'s device.

    ``row_k`` (``[n]``, each in ``[0, k]``): row ``i`` draws a ``row_k[i]``-subset into its first ``row_k[i]``
    columns (the others hold their column index), so rows of several fanouts take one call.

    ``backend``: ``None`` picks the Triton kernel on CUDA (and under ``TRITON_INTERPRET=1`` on CPU), else the
    PyTorch reference; ``"triton"``, ``"interpret"`` or ``"reference"`` force one (see
    :func:`dsx.ops.triton_backend.resolve_backend`). Every backend gives the same result for one generator state.
    """
    n, dev = deg.numel(), deg.device
    u = torch.rand(n, k, device=dev, generator=generator, dtype=torch.float64)
    deg = deg.long()
    if row_k is not None:
        row_k = row_k.long()
    which = resolve_backend(backend, dev)
    if which == "reference" or n == 0 or k <= 0:
        return floyd_ref(u, deg, k, row_k)
    out = torch.empty(n, k, dtype=torch.long, device=dev)
    k_rows = deg if row_k is None else row_k.contiguous()  # (not read without ROW_K)
    _kernel(which == "interpret")[(-(-n // _BLOCK),)](
        u, deg.contiguous(), k_rows, out, n, K=k, ROW_K=row_k is not None, BLOCK=_BLOCK
    )
    return out
