"""Shared pieces of the relational layers: run-time defaults, backend choice, lowering helpers."""

from __future__ import annotations

import functools

import torch

from dsx.rgnn.graph import RelGraph

__all__ = ["DEFAULTS", "LayerOptions", "edge_softmax", "run_program"]

# Graph fields the unfused paths read (interpreter, fusion or compaction off), on top of a layer's own.
_UNFUSED_FIELDS = ("src", "dst", "rel")
_PER_EDGE_FIELDS = ("rel_perm", "rel_ptr", "edge_rel_row")

# Process-wide defaults for every layer option left as None; ``dsx.rgnn.attach`` writes the "rgnn" config
# section here (precision, backend, pass flags).
DEFAULTS: dict[str, object] = {
    "precision": "fp32",
    "backend": "auto",
    "kernel_backend": None,
    "compact_materialization": True,
    "linear_reorder": True,
    "fusion": True,
}

_LAYER_BACKENDS = ("auto", "kernels", "interpreter")


class LayerOptions:
    """Mixin: the options every dsx relational layer takes (None = use :data:`DEFAULTS` at call time)."""

    def _init_options(self, backend, precision, kernel_backend, compact_materialization, linear_reorder,
                      fusion=None):  # fmt: skip
        if backend is not None and backend not in _LAYER_BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {_LAYER_BACKENDS}")
        self.backend = backend
        self.precision = precision
        self.kernel_backend = kernel_backend
        self.compact_materialization = compact_materialization
        self.linear_reorder = linear_reorder
        self.fusion = fusion

    def _opt(self, name: str):
        value = getattr(self, name)
        return DEFAULTS[name] if value is None else value

    def _graph_needs(self, *fused: str) -> tuple[str, ...]:
        """The :class:`RelGraph` fields this layer's path reads (``fused``: those of the fused kernels)."""
        if self._use_interpreter():
            return (*fused, *_UNFUSED_FIELDS)
        needs = fused if self._opt("fusion") else (*fused, *_UNFUSED_FIELDS)
        return (
            needs if self._opt("compact_materialization") else (*needs, *_UNFUSED_FIELDS, *_PER_EDGE_FIELDS)
        )

    def _use_interpreter(self) -> bool:
        backend = self._opt("backend")
        # The config section spells the Triton choice "triton"; for a layer it means the kernels path.
        return backend == "interpreter"


def edge_softmax(logit: torch.Tensor, dst: torch.Tensor, num_dst: int) -> torch.Tensor:
    """Max-stabilised softmax of ``logit [E, H]`` over the edges sharing a destination (plain PyTorch)."""
    heads = logit.shape[1]
    index = dst.view(-1, 1).expand(-1, heads)
    mx = torch.full((num_dst, heads), float("-inf"), dtype=logit.dtype, device=logit.device)
    mx = mx.scatter_reduce(0, index, logit.detach(), "amax", include_self=True)
    ex = torch.exp(logit - mx[dst])
    den = torch.zeros((num_dst, heads), dtype=logit.dtype, device=logit.device).index_add_(0, dst, ex)
    return ex / den[dst]


@functools.cache
def _compiled(program, compact: bool, reorder: bool, fusion: bool, precision: str, kernel_backend):
    from dsx.rgnn.compile import compile as compile_program

    return compile_program(program, compact_materialization=compact, linear_reorder=reorder, fusion=fusion,
                           precision=precision, kernel_backend=kernel_backend)  # fmt: skip


def run_program(layer: LayerOptions, program, graph: RelGraph, inputs: dict, params: dict) -> torch.Tensor:
    """Run a layer's IR program: the per-edge interpreter, or compiled with the layer's pass flags."""
    if layer._use_interpreter():
        from dsx.rgnn.interpreter import interpret

        return interpret(program, graph, inputs, params)
    o = layer._opt
    fn = _compiled(program, bool(o("compact_materialization")), bool(o("linear_reorder")), bool(o("fusion")),
                   o("precision"), o("kernel_backend"))  # fmt: skip
    return fn(graph, inputs, params)
