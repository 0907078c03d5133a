"""Code generation for the relational-GNN kernels: Triton source emitted from a spec, cached and imported.

``generate_edge_kernel_source(spec)`` returns the fused CSR edge kernels (forward and backward) for an
:class:`EdgeSpec` (the key of a generated kernel; :mod:`dsx.rgnn.kernels` re-exports it);
``generate_gather_gemm_source(precision)`` the typed-linear kernels; ``load_source`` writes a source to the
kernel cache and imports it (compiled or interpreted). Nothing here launches a kernel: :mod:`dsx.rgnn.kernels`
sits above and does.
"""

from __future__ import annotations

from dsx.ops.triton_source import cache_dir, load_source
from dsx.rgnn.codegen.edge import generate_edge_kernel_source
from dsx.rgnn.codegen.gemm import PRECISIONS, generate_gather_gemm_source
from dsx.rgnn.codegen.spec import EdgeSpec

__all__ = [
    "PRECISIONS",
    "EdgeSpec",
    "cache_dir",
    "generate_edge_kernel_source",
    "generate_gather_gemm_source",
    "load_source",
]
