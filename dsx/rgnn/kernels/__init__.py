"""Fused relational-GNN kernels: a gather-GEMM for typed linear layers and a CSR edge kernel.

This package is the kernel layer under ``dsx.rgnn`` (the IR, passes and layers call it). Every entry
point has three backends chosen per call:

* ``"triton"``     compiled Triton kernels on CUDA tensors (the fast path);
* ``"interpret"``  the *same generated kernels* run by Triton's interpreter on CPU tensors (CI);
* ``"reference"``  the pure-PyTorch twins in :mod:`dsx.rgnn.kernels.reference` (ground truth, CPU fallback).

``backend=None`` (default) picks ``"triton"`` when the tensors are on CUDA and Triton imports,
``"interpret"`` when ``TRITON_INTERPRET=1`` is set in the environment, else ``"reference"``.
The kernels are not hand-written per model: :mod:`dsx.rgnn.codegen` emits their Triton source from an
:class:`EdgeSpec` (or a GEMM precision), writes it to ``~/.cache/dsx/kernels/<hash>.py`` (``DSX_KERNEL_CACHE``
overrides the directory) and imports it; the module is cached per (spec, backend) in memory.

Interface
---------
``gather_gemm(x, weight, row_idx, rel_ptr, *, precision="fp32", max_rows_per_rel=None, backend=None,
check_indices=False)``
    ``x [N, K]``, ``weight [R, K, Nout]``, ``row_idx int64 [M]``, ``rel_ptr int64 [R+1]`` (same device).
    ``out[i] = x[row_idx[i]] @ weight[r]`` for ``rel_ptr[r] <= i < rel_ptr[r+1]``; returns ``[M, Nout]`` in
    ``x.dtype``. Empty relations are allowed. One launch for all relations: a grid of
    ``cdiv(M, BLOCK_M) + R`` tiles, each owned by one relation through a tile->relation map built on the
    device with ``torch.searchsorted`` (no host synchronisation). ``precision``: ``"fp32"`` exact
    (``input_precision="ieee"``), ``"tf32"`` (tensor cores, ~1e-3 relative error), ``"bf16"`` (inputs rounded
    to bfloat16, fp32 accumulation, ~1e-2). Differentiable w.r.t. ``x`` (scatter-add into ``x`` rows through
    ``tl.atomic_add``: fp32 sums in a non-deterministic order) and ``weight`` (per-relation ``x_r^T g_r``,
    split over row tiles and summed with atomics). ``max_rows_per_rel`` is accepted for API stability and
    unused (the grid never needs it). All offsets are int64.

``EdgeSpec(score, leaky_relu_slope, rel_scale, edge_weight, softmax)`` (frozen dataclass)
    ``score`` in ``{"none", "add", "dot"}``; ``leaky_relu_slope: float | None``; ``rel_scale``,
    ``edge_weight``, ``softmax``: bool. It is the key of the generated kernel.

``fused_edge(spec, dst_ptr, msg, edge_msg_row, *, edge_src_row=None, edge_dst_row=None, src_term=None,
dst_term=None, edge_rel=None, rel_scale=None, edge_weight=None, backend=None, block_e=None,
check_indices=False) -> out [N_dst, H, D]``
    Edges sorted by destination, ``dst_ptr int64 [N_dst+1]`` (CSR by destination); ``msg [M, H, D]``, edge
    ``e`` carries ``msg[edge_msg_row[e]]`` (compact materialization: ``M`` = unique (src, relation) pairs).

    * logit: ``"add"``: ``src_term[edge_src_row[e], h] + dst_term[edge_dst_row[e], h]`` (``[Ms, H]``,
      ``[Md, H]``; RGAT); ``"dot"``: ``sum_d src_term[edge_src_row[e], h, d] * dst_term[edge_dst_row[e], h, d]``
      (``[Ms, H, D']``, ``[Md, H, D']``; HGT). ``edge_dst_row=None`` means ``dst_term`` is indexed by the
      destination node itself (``[N_dst, H]`` / ``[N_dst, H, D']``): that variant loads it once per node and
      sums its gradient in registers (no atomics, deterministic). Then ``leaky_relu(slope)`` if a slope is
      given; then ``*= rel_scale[edge_rel[e], h]`` if ``spec.rel_scale`` (HGT's mu_r / sqrt(d)).
    * ``softmax=True``: ``alpha[e, h]`` = softmax of the logits over the incoming edges of each destination,
      computed online and max-stabilised in one pass; only the per-(node, head) log-sum-exp is kept for
      backward, which recomputes alpha (no ``E x H`` tensor is saved).
      ``softmax=False``: ``alpha = logit`` when ``score != "none"`` (unnormalised attention), else 1.
    * ``edge_weight=True``: ``alpha *= edge_weight[e]`` (e.g. RGCN's 1/deg_r), after the softmax.
    * ``out[v, h, :] = sum_{e into v} alpha[e, h] * msg[edge_msg_row[e], h, :]``; a node without incoming
      edges gets 0.

    Differentiable w.r.t. ``msg``, ``src_term``, ``dst_term``, ``rel_scale`` and ``edge_weight``. Gradient
    scatters into rows shared by several edges (``msg``, ``src_term``, ``dst_term``, ``rel_scale``,
    ``edge_weight`` across heads) use ``tl.atomic_add``: fp32 results are correct to rounding but their
    summation order is not deterministic. Only the gradients autograd asks for are computed (constexpr
    flags compile the others out). Index tensors are int64 and all address arithmetic is int64.

``generate_edge_kernel_source(spec, *, dst_term_per_node=False) -> str`` (re-exported from
:mod:`dsx.rgnn.codegen`) shows the emitted code; ``generate_gather_gemm_source(precision)`` likewise.

Both take ``check_indices=True`` to validate CSR pointers and index ranges first (host-synchronising,
off by default: the kernels never check indices). ``fused_edge`` also takes ``block_e=`` (edge-chunk
length; default: the mean in-degree rounded up to a power of two, capped at ~4K values per chunk).

Performance facts: the edge kernel runs one program per destination covering all heads
(``[BLOCK_E, BLOCK_H, BLOCK_D]`` tiles, padded to powers of two and masked), loops over incoming edges in
chunks of ``BLOCK_E``; it reads each edge's message row (``H * D`` contiguous values) once per forward
(bytes ~ ``E * H * D * elem + indices``) and writes ``N_dst * H * (D + 1)`` values. See docs/rgnn-kernels.md.
"""

from __future__ import annotations

from dsx.ops.triton_backend import resolve_backend
from dsx.rgnn.codegen import generate_edge_kernel_source, generate_gather_gemm_source
from dsx.rgnn.codegen.spec import EdgeSpec
from dsx.rgnn.kernels.edge import fused_edge
from dsx.rgnn.kernels.gather_gemm import gather_gemm
from dsx.rgnn.kernels.reference import fused_edge_ref, gather_gemm_ref

__all__ = [
    "EdgeSpec",
    "fused_edge",
    "fused_edge_ref",
    "gather_gemm",
    "gather_gemm_ref",
    "generate_edge_kernel_source",
    "generate_gather_gemm_source",
    "resolve_backend",
]
