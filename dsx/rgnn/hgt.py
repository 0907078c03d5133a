"""``HGTConv``: drop-in for ``torch_geometric.nn.HGTConv`` (PyG 2.8 parameterisation) on fused kernels.

Math (docs/rgnn-semantics.md): per node type ``τ``: ``[k, q, v] = Linear_τ(x)`` split into ``H`` heads of
``D = F / H``; per relation ``r`` and head ``h``: ``k'_u = k_u W^k_{h,r}``, ``v'_u = v_u W^v_{h,r}`` (PyG's
``k_rel`` / ``v_rel`` HeteroLinear, type id ``h * R + r``); logit ``(q_v · k'_u) p_rel[r, h] / √D``, softmax
over all incoming edges of ``v``; ``out_v = Σ α v'_u``; then ``a = out_lin_τ(gelu(out))`` and, when the
width is unchanged, ``σ(skip_τ) a + (1 - σ(skip_τ)) x`` (``semantics="pyg"``) or ``a + x`` (the HGT paper's
residual, ``semantics="hector"``).

Lowering: k' and v' are typed linears at the unique (source, relation) pairs (one gather-GEMM each with the
per-head blocks assembled block-diagonally), q stays per destination node (the edge kernel loads it once
per node), one fused edge kernel (score "dot", ``rel_scale = p_rel / √D``, softmax).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dsx.rgnn.dispatch import run_program
from dsx.rgnn.hetero import typed_graph
from dsx.rgnn.options import LayerOptions, Options
from dsx.rgnn.programs import hgt_program

__all__ = ["HGTConv"]


class _DictLinear(nn.Module):
    """Same state_dict layout as PyG's ``HeteroDictLinear`` (``lins.<type>.weight / bias``)."""

    def __init__(self, in_channels: dict[str, int], out_channels: int):
        super().__init__()
        self.lins = nn.ModuleDict({t: nn.Linear(c, out_channels) for t, c in in_channels.items()})

    def forward(self, x_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {t: self.lins[t](x) for t, x in x_dict.items() if t in self.lins}


class _TypedWeight(nn.Module):
    """Same state_dict layout as PyG's ``HeteroLinear(bias=False)``: ``weight [num_types, in, out]``."""

    def __init__(self, num_types: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_types, dim, dim))
        bound = math.sqrt(6.0 / (2 * dim))
        nn.init.uniform_(self.weight, -bound, bound)


