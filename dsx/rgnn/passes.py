"""IR passes: linear reordering, compact materialization, fusion into the two kernel templates.

Each pass takes a :class:`~dsx.rgnn.ir.Program` and returns a new one (the input is not modified); each is
switched by a flag of :func:`dsx.rgnn.compile`.

* :func:`linear_reorder`: ``linear(typed_linear(x, W, side), A)`` -> ``typed_linear(x, compose(W, A), side)``,
  i.e. ``(x W_r) A = x (W_r A)``: an attention term costs a ``K x H`` GEMM per unique pair instead of reading
  the ``H*C``-wide projection (Hector's linear operator reordering).
* :func:`compact_materialization`: marks typed projections to be computed once per unique (node, relation)
  pair; unmarked ones are computed once per edge (the naive materialization, kept for the ablation).
* :func:`fuse`: ``aggregate(msg, [edge_weight *] [softmax]([rel_scale *] [leaky_relu](add|dot(src, dst))))``
  -> one ``fused_edge`` op carrying an :class:`~dsx.rgnn.kernels.EdgeSpec`; anything else stays unfused.
"""

from __future__ import annotations

from dsx.rgnn.ir import Program, Value
from dsx.rgnn.kernels import EdgeSpec

__all__ = ["compact_materialization", "fuse", "linear_reorder", "rewrite", "topological"]


def rewrite(program: Program, fn) -> Program:
    """Rebuild ``program`` bottom-up; ``fn(value, new_inputs)`` returns the replacement Value (or None to keep
    the op with the rewritten inputs)."""
    memo: dict[int, Value] = {}
    new = Program(program.heads)

    def go(v: Value) -> Value:
        if id(v) in memo:
            return memo[id(v)]
        ins = tuple(go(i) for i in v.inputs)
        out = fn(v, ins)
        if out is None:
            out = Value(v.op, ins, v.kind, v.shape, dict(v.attrs))
        memo[id(v)] = out
        return out

    new.out = go(program.out)
    new.values = topological(new.out)
    return new


def topological(out: Value) -> list[Value]:
    """Every value ``out`` depends on (including values a pass created), inputs before users."""
    seen, order = set(), []

    def visit(v: Value) -> None:
        if id(v) in seen:
            return
        seen.add(id(v))
        for i in v.inputs:
            visit(i)
        order.append(v)

    visit(out)
    return order


def linear_reorder(program: Program) -> Program:
    def fn(v: Value, ins):
        if v.op == "linear" and ins[0].op == "typed_linear":
            x, w = ins[0].inputs
            composed = Value("compose", (w, ins[1]), "rel_weight", (w.shape[0], ins[1].shape[1]))
            return Value("typed_linear", (x, composed), ins[0].kind, v.shape, dict(ins[0].attrs))
        return None

    return rewrite(program, fn)


def compact_materialization(program: Program) -> Program:
    def fn(v: Value, ins):
        if v.op == "typed_linear":
            return Value(v.op, ins, v.kind, v.shape, {**v.attrs, "compact": True})
        return None

    return rewrite(program, fn)


def _match(weight: Value | None):
    """Peel the attention chain off an aggregate's weight: (spec kwargs, roles) or None if it does not fit."""
    spec, roles = {}, {}
    w = weight
    if w is not None and w.kind == "edge_scalar":
        roles["edge_weight"], w = w, None
        spec["edge_weight"] = True
    elif w is not None and w.op == "scale" and w.inputs[1].kind == "edge_scalar":
        roles["edge_weight"], w = w.inputs[1], w.inputs[0]
        spec["edge_weight"] = True
    if w is not None and w.op == "edge_softmax":
        spec["softmax"], w = True, w.inputs[0]
    if w is not None and w.op == "scale" and w.inputs[1].kind == "rel_scalar":
        roles["rel_scale"], w = w.inputs[1], w.inputs[0]
        spec["rel_scale"] = True
    if w is not None and w.op == "leaky_relu":
        spec["leaky_relu_slope"], w = w.attrs["slope"], w.inputs[0]
    if w is not None and w.op in ("add", "dot"):
        a, b = w.inputs
        if a.kind == "dst" and b.kind == "src":  # both scores are symmetric
            a, b = b, a
        if a.kind != "src" or b.kind != "dst":
            return None
        spec["score"], roles["src_term"], roles["dst_term"], w = w.op, a, b, None
    if w is not None:
        return None
    if spec.get("score") is None and (
        spec.get("softmax") or spec.get("rel_scale") or "leaky_relu_slope" in spec
    ):
        return None
    return spec, roles


def fuse(program: Program) -> Program:
    def fn(v: Value, ins):
        if v.op != "aggregate" or ins[0].kind != "src":
            return None
        found = _match(ins[1] if len(ins) > 1 else None)
        if found is None:
            return None
        spec, roles = found
        roles["msg"] = ins[0]
        names = sorted(roles)
        return Value("fused_edge", tuple(roles[n] for n in names), "out", v.shape,
                     {"spec": EdgeSpec(**spec), "roles": names})  # fmt: skip

    return rewrite(program, fn)
