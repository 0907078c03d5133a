"""The IR programs of the three layers' message passing (docs/rgnn-semantics.md writes out their math).

Pre- and post-processing that is per node (RGCN's root weight and bias, RGAT's head concat/mean and bias,
HGT's per-type K/Q/V linears, gelu, output linear and skip) stays in the layer modules; the programs cover
what happens on edges.
"""

from __future__ import annotations

import functools

from dsx.rgnn.ir import Program

__all__ = ["hgt_program", "rgat_program", "rgcn_program"]


@functools.cache
def rgcn_program(in_dim: int, out_dim: int, mean: bool) -> Program:
    """``out_v = Σ_r Σ_{u ∈ N_r(v)} c_{v,r} x_u W_r`` with ``c = 1/|N_r(v)|`` (mean) or 1 (sum)."""
    p = Program(heads=1)
    h = p.typed_linear(p.node_input("x", in_dim), p.rel_weight("W", in_dim, out_dim), "src")
    p.output(p.aggregate(h, p.edge_scalar("inv_deg_rel") if mean else None))
    return p


@functools.cache
def rgat_program(in_dim: int, channels: int, heads: int, slope: float, per_relation_att: bool) -> Program:
    """``α = softmax_v(leaky_relu((x_v W_r) A^dst + (x_u W_r) A^src))``, ``out_v = Σ α (x_u W_r)``.

    PyG: ``A^src = k``, ``A^dst = q`` shared ``[H*C, H]``; hector: per relation (block-diagonal per head).
    """
    p = Program(heads=heads)
    x = p.node_input("x", in_dim)
    w = p.rel_weight("W", in_dim, heads * channels)
    att = p.rel_weight if per_relation_att else p.weight
    h = p.typed_linear(x, w, "src")
    s = p.linear(h, att("att_src", heads * channels, heads), score=True)
    d = p.linear(p.typed_linear(x, w, "dst"), att("att_dst", heads * channels, heads), score=True)
    p.output(p.aggregate(h, p.edge_softmax(p.leaky_relu(p.add(s, d), slope))))
    return p


@functools.cache
def hgt_program(width: int, heads: int) -> Program:
    """``α = softmax_v((k_u W^k_r) · q_v · μ_{r,h} / √D)``, ``out_v = Σ α (v_u W^v_r)`` (per head)."""
    p = Program(heads=heads)
    k, q, v = (p.node_input(n, width) for n in ("k", "q", "v"))
    kr = p.typed_linear(k, p.rel_weight("Wk", width, width), "src")
    vr = p.typed_linear(v, p.rel_weight("Wv", width, width), "src")
    logit = p.scale(p.dot(kr, p.gather(q, "dst")), p.rel_scalar("scale"))
    p.output(p.aggregate(vr, p.edge_softmax(logit)))
    return p
