"""Relational GNN layers generated from a small IR onto fused Triton kernels (Hector in dsx).

* Layers: :class:`RGCNConv`, :class:`RGATConv`, :class:`HGTConv` — drop-in for ``torch_geometric.nn``'s
  (constructor arguments, parameter names, forward signature, outputs), plus ``semantics="hector"``.
* Graph preparation: :func:`prepare` -> :class:`RelGraph` (destination CSR, unique (node, relation) pairs),
  cached per graph; forward and backward never synchronise with the host.
* IR: :mod:`dsx.rgnn.ir` (builder), :mod:`dsx.rgnn.interpreter` (per-edge PyTorch spec),
  :mod:`dsx.rgnn.passes` and :func:`compile` (lowering onto :mod:`dsx.rgnn.kernels`).
* ``attach(engine, section, runtime)``: the "rgnn" section of the dsx config sets the layers' defaults.
"""

from __future__ import annotations

from typing import Any

from dsx.rgnn import passes
from dsx.rgnn._common import DEFAULTS
from dsx.rgnn.compile import CompiledProgram, compile
from dsx.rgnn.graph import RelGraph, clear_cache, prepare
from dsx.rgnn.hgt import HGTConv
from dsx.rgnn.interpreter import interpret
from dsx.rgnn.ir import Program, Value
from dsx.rgnn.layers import RGATConv, RGCNConv

__all__ = [
    "DEFAULTS", "CompiledProgram", "HGTConv", "Program", "RGATConv", "RGCNConv", "RelGraph", "Value", "attach",
    "clear_cache", "compile", "interpret", "passes", "prepare",
]  # fmt: skip

# Config spelling -> layer option values ("triton" in the config means: run the generated kernels).
_BACKEND = {"auto": "auto", "triton": "kernels", "interpreter": "interpreter"}


class _Handle:
    """Restores the previous layer defaults on ``close()``."""

    def __init__(self, previous: dict[str, object]):
        self.previous = previous

    def close(self) -> None:
        DEFAULTS.update(self.previous)


def attach(engine: Any, section: Any, runtime: Any) -> _Handle:
    """Apply the "rgnn" config section: every dsx relational layer whose option is left as ``None`` then
    uses the section's ``precision``, ``backend``, ``compact_materialization``, ``linear_reorder``, ``fusion``.

    ``fusion=False`` leaves the edge ops unfused (gather-GEMMs plus PyTorch edge ops). Returns a handle whose
    ``close()`` restores the previous defaults.
    """
    previous = dict(DEFAULTS)
    DEFAULTS.update(
        precision=section.precision,
        backend=_BACKEND[section.backend],
        fusion=section.fusion,
        compact_materialization=section.compact_materialization,
        linear_reorder=section.linear_reorder,
    )
    return _Handle(previous)
