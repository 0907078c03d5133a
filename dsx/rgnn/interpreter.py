"""The executable spec of the IR: every edge-indexed value materialised per edge, plain PyTorch autograd.

Simple rather than fast (``E x H x D`` tensors, a loop over relations for typed projections); it is the
ground truth that compiled programs and the layers' kernel paths are tested against, and it is
differentiable in float64 (gradcheck).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsx.rgnn.edge_ops import edge_scalar, edge_softmax, per_relation_matmul
from dsx.rgnn.graph import RelGraph
from dsx.rgnn.ir import Program, Value

__all__ = ["interpret"]


def interpret(program: Program, graph: RelGraph, inputs: dict, params: dict) -> torch.Tensor:
    """Run ``program`` on ``graph``: ``inputs`` node tensors ``[N, K]``, ``params`` by name. Returns
    ``[N_dst, H, D]``. Weights: ``weight [K, M]``, ``rel_weight [R, K, M]``, ``rel_scalar [R, H]``."""
    g, memo = graph, {}

    def ev(v: Value) -> torch.Tensor:
        if id(v) in memo:
            return memo[id(v)]
        a = [ev(i) for i in v.inputs]
        op = v.op
        if op == "input":
            out = inputs[v.attrs["name"]]
        elif op == "param":
            out = params[v.attrs["name"]]
        elif op == "graph":
            out = edge_scalar(g, v.attrs["name"], next(iter(inputs.values())).dtype)
        elif op == "compose":  # introduced by linear reordering: W_r @ A
            out = a[0] @ a[1]
        elif op == "typed_linear":
            node = g.src if v.kind == "src" else g.dst
            out = per_relation_matmul(a[0][node], a[1], g.rel).view(-1, *v.shape)
        elif op == "gather":
            node = g.src if v.kind == "src" else g.dst
            out = a[0][node].view(-1, *v.shape)
        elif op == "linear":
            flat = a[0].flatten(1)
            w = a[1]
            res = flat @ w if w.dim() == 2 else per_relation_matmul(flat, w, g.rel)
            out = res.view(-1, *v.shape)
        elif op == "dot":
            out = (a[0] * a[1]).sum(-1)
        elif op == "add":
            out = a[0] + a[1]
        elif op == "leaky_relu":
            out = F.leaky_relu(a[0], v.attrs["slope"])
        elif op == "scale":
            s = a[1][g.rel] if v.inputs[1].kind == "rel_scalar" else a[1].view(-1, *([1] * (a[0].dim() - 1)))
            out = a[0] * s
        elif op == "edge_softmax":
            out = edge_softmax(a[0], g.dst, g.num_dst)
        elif op == "aggregate":
            msg = a[0]
            if len(a) > 1:
                w = a[1]
                msg = msg * (w.unsqueeze(-1) if w.dim() == 2 else w.view(-1, 1, 1))
            out = msg.new_zeros((g.num_dst, *msg.shape[1:])).index_add(0, g.dst, msg)
        else:
            raise ValueError(f"interpreter: unknown op {op!r}")
        memo[id(v)] = out
        return out

    if program.out is None:
        raise ValueError("program has no output; call Program.output(aggregate)")
    try:
        return ev(program.out)
    finally:
        # ev is a recursive closure (a reference cycle through its own cell): without this the memo and
        # every intermediate tensor in it (edge-wise rows, messages) would live until Python's cyclic GC.
        memo.clear()
