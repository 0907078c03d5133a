"""Run a layer's IR program on the path its options pick: the per-edge interpreter, or the program compiled
with the layer's pass flags.

This sits above both executors (it imports :mod:`dsx.rgnn.compile` and :mod:`dsx.rgnn.interpreter`, which
import neither it nor each other), and under the layers.
"""

from __future__ import annotations

import functools

import torch

from dsx.rgnn.compile import CompiledProgram, compile
from dsx.rgnn.graph import RelGraph
from dsx.rgnn.interpreter import interpret
from dsx.rgnn.ir import Program
from dsx.rgnn.options import Options

__all__ = ["run_program"]


@functools.cache
def _compiled(program: Program, compact: bool, reorder: bool, fusion: bool, precision: str,
              kernel_backend: str | None) -> CompiledProgram:  # fmt: skip
    # The layers' programs are cached per shape, so compiling once per (program, flags) keeps the passes
    # off every forward.
    return compile(program, compact_materialization=compact, linear_reorder=reorder, fusion=fusion,
                   precision=precision, kernel_backend=kernel_backend)  # fmt: skip


def run_program(
    options: Options, program: Program, graph: RelGraph, inputs: dict, params: dict
) -> torch.Tensor:
    """``program`` on ``graph`` as ``options`` say: :func:`~dsx.rgnn.interpreter.interpret`, or compiled."""
    if options.interpreter:
        return interpret(program, graph, inputs, params)
    fn = _compiled(program, options.compact_materialization, options.linear_reorder, options.fusion,
                   options.precision, options.kernel_backend)  # fmt: skip
    return fn(graph, inputs, params)
