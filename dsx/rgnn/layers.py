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
from torch import nn

from dsx.rgnn.dispatch import run_program
from dsx.rgnn.graph import prepare
from dsx.rgnn.options import LayerOptions, Options
from dsx.rgnn.programs import rgat_program, rgcn_program

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
    device), ``compact_materialization`` (False: one projection per edge, the ablation), ``linear_reorder``,
    ``fusion``. Each left as ``None`` follows ``dsx.defaults.get("rgnn")`` when the layer runs
    (``kernel_backend`` excepted: it has no config key).
    """

    def __init__(self, in_channels, out_channels: int, num_relations: int, num_bases: int | None = None,
                 num_blocks: int | None = None, aggr: str = "mean", root_weight: bool = True,
                 is_sorted: bool = False, bias: bool = True, *, backend: str | None = None,
                 precision: str | None = None, kernel_backend: str | None = None,
                 compact_materialization: bool | None = None, linear_reorder: bool | None = None,
                 fusion: bool | None = None, **kwargs):  # fmt: skip
        super().__init__()
        _unsupported("RGCNConv", num_blocks=num_blocks, **kwargs)
        if aggr not in ("mean", "sum", "add"):
            raise ValueError(f"aggr={aggr!r}: dsx.rgnn.RGCNConv supports 'mean', 'sum' and 'add'")
        self._init_options(
            backend, precision, kernel_backend, compact_materialization, linear_reorder, fusion
        )
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

    def graph_needs(self, opts: Options | None = None) -> tuple[str, ...]:
        """The :class:`~dsx.rgnn.RelGraph` fields a forward reads with these options (see ``prepare(needs=)``)."""
        return (opts or self.options()).graph_needs(*(("inv_deg_rel",) if self.aggr == "mean" else ()))

    def forward(self, x, edge_index: torch.Tensor, edge_type: torch.Tensor | None = None) -> torch.Tensor:
        x_l, x_r = x if isinstance(x, tuple) else (x, x)
        if x_l is None or not x_l.is_floating_point():
            raise TypeError("dsx.rgnn.RGCNConv needs floating-point node features; for featureless nodes pass "
                            "an nn.Embedding's output (PyG's index-tensor input is not supported)")  # fmt: skip
        if x_l.shape[-1] != self.in_channels_l:
            raise ValueError(f"x has {x_l.shape[-1]} features but in_channels={self.in_channels_l}")
        mean, opts = self.aggr == "mean", self.options()
        g = prepare(edge_index, edge_type, (x_l.size(0), x_r.size(0)), self.num_relations,
                    needs=self.graph_needs(opts))  # fmt: skip
        w = self.relation_weight()
        prog = rgcn_program(self.in_channels_l, self.out_channels, mean)
        out = run_program(opts, prog, g, {"x": x_l}, {"W": w}).view(g.num_dst, self.out_channels)
        if self.root is not None:
            # One [N, C] result (addmm accumulates into a copy of out) instead of a product and a sum.
            out = torch.addmm(out, x_r, self.root)
        if self.bias is not None:
            # In place on addmm's result (its backward does not read it); else out-of-place on the kernel's.
            out = out.add_(self.bias) if self.root is not None else out + self.bias
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
                 linear_reorder: bool | None = None, fusion: bool | None = None, **kwargs):  # fmt: skip
        super().__init__()
        _unsupported("RGATConv", num_blocks=num_blocks, mod=mod, dropout=dropout, edge_dim=edge_dim,
                     within_relation=attention_mechanism != "across-relation",
                     multiplicative=attention_mode != "additive-self-attention", dim_gt_1=dim != 1, **kwargs)  # fmt: skip
        if semantics not in ("pyg", "hector"):
            raise ValueError(f"semantics={semantics!r} is not 'pyg' or 'hector'")
        self._init_options(
            backend, precision, kernel_backend, compact_materialization, linear_reorder, fusion
        )
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

    def graph_needs(self, opts: Options | None = None) -> tuple[str, ...]:
        """The :class:`~dsx.rgnn.RelGraph` fields a forward reads with these options (see ``prepare(needs=)``)."""
        return (opts or self.options()).graph_needs("dst_row_idx", "dst_rel_ptr", "edge_dst_row")

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, edge_type: torch.Tensor | None = None,
                edge_attr=None, size=None, return_attention_weights=None) -> torch.Tensor:  # fmt: skip
        _unsupported("RGATConv", edge_attr=edge_attr is not None, size=size is not None,
                     return_attention_weights=return_attention_weights is not None)  # fmt: skip
        if not x.is_floating_point() or x.shape[-1] != self.in_channels:
            raise ValueError(f"x must be float [N, {self.in_channels}], got {x.dtype} {tuple(x.shape)}")
        n, heads, c, opts = x.size(0), self.heads, self.out_channels, self.options()
        g = prepare(edge_index, edge_type, n, self.num_relations, needs=self.graph_needs(opts))
        w = self.relation_weight()
        a_src, a_dst = self._att_weights(w)  # [R or 1, HC, H]
        prog = rgat_program(self.in_channels, c, heads, self.negative_slope, self.semantics == "hector")
        att = {"att_src": a_src, "att_dst": a_dst} if self.semantics == "hector" else {"att_src": a_src[0],
                                                                                        "att_dst": a_dst[0]}  # fmt: skip
        out = run_program(opts, prog, g, {"x": x}, {"W": w, **att})
        out = out.reshape(n, heads * c) if self.concat else out.mean(dim=1)
        return out if self.bias is None else out + self.bias

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.in_channels}, {self.out_channels}, heads={self.heads})"
