"""A small IR for relational message passing: values with operand kinds, a builder, a printer.

Every value has a *kind* saying what it is indexed by, and a per-element shape ``(H, D)`` (heads, channels)
or ``(H,)`` (one scalar per head, e.g. an attention logit):

========== ===============================================================================
kind       indexed by
========== ===============================================================================
node       a node (inputs, per-node projections)             ``[N, ...]``
src / dst  an edge's (source, relation) / (destination, relation) pair, or its source / destination node
edge       an edge                                             ``[E, ...]``
out        a destination node (the aggregate)                  ``[N_dst, H, D]``
weight     a shared matrix ``[K, M]``;  rel_weight: one per relation ``[R, K, M]``
rel_scalar ``[R, H]`` per relation and head; edge_scalar: a per-edge graph constant (``inv_deg_rel``)
========== ===============================================================================

A layer is a few builder calls (RGAT, PyG semantics)::

    p = Program(heads=H)
    x = p.node_input("x", K)
    W = p.rel_weight("W", K, H * C)
    h = p.typed_linear(x, W, "src")                        # x_u W_r              (src)
    s = p.linear(h, p.weight("k", H * C, H), score=True)   # (x_u W_r) k          (src, per head)
    d = p.linear(p.typed_linear(x, W, "dst"), p.weight("q", H * C, H), score=True)
    alpha = p.edge_softmax(p.leaky_relu(p.add(s, d), 0.2))
    p.output(p.aggregate(h, alpha))

:mod:`dsx.rgnn.interpreter` executes a program per edge (the spec); :func:`dsx.rgnn.compile` lowers it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["EDGE_SCALARS", "KINDS", "Program", "Value"]

KINDS = ("node", "src", "dst", "edge", "out", "weight", "rel_weight", "rel_scalar", "edge_scalar")
EDGE_SCALARS = ("inv_deg_rel", "inv_deg")  # 1/deg_r(dst) (per-relation mean), 1/deg(dst) (mean)


@dataclass(eq=False)
class Value:
    """One SSA value: ``op`` applied to ``inputs`` (Values) with ``attrs``; ``kind`` and ``shape`` as above."""

    op: str
    inputs: tuple
    kind: str
    shape: tuple
    attrs: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"<{self.op}:{self.kind}{list(self.shape)}>"


class Program:
    """An IR program being built (``output`` set at the end); ``heads`` is the attention head count ``H``."""

    def __init__(self, heads: int = 1):
        self.heads = heads
        self.values: list[Value] = []
        self.out: Value | None = None

    def _add(self, op, inputs, kind, shape, **attrs) -> Value:
        v = Value(op, tuple(inputs), kind, tuple(shape), attrs)
        self.values.append(v)
        return v

    # ---- leaves --------------------------------------------------------------------------------------
    def node_input(self, name: str, dim: int) -> Value:
        return self._add("input", (), "node", (dim,), name=name)

    def weight(self, name: str, k: int, m: int) -> Value:
        return self._add("param", (), "weight", (k, m), name=name)

    def rel_weight(self, name: str, k: int, m: int) -> Value:
        return self._add("param", (), "rel_weight", (k, m), name=name)

    def rel_scalar(self, name: str) -> Value:
        return self._add("param", (), "rel_scalar", (self.heads,), name=name)

    def edge_scalar(self, name: str) -> Value:
        if name not in EDGE_SCALARS:
            raise ValueError(f"edge scalar {name!r} is not one of {EDGE_SCALARS}")
        return self._add("graph", (), "edge_scalar", (), name=name)

    # ---- operators -----------------------------------------------------------------------------------
    def _heads_shape(self, m: int, score: bool) -> tuple:
        if score:
            if m != self.heads:
                raise ValueError(f"a score has one value per head: width {m} != heads {self.heads}")
            return (self.heads,)
        if m % self.heads:
            raise ValueError(f"width {m} is not divisible by heads={self.heads}")
        return (self.heads, m // self.heads)

    def typed_linear(self, x: Value, w: Value, side: str, score: bool = False) -> Value:
        """``x_{side node} W_{r(e)}``: a relation-typed projection of the source or destination node."""
        if x.kind != "node" or w.kind != "rel_weight" or side not in ("src", "dst"):
            raise ValueError(f"typed_linear(node, rel_weight, 'src'|'dst'), got {x}, {w}, {side!r}")
        if x.shape[-1] != w.shape[0]:
            raise ValueError(f"typed_linear: x has {x.shape[-1]} features, weight expects {w.shape[0]}")
        return self._add("typed_linear", (x, w), side, self._heads_shape(w.shape[1], score))

    def linear(self, v: Value, w: Value, score: bool = False) -> Value:
        """``v @ w`` on the flattened per-element features; ``w`` shared or per relation (not on node values)."""
        if w.kind not in ("weight", "rel_weight") or (w.kind == "rel_weight" and v.kind == "node"):
            raise ValueError(f"linear: bad operands {v}, {w}")
        return self._add("linear", (v, w), v.kind, self._heads_shape(w.shape[1], score))

    def gather(self, v: Value, side: str) -> Value:
        """A node value read at each edge's source or destination node."""
        if v.kind != "node" or side not in ("src", "dst"):
            raise ValueError(f"gather(node, 'src'|'dst'), got {v}, {side!r}")
        return self._add("gather", (v,), side, self._heads_shape(v.shape[-1], False))

    def dot(self, a: Value, b: Value) -> Value:
        """Per-head inner product of two ``(H, D)`` values -> one logit per head and edge."""
        if a.shape != b.shape or len(a.shape) != 2:
            raise ValueError(f"dot needs two (H, D) values of equal shape, got {a}, {b}")
        return self._add("dot", (a, b), "edge", (self.heads,))

    def add(self, a: Value, b: Value) -> Value:
        if a.shape != b.shape:
            raise ValueError(f"add: shapes differ, {a} vs {b}")
        return self._add("add", (a, b), "edge", a.shape)

    def leaky_relu(self, a: Value, slope: float = 0.2) -> Value:
        return self._add("leaky_relu", (a,), "edge", a.shape, slope=float(slope))

    def scale(self, a: Value, s: Value) -> Value:
        """``a * s``: ``s`` a per-relation-and-head scalar or a per-edge graph constant."""
        if s.kind not in ("rel_scalar", "edge_scalar"):
            raise ValueError(f"scale by a rel_scalar or edge_scalar, got {s}")
        return self._add("scale", (a, s), "edge", a.shape)

    def edge_softmax(self, a: Value) -> Value:
        """Softmax over the incoming edges of each destination (per head)."""
        return self._add("edge_softmax", (a,), "edge", a.shape)

    def aggregate(self, msg: Value, weight: Value | None = None, reduce: str = "sum") -> Value:
        """``out_v = reduce_{e into v} weight_e * msg_e``; ``reduce`` "sum" or "mean" (over all in-edges)."""
        if msg.kind not in ("src", "edge") or len(msg.shape) != 2 or reduce not in ("sum", "mean"):
            raise ValueError(
                f"aggregate(msg (H, D) src/edge value, weight, 'sum'|'mean'), got {msg}, {reduce!r}"
            )
        if reduce == "mean":
            inv = self.edge_scalar("inv_deg")
            weight = inv if weight is None else self.scale(weight, inv)
        return self._add("aggregate", (msg,) + ((weight,) if weight is not None else ()), "out", msg.shape)

    def output(self, v: Value) -> Value:
        if v.kind != "out":
            raise ValueError(f"a program's output is an aggregate, got {v}")
        self.out = v
        return v

    def params(self) -> list[str]:
        return [v.attrs["name"] for v in self.values if v.op == "param"]

    def inputs(self) -> list[str]:
        return [v.attrs["name"] for v in self.values if v.op == "input"]

    def __str__(self) -> str:
        ids = {id(v): f"%{i}" for i, v in enumerate(self.values)}
        lines = []
        for v in self.values:
            args = ", ".join(ids.get(id(a), "?") for a in v.inputs)
            attrs = "".join(f" {k}={val}" for k, val in v.attrs.items())
            lines.append(f"{ids[id(v)]} = {v.op}({args}){attrs} : {v.kind}{list(v.shape)}")
        return "\n".join(lines)
