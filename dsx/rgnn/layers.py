"""``RGCNConv`` and ``RGATConv``: drop-in replacements for the torch_geometric layers, on fused kernels.

Same constructor arguments (for the supported options), parameter names/shapes (``load_state_dict`` of a PyG
layer's state works strictly), forward signature and outputs. Lowering (``backend="kernels"``, the default):
one gather-GEMM for every relation's projection at the unique (node, relation) pairs, then one fused CSR edge
kernel for score, softmax and aggregation. ``backend="interpreter"`` runs the per-edge PyTorch spec of
docs/rgnn-semantics.md instead. See :mod:`dsx.rgnn.hgt` for ``HGTConv``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dsx.rgnn._common import LayerOptions, edge_softmax, typed_linear
from dsx.rgnn.graph import prepare
from dsx.rgnn.kernels import EdgeSpec, fused_edge

__all__ = ["RGATConv", "RGCNConv"]


def _unsupported(layer: str, **given) -> None:
    bad = {k: v for k, v in given.items() if v}
    if bad:
        raise ValueError(
            f"dsx.rgnn.{layer} does not support {bad}; use torch_geometric.nn.{layer} for these options"
        )


def _glorot(t: torch.Tensor) -> None:
    bound = math.sqrt(6.0 / (t.size(-2) + t.size(-1)))
    nn.init.uniform_(t, -bound, bound)


class RGCNConv(LayerOptions, nn.Module):
    """Relational GCN (PyG ``RGCNConv`` semantics): ``out_v = x_v Θ_root + Σ_r AGG_{u∈N_r(v)} x_u W_r + b``.

    ``aggr="mean"`` averages within each relation (PyG's per-relation loop path, the one PyG from PyPI takes
    without pyg-lib); ``"sum"``/``"add"`` sums. ``num_bases``: ``W_r = Σ_b comp[r, b] weight[b]``.
    Extra keyword options: ``backend`` ("auto" | "kernels" | "interpreter"), ``precision`` ("fp32" | "tf32" |
    "bf16", gather-GEMM inputs), ``kernel_backend`` ("triton" | "interpret" | "reference" | None = by
    device), ``compact_materialization`` (False: one projection per edge, the ablation).
    """

    def __init__(self, in_channels, out_channels: int, num_relations: int, num_bases: int | None = None,
                 num_blocks: int | None = None, aggr: str = "mean", root_weight: bool = True,
                 is_sorted: bool = False, bias: bool = True, *, backend: str | None = None,
                 precision: str | None = None, kernel_backend: str | None = None,
                 compact_materialization: bool | None = None, **kwargs):  # fmt: skip
        super().__init__()
        _unsupported("RGCNConv", num_blocks=num_blocks, **kwargs)
        if aggr not in ("mean", "sum", "add"):
            raise ValueError(f"aggr={aggr!r}: dsx.rgnn.RGCNConv supports 'mean', 'sum' and 'add'")
        self._init_options(backend, precision, kernel_backend, compact_materialization, None)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.num_relations, self.num_bases, self.num_blocks, self.aggr = num_relations, num_bases, None, aggr
        in_l, in_r = (in_channels, in_channels) if isinstance(in_channels, int) else in_channels
        self.in_channels_l = in_l
        if num_bases is not None:
            self.weight = nn.Parameter(torch.empty(num_bases, in_l, out_channels))
            self.comp = nn.Parameter(torch.empty(num_relations, num_bases))
        else:
            self.weight = nn.Parameter(torch.empty(num_relations, in_l, out_channels))
            self.register_parameter("comp", None)
        self.root = nn.Parameter(torch.empty(in_r, out_channels)) if root_weight else None
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _glorot(self.weight)
        for p in (self.comp, self.root):
            if p is not None:
                _glorot(p)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def relation_weight(self) -> torch.Tensor:
        if self.num_bases is None:
            return self.weight
        w = self.comp @ self.weight.reshape(self.num_bases, -1)
        return w.view(self.num_relations, self.in_channels_l, self.out_channels)

    def forward(self, x, edge_index: torch.Tensor, edge_type: torch.Tensor | None = None) -> torch.Tensor:
        x_l, x_r = x if isinstance(x, tuple) else (x, x)
        if x_l is None or not x_l.is_floating_point():
            raise TypeError("dsx.rgnn.RGCNConv needs floating-point node features; for featureless nodes pass "
                            "an nn.Embedding's output (PyG's index-tensor input is not supported)")  # fmt: skip
        if x_l.shape[-1] != self.in_channels_l:
            raise ValueError(f"x has {x_l.shape[-1]} features but in_channels={self.in_channels_l}")
        g = prepare(edge_index, edge_type, (x_l.size(0), x_r.size(0)), self.num_relations)
        w = self.relation_weight()
        mean = self.aggr == "mean"
        if self._use_interpreter():
            msg = torch.zeros(g.num_edges, self.out_channels, dtype=x_l.dtype, device=x_l.device)
            for r in range(self.num_relations):  # the per-edge spec: message x_u W_r, weight 1/deg_r(v)
                m = g.rel == r
                msg[m] = x_l[g.src[m]] @ w[r]
            if mean:
                msg = msg * g.inv_deg_rel.to(msg.dtype).unsqueeze(1)
            out = torch.zeros(g.num_dst, self.out_channels, dtype=x_l.dtype, device=x_l.device)
            out = out.index_add(0, g.dst, msg)
        else:
            rows, edge_row = typed_linear(self, x_l, w, g, "src")
            out = fused_edge(
                EdgeSpec(edge_weight=mean), g.dst_ptr, rows.view(-1, 1, self.out_channels), edge_row,
                edge_weight=g.inv_deg_rel.to(rows.dtype) if mean else None, backend=self._opt("kernel_backend"),
            ).view(g.num_dst, self.out_channels)  # fmt: skip
        if self.root is not None:
            out = out + x_r @ self.root
        if self.bias is not None:
            out = out + self.bias
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.in_channels}, {self.out_channels}, num_relations={self.num_relations})"


class RGATConv(LayerOptions, nn.Module):
    """Relational graph attention, PyG ``RGATConv`` defaults ("across-relation", "additive-self-attention").

    ``semantics="pyg"``: ``h_e = x_u W_r``, logit ``leaky_relu((x_v W_r) q + (x_u W_r) k)`` with ``q, k``
    shared by all relations, one softmax over all incoming edges of ``v``; ``out_v = Σ α_e h_e`` (heads
    concatenated or averaged) + bias. ``semantics="hector"``: per-relation attention vectors
    ``att_src[r], att_dst[r]`` (``[R, H, C]``) replace ``k, q``. Linear reordering folds ``W_r q`` into one
    ``[in, H]`` weight per relation so the attention terms come from a tiny gather-GEMM, not from ``h``.
    """

    def __init__(self, in_channels: int, out_channels: int, num_relations: int, num_bases: int | None = None,
                 num_blocks: int | None = None, mod: str | None = None,
                 attention_mechanism: str = "across-relation", attention_mode: str = "additive-self-attention",
                 heads: int = 1, dim: int = 1, concat: bool = True, negative_slope: float = 0.2,
                 dropout: float = 0.0, edge_dim: int | None = None, bias: bool = True, *,
                 semantics: str = "pyg", backend: str | None = None, precision: str | None = None,
                 kernel_backend: str | None = None, compact_materialization: bool | None = None,
                 linear_reorder: bool | None = None, **kwargs):  # fmt: skip
        super().__init__()
        _unsupported("RGATConv", num_blocks=num_blocks, mod=mod, dropout=dropout, edge_dim=edge_dim,
                     within_relation=attention_mechanism != "across-relation",
                     multiplicative=attention_mode != "additive-self-attention", dim_gt_1=dim != 1, **kwargs)  # fmt: skip
        if semantics not in ("pyg", "hector"):
            raise ValueError(f"semantics={semantics!r} is not 'pyg' or 'hector'")
        self._init_options(backend, precision, kernel_backend, compact_materialization, linear_reorder)
        self.in_channels, self.out_channels, self.num_relations = in_channels, out_channels, num_relations
        self.num_bases, self.heads, self.dim, self.concat = num_bases, heads, dim, concat
        self.negative_slope, self.semantics = negative_slope, semantics
        self.attention_mechanism, self.attention_mode = attention_mechanism, attention_mode
        hc = heads * out_channels
        if semantics == "pyg":
            self.q = nn.Parameter(torch.empty(hc, heads * dim))
            self.k = nn.Parameter(torch.empty(hc, heads * dim))
        else:
            self.att_src = nn.Parameter(torch.empty(num_relations, heads, out_channels))
            self.att_dst = nn.Parameter(torch.empty(num_relations, heads, out_channels))
        self.bias = nn.Parameter(torch.empty(hc if concat else out_channels)) if bias else None
        if num_bases is not None:
            self.att = nn.Parameter(torch.empty(num_relations, num_bases))
            self.basis = nn.Parameter(torch.empty(num_bases, in_channels, hc))
        else:
            self.weight = nn.Parameter(torch.empty(num_relations, in_channels, hc))
        if semantics == "pyg":  # PyG registers the "mod" parameters even when mod=None; keep state_dict equal
            self.w = nn.Parameter(torch.ones(out_channels))
            self.l1 = nn.Parameter(torch.ones(1, out_channels))
            self.b1 = nn.Parameter(torch.zeros(1, out_channels))
            self.l2 = nn.Parameter(torch.full((out_channels, out_channels), 1.0 / out_channels))
            self.b2 = nn.Parameter(torch.zeros(1, out_channels))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for name in ("weight", "basis", "att", "q", "k", "att_src", "att_dst"):
            if hasattr(self, name):
                _glorot(getattr(self, name))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def relation_weight(self) -> torch.Tensor:
        if self.num_bases is None:
            return self.weight
        w = self.att @ self.basis.reshape(self.num_bases, -1)
        return w.view(self.num_relations, self.in_channels, self.heads * self.out_channels)

    def _att_weights(self, w: torch.Tensor):
        """Per-relation ``[R, HC, H]`` maps from ``h = x W_r`` to the source and destination terms."""
        if self.semantics == "pyg":
            return self.k.unsqueeze(0), self.q.unsqueeze(0)
        eye = torch.eye(self.heads, dtype=w.dtype, device=w.device)
        # att[r, h, c] -> block-diagonal [R, H*C, H]: head h's term reads only head h's channels.
        return tuple(
            torch.einsum("rhc,hg->rhcg", a, eye).reshape(self.num_relations, -1, self.heads)
            for a in (self.att_src, self.att_dst)
        )

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, edge_type: torch.Tensor | None = None,
                edge_attr=None, size=None, return_attention_weights=None) -> torch.Tensor:  # fmt: skip
        _unsupported("RGATConv", edge_attr=edge_attr is not None, size=size is not None,
                     return_attention_weights=return_attention_weights is not None)  # fmt: skip
        if not x.is_floating_point() or x.shape[-1] != self.in_channels:
            raise ValueError(f"x must be float [N, {self.in_channels}], got {x.dtype} {tuple(x.shape)}")
        n, heads, c = x.size(0), self.heads, self.out_channels
        g = prepare(edge_index, edge_type, n, self.num_relations)
        w = self.relation_weight()
        a_src, a_dst = self._att_weights(w)  # [R or 1, HC, H]
        if self._use_interpreter():
            out = self._interpret(x, g, w, a_src, a_dst)
        else:
            h, msg_row = typed_linear(self, x, w, g, "src")
            if self._opt("linear_reorder"):
                # (x W_r) a = x (W_r a): the attention terms need an [in, H] GEMM instead of [in, HC] + [HC, H].
                src_t, src_row = typed_linear(self, x, w @ a_src, g, "src")
                dst_t, dst_row = typed_linear(self, x, w @ a_dst, g, "dst")
            else:
                hd, dst_row = typed_linear(self, x, w, g, "dst")
                src_row = msg_row
                src_t, dst_t = self._apply_att(h, a_src, g, "src"), self._apply_att(hd, a_dst, g, "dst")
            spec = EdgeSpec(score="add", leaky_relu_slope=self.negative_slope, softmax=True)
            out = fused_edge(spec, g.dst_ptr, h.view(-1, heads, c), msg_row, edge_src_row=src_row,
                             edge_dst_row=dst_row, src_term=src_t, dst_term=dst_t,
                             backend=self._opt("kernel_backend"))  # fmt: skip
        out = out.reshape(n, heads * c) if self.concat else out.mean(dim=1)
        return out if self.bias is None else out + self.bias

    def _apply_att(self, h: torch.Tensor, a: torch.Tensor, g, side: str) -> torch.Tensor:
        if a.shape[0] == 1:  # PyG: one q / k for all relations
            return h @ a[0]
        return torch.einsum("mk,mkh->mh", h, a[self._rel_of_rows(g, side)])

    def _rel_of_rows(self, g, side: str) -> torch.Tensor:
        """Relation of each materialised row (compact or per-edge), for the non-reordered attention terms."""
        if self._opt("compact_materialization"):
            ptr = g.src_rel_ptr if side == "src" else g.dst_rel_ptr
            return torch.repeat_interleave(torch.arange(self.num_relations, device=ptr.device), ptr.diff())
        return g.rel[g.rel_perm]

    def _interpret(self, x, g, w, a_src, a_dst):
        """Per-edge spec: materialise ``x_u W_r`` and ``x_v W_r`` for every edge, softmax, weighted sum."""
        w_e = w[g.rel]  # [E, in, HC]: one weight copy per edge, the simple (memory-hungry) form
        h_src = torch.bmm(x[g.src].unsqueeze(1), w_e).squeeze(1)
        h_dst = torch.bmm(x[g.dst].unsqueeze(1), w_e).squeeze(1)
        rel = g.rel if a_src.shape[0] > 1 else torch.zeros_like(g.rel)
        logit = torch.einsum("ek,ekh->eh", h_dst, a_dst[rel]) + torch.einsum("ek,ekh->eh", h_src, a_src[rel])
        alpha = edge_softmax(F.leaky_relu(logit, self.negative_slope), g.dst, g.num_dst)
        msg = alpha.unsqueeze(-1) * h_src.view(-1, self.heads, self.out_channels)
        out = torch.zeros(g.num_dst, self.heads, self.out_channels, dtype=x.dtype, device=x.device)
        return out.index_add(0, g.dst, msg)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.in_channels}, {self.out_channels}, heads={self.heads})"
