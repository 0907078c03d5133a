"""Code generation for the relational-GNN kernels: Triton source emitted from a spec, cached and imported.

``generate_edge_kernel_source(spec)`` returns the fused CSR edge kernels (forward and backward) for an
:class:`dsx.rgnn.kernels.EdgeSpec`; ``generate_gather_gemm_source(precision)`` the typed-linear kernels;
``load_source`` writes a source to the kernel cache and imports it (compiled or interpreted).
"""

from __future__ import annotations

from dsx.rgnn.codegen.edge import generate_edge_kernel_source
from dsx.rgnn.codegen.gemm import PRECISIONS, generate_gather_gemm_source
from dsx.rgnn.codegen.loader import cache_dir, load_source

__all__ = [
    "PRECISIONS",
    "cache_dir",
    "generate_edge_kernel_source",
    "generate_gather_gemm_source",
    "load_source",
]
