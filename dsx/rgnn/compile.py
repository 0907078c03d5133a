"""``compile(program, **flags)``: run the passes and lower an IR program onto the generated kernels.

Lowering: ``typed_linear`` -> :func:`~dsx.rgnn.kernels.gather_gemm` (rows at the unique (node, relation)
pairs when marked compact, else one row per edge); ``fused_edge`` -> :func:`~dsx.rgnn.kernels.fused_edge`
(a ``gather`` of a destination node value becomes the kernel's per-node ``dst_term``: loaded once per
node). Ops that were not fused run as plain PyTorch on the materialised rows, so every flag combination
computes the same function as :func:`dsx.rgnn.interpreter.interpret` (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsx.rgnn import passes
from dsx.rgnn.edge_ops import edge_scalar, edge_softmax, per_relation_matmul
from dsx.rgnn.graph import RelGraph
from dsx.rgnn.ir import Program, Value
from dsx.rgnn.kernels import fused_edge, gather_gemm

__all__ = ["CompiledProgram", "compile"]


@dataclass
class _Rows:
    """An edge-indexed value stored compactly: edge ``e`` reads ``rows[edge_row[e]]``."""

    rows: torch.Tensor
    edge_row: torch.Tensor
    rel_ptr: torch.Tensor | None = None  # typed rows: relation r owns rows rel_ptr[r]:rel_ptr[r+1]
    node_dst: bool = False  # rows are the destination nodes themselves (edge_row = dst)

    def row_rel(self) -> torch.Tensor:
        """Relation of each row, for an unfused per-relation linear (built only then: fused programs never
        need it, and it costs a ``repeat_interleave`` launch)."""
        ptr = self.rel_ptr
        r = torch.arange(ptr.numel() - 1, device=ptr.device)
        return torch.repeat_interleave(r, ptr.diff(), output_size=self.rows.shape[0])


def _edge(v, g: RelGraph) -> torch.Tensor:
    if not isinstance(v, _Rows):
        return v
    return v.rows[g.dst if v.node_dst else v.edge_row]


class CompiledProgram:
    """Callable ``(graph, inputs, params) -> [N_dst, H, D]``; ``program`` is the program after the passes."""

    def __init__(self, program: Program, precision: str, kernel_backend: str | None):
        self.program, self.precision, self.kernel_backend = program, precision, kernel_backend

    def __call__(self, graph: RelGraph, inputs: dict, params: dict) -> torch.Tensor:
        g, memo = graph, {}
        gemm = {"precision": self.precision, "backend": self.kernel_backend}

        def ev(v: Value):
            if id(v) in memo:
                return memo[id(v)]
            a = [ev(i) for i in v.inputs]
            op = v.op
            if op in ("input", "param"):
                out = (inputs if op == "input" else params)[v.attrs["name"]]
            elif op == "graph":
                out = edge_scalar(g, v.attrs["name"], next(iter(inputs.values())).dtype)
            elif op == "compose":
                out = a[0] @ a[1]
            elif op == "typed_linear":
                x, w = a
                if v.attrs.get("compact"):
                    idx, ptr, erow = (g.src_row_idx, g.src_rel_ptr, g.edge_src_row) if v.kind == "src" else (
                        g.dst_row_idx, g.dst_rel_ptr, g.edge_dst_row)  # fmt: skip
                else:
                    idx, ptr, erow = (
                        (g.src if v.kind == "src" else g.dst)[g.rel_perm],
                        g.rel_ptr,
                        g.edge_rel_row,
                    )
                rows = gather_gemm(x, w, idx, ptr, **gemm).view(-1, *v.shape)
                out = _Rows(rows, erow, ptr)
            elif op == "gather":
                if v.kind == "dst":  # the fused kernel reads a per-node dst term by node: no edge map needed
                    out = _Rows(a[0].view(-1, *v.shape), None, None, node_dst=True)
                else:
                    out = _Rows(a[0].view(-1, *v.shape), g.src)
            elif op == "linear":
                src, w = a
                if isinstance(src, _Rows) and (w.dim() == 2 or src.rel_ptr is not None):
                    flat = src.rows.flatten(1)
                    res = flat @ w if w.dim() == 2 else per_relation_matmul(flat, w, src.row_rel())
                    out = _Rows(res.view(-1, *v.shape), src.edge_row, src.rel_ptr, src.node_dst)
                else:
                    flat = _edge(src, g).flatten(1)
                    out = (flat @ w if w.dim() == 2 else per_relation_matmul(flat, w, g.rel)).view(
                        -1, *v.shape
                    )
            elif op == "dot":
                out = (_edge(a[0], g) * _edge(a[1], g)).sum(-1)
            elif op == "add":
                out = _edge(a[0], g) + _edge(a[1], g)
            elif op == "leaky_relu":
                out = F.leaky_relu(_edge(a[0], g), v.attrs["slope"])
            elif op == "scale":
                x = _edge(a[0], g)
                s = a[1][g.rel] if v.inputs[1].kind == "rel_scalar" else a[1].view(-1, *([1] * (x.dim() - 1)))
                out = x * s
            elif op == "edge_softmax":
                out = edge_softmax(_edge(a[0], g), g.dst, g.num_dst)
            elif op == "aggregate":
                msg = _edge(a[0], g)
                if len(a) > 1:
                    w = _edge(a[1], g)
                    msg = msg * (w.unsqueeze(-1) if w.dim() == 2 else w.view(-1, 1, 1))
                out = msg.new_zeros((g.num_dst, *msg.shape[1:])).index_add(0, g.dst, msg)
            elif op == "fused_edge":
                out = self._fused(v, dict(zip(v.attrs["roles"], a)), g)
            else:
                raise ValueError(f"compile: unknown op {op!r}")
            memo[id(v)] = out
            return out

        try:
            return ev(self.program.out)
        finally:
            # ev is a recursive closure (a reference cycle through its own cell): without this the memo and
            # every intermediate tensor in it (edge-wise rows, messages) would live until Python's cyclic GC.
            memo.clear()

    def _fused(self, v: Value, r: dict, g: RelGraph) -> torch.Tensor:
        msg = r["msg"]
        kw = {}
        if "src_term" in r:
            s, d = r["src_term"], r["dst_term"]
            kw.update(src_term=s.rows, edge_src_row=s.edge_row, dst_term=d.rows)
            if not d.node_dst:
                kw["edge_dst_row"] = d.edge_row
        if "rel_scale" in r:
            kw.update(edge_rel=g.rel, rel_scale=r["rel_scale"])
        if "edge_weight" in r:
            kw["edge_weight"] = r["edge_weight"]
        return fused_edge(
            v.attrs["spec"], g.dst_ptr, msg.rows, msg.edge_row, backend=self.kernel_backend, **kw
        )


def compile(
    program: Program,
    *,
    compact_materialization: bool = True,
    linear_reorder: bool = True,
    fusion: bool = True,
    precision: str = "fp32",
    kernel_backend: str | None = None,
) -> CompiledProgram:
    """Apply the enabled passes (reordering, then compaction, then fusion) and return a callable.

    ``precision`` ("fp32" | "tf32" | "bf16") is the gather-GEMM input precision; ``kernel_backend``
    ("triton" | "interpret" | "reference" | None = by device) selects how the kernels run.
    """
    if program.out is None:
        raise ValueError("program has no output; call Program.output(aggregate)")
    if linear_reorder:
        program = passes.linear_reorder(program)
    if compact_materialization:
        program = passes.compact_materialization(program)
    if fusion:
        program = passes.fuse(program)
    return CompiledProgram(program, precision, kernel_backend)
