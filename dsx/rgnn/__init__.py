"""Relational GNN layers generated from a small IR onto fused Triton kernels (Hector in dsx).

* Layers: :class:`RGCNConv`, :class:`RGATConv`, :class:`HGTConv` — drop-in for ``torch_geometric.nn``'s
  (constructor arguments, parameter names, forward signature, outputs), plus ``semantics="hector"``.
  An option left as ``None`` follows ``dsx.defaults.get("rgnn")`` when the layer runs (see
  :mod:`dsx.rgnn.options`): the engine's ``"rgnn"`` section inside :func:`dsx.initialize`, else
  ``dsx.defaults.set("rgnn", ...)``.
* On ``HeteroData`` batches: :class:`RelationalHetero` runs RGCN / RGAT on ``(x_dict, edge_index_dict)``
  over :func:`typed_layout` (one node id space, relation = edge type); ``HGTConv`` takes the dicts itself.
* Graph preparation: :func:`prepare` -> :class:`RelGraph` (destination CSR, unique (node, relation) pairs),
  cached per graph; forward and backward never synchronise with the host.
* IR: :mod:`dsx.rgnn.ir` (builder), :mod:`dsx.rgnn.interpreter` (per-edge PyTorch spec),
  :mod:`dsx.rgnn.passes` and :func:`compile` (lowering onto :mod:`dsx.rgnn.kernels`).
* DeepSpeed glue: :mod:`dsx.rgnn.deepspeed`.
"""

from __future__ import annotations

from dsx.rgnn import passes
from dsx.rgnn.compile import CompiledProgram, compile
from dsx.rgnn.graph import RelGraph, prepare
from dsx.rgnn.hetero import (
    PrepareGraph,
    RelationalHetero,
    TypedLayout,
    clear_cache,
    typed_graph,
    typed_layout,
)
from dsx.rgnn.hgt import HGTConv
from dsx.rgnn.interpreter import interpret
from dsx.rgnn.ir import Program, Value
from dsx.rgnn.layers import RGATConv, RGCNConv

__all__ = [
    "CompiledProgram", "HGTConv", "PrepareGraph", "Program", "RGATConv", "RGCNConv", "RelGraph", "RelationalHetero",
    "TypedLayout", "Value", "clear_cache", "compile", "interpret", "passes", "prepare", "typed_graph",
    "typed_layout",
]  # fmt: skip