class HGTConv(LayerOptions, nn.Module):
    """Heterogeneous graph transformer layer; ``forward(x_dict, edge_index_dict) -> out_dict``.

    Returns outputs for the node types that are destinations of some edge type in ``metadata`` (as PyG).
    Extra keyword options as :class:`dsx.rgnn.RGCNConv` plus ``semantics`` ("pyg" | "hector").
    """

    def __init__(self, in_channels, out_channels: int, metadata, heads: int = 1, *, semantics: str = "pyg",
                 backend: str | None = None, precision: str | None = None, kernel_backend: str | None = None,
                 compact_materialization: bool | None = None, fusion: bool | None = None, **kwargs):  # fmt: skip
        super().__init__()
        if kwargs:
            raise ValueError(f"dsx.rgnn.HGTConv does not support {kwargs}; use torch_geometric.nn.HGTConv")
        if out_channels % heads != 0:
            raise ValueError(f"out_channels={out_channels} must be divisible by heads={heads}")
        if semantics not in ("pyg", "hector"):
            raise ValueError(f"semantics={semantics!r} is not 'pyg' or 'hector'")
        self._init_options(backend, precision, kernel_backend, compact_materialization, None, fusion)
        self.node_types, self.edge_types = list(metadata[0]), [tuple(e) for e in metadata[1]]
        if not isinstance(in_channels, dict):
            in_channels = {t: in_channels for t in self.node_types}
        self.in_channels, self.out_channels, self.heads, self.semantics = (
            in_channels,
            out_channels,
            heads,
            semantics,
        )
        self.dst_node_types = {e[-1] for e in self.edge_types}
        self.kqv_lin = _DictLinear(in_channels, 3 * out_channels)
        self.out_lin = _DictLinear({t: out_channels for t in self.node_types}, out_channels)
        dim, num_types = out_channels // heads, heads * len(self.edge_types)
        self.k_rel, self.v_rel = _TypedWeight(num_types, dim), _TypedWeight(num_types, dim)
        self.skip = nn.ParameterDict({t: nn.Parameter(torch.ones(1)) for t in self.node_types})
        self.p_rel = nn.ParameterDict(
            {"__".join(e): nn.Parameter(torch.ones(1, heads)) for e in self.edge_types}
        )

    def _block_weight(self, typed: _TypedWeight) -> torch.Tensor:
        """``[R, F, F]``: relation r's per-head ``D x D`` blocks on the diagonal (PyG type id ``h * R + r``)."""
        h, r = self.heads, len(self.edge_types)
        d = self.out_channels // h
        w = typed.weight.view(h, r, d, d)
        eye = torch.eye(h, dtype=w.dtype, device=w.device)
        return torch.einsum("hrij,hg->rhigj", w, eye).reshape(r, h * d, h * d)

    def _homogeneous(self, x_dict, edge_index_dict, opts: Options):
        """One node id space (types concatenated in ``x_dict`` order) and relation ids from ``metadata``: the
        prepared graph, shared with the model's other layers on the same ``edge_index_dict``."""
        sizes = {t: x.size(0) for t, x in x_dict.items()}
        device = next(iter(x_dict.values())).device if x_dict else None
        return self.prepare_graph(sizes, edge_index_dict, device, opts)

    def prepare_graph(self, sizes, edge_index_dict, device, opts: Options | None = None):
        """The prepared graph and node-type offsets a forward on these node counts and edges reads (cached;
        :class:`dsx.rgnn.PrepareGraph` builds it ahead on the loader's thread)."""
        needs = (opts or self.options()).graph_needs("rel")
        return typed_graph(sizes, edge_index_dict, self.edge_types, needs, device=device)

    def forward(self, x_dict: dict[str, torch.Tensor], edge_index_dict: dict) -> dict[str, torch.Tensor]:
        f, h = self.out_channels, self.heads
        d = f // h
        for t, x in x_dict.items():
            if t in self.in_channels and x.size(-1) != self.in_channels[t]:
                raise ValueError(
                    f"x_dict[{t!r}] has {x.size(-1)} features, in_channels says {self.in_channels[t]}"
                )
        opts = self.options()
        g, offset = self._homogeneous(x_dict, edge_index_dict, opts)
        n = g.num_src
        kqv = self.kqv_lin(x_dict)
        k, q, v = (torch.cat([kqv[t].tensor_split(3, dim=1)[i] for t in x_dict], 0) for i in range(3))
        scale = torch.cat([self.p_rel["__".join(e)] for e in self.edge_types], 0) / math.sqrt(d)  # [R, H]
        wk, wv = self._block_weight(self.k_rel), self._block_weight(self.v_rel)
        params = {"Wk": wk, "Wv": wv, "scale": scale.contiguous()}
        out = run_program(opts, hgt_program(f, h), g, {"k": k, "q": q, "v": v}, params)
        out = out.reshape(n, f)
        result = {}
        for t, x in x_dict.items():
            if t not in self.dst_node_types:
                continue
            a = self.out_lin.lins[t](F.gelu(out[offset[t] : offset[t] + x.size(0)]))
            if a.size(-1) == x.size(-1):
                if self.semantics == "pyg":
                    s = self.skip[t].sigmoid()
                    a = s * a + (1 - s) * x
                else:
                    a = a + x
            result[t] = a
        return result

    def __repr__(self) -> str:
        return f"{type(self).__name__}(-1, {self.out_channels}, heads={self.heads})"
