"""Shared pieces of the relational layers: run-time defaults, backend choice, lowering helpers."""

from __future__ import annotations

import torch

from dsx.rgnn.graph import RelGraph
from dsx.rgnn.kernels import gather_gemm

__all__ = ["DEFAULTS", "LayerOptions", "edge_softmax", "typed_linear"]

# Process-wide defaults for every layer option left as None; ``dsx.rgnn.attach`` writes the "rgnn" config
# section here (precision, backend, pass flags).
DEFAULTS: dict[str, object] = {
    "precision": "fp32",
    "backend": "auto",
    "kernel_backend": None,
    "compact_materialization": True,
    "linear_reorder": True,
}

_LAYER_BACKENDS = ("auto", "kernels", "interpreter")


class LayerOptions:
    """Mixin: the options every dsx relational layer takes (None = use :data:`DEFAULTS` at call time)."""

    def _init_options(self, backend, precision, kernel_backend, compact_materialization, linear_reorder):
        if backend is not None and backend not in _LAYER_BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {_LAYER_BACKENDS}")
        self.backend = backend
        self.precision = precision
        self.kernel_backend = kernel_backend
        self.compact_materialization = compact_materialization
        self.linear_reorder = linear_reorder

    def _opt(self, name: str):
        value = getattr(self, name)
        return DEFAULTS[name] if value is None else value

    def _use_interpreter(self) -> bool:
        backend = self._opt("backend")
        # The config section spells the Triton choice "triton"; for a layer it means the kernels path.
        return backend == "interpreter"


def typed_linear(layer: LayerOptions, x: torch.Tensor, weight: torch.Tensor, graph: RelGraph, side: str):
    """``x W_r`` for each unique (node, relation) pair of ``side`` ("src"/"dst"), or per edge when compact
    materialization is off. Returns ``(rows [M, out], edge_row [E])``: edge ``e`` reads ``rows[edge_row[e]]``.
    """
    kw = {"precision": layer._opt("precision"), "backend": layer._opt("kernel_backend")}
    if layer._opt("compact_materialization"):
        if side == "src":
            return gather_gemm(x, weight, graph.src_row_idx, graph.src_rel_ptr, **kw), graph.edge_src_row
        return gather_gemm(x, weight, graph.dst_row_idx, graph.dst_rel_ptr, **kw), graph.edge_dst_row
    node = graph.src if side == "src" else graph.dst
    return gather_gemm(x, weight, node[graph.rel_perm], graph.rel_ptr, **kw), graph.edge_rel_row


def edge_softmax(logit: torch.Tensor, dst: torch.Tensor, num_dst: int) -> torch.Tensor:
    """Max-stabilised softmax of ``logit [E, H]`` over the edges sharing a destination (plain PyTorch)."""
    heads = logit.shape[1]
    index = dst.view(-1, 1).expand(-1, heads)
    mx = torch.full((num_dst, heads), float("-inf"), dtype=logit.dtype, device=logit.device)
    mx = mx.scatter_reduce(0, index, logit.detach(), "amax", include_self=True)
    ex = torch.exp(logit - mx[dst])
    den = torch.zeros((num_dst, heads), dtype=logit.dtype, device=logit.device).index_add_(0, dst, ex)
    return ex / den[dst]
