"""A node classifier for heterogeneous mini-batches: RGCN, RGAT or HGT, on dsx's fused layers or PyG's.

The same module with ``layers="pyg"`` holds torch_geometric's ``RGCNConv`` / ``RGATConv`` (on the homogeneous
view, as PyG users run them) or ``HGTConv`` with the same parameter names and shapes, so a benchmark compares
pipelines, not models; ``load_state_dict`` moves weights between the two.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODELS", "HeteroClassifier"]

MODELS = ("rgcn", "rgat", "hgt")


class HeteroClassifier(nn.Module):
    """Per node type an input projection (a ``Linear`` for types with features, one learned vector for
    featureless types), ``num_layers`` relational layers with ReLU between, and a linear classifier on
    ``target``'s rows.

    ``forward(x_dict, edge_index_dict, num_nodes_dict) -> [num_nodes_dict[target], classes]`` logits: the
    batch's seeds are the target type's first ``batch_size`` rows (as ``HeteroNeighborLoader`` orders them).
    """

    def __init__(
        self,
        model: str,
        metadata: tuple[list[str], list[tuple[str, str, str]]],
        in_channels: Mapping[str, int],
        hidden: int,
        classes: int,
        *,
        heads: int = 2,
        num_layers: int = 2,
        target: str = "paper",
        layers: str = "dsx",
    ) -> None:
        super().__init__()
        if model not in MODELS:
            raise ValueError(f"model={model!r}: choose one of {MODELS}")
        if layers not in ("dsx", "pyg"):
            raise ValueError(f"layers={layers!r}: 'dsx' (fused kernels) or 'pyg' (torch_geometric.nn)")
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be divisible by heads={heads}")
        node_types, edge_types = list(metadata[0]), [tuple(e) for e in metadata[1]]
        if target not in node_types:
            raise ValueError(f"target={target!r} is not a node type of {node_types}")
        self.model, self.target, self.node_types = model, target, node_types
        self.proj = nn.ModuleDict({t: nn.Linear(c, hidden) for t, c in in_channels.items()})
        self.embed = nn.ParameterDict(
            {t: nn.Parameter(0.1 * torch.randn(hidden)) for t in node_types if t not in in_channels}
        )
        self.convs = nn.ModuleList(
            [_layer(model, layers, (node_types, edge_types), hidden, heads) for _ in range(num_layers)]
        )
        self.head = nn.Linear(hidden, classes)
        # dsx's RGCN / RGAT reaching every node type: the layers run on one [num_nodes, hidden] tensor in the
        # typed layout's order (what RelationalHetero concatenates and splits on every call), so ReLU is one
        # launch and backward sums no per-type slices; the same values as the per-type dicts
        self._one_tensor = (
            layers == "dsx" and model in ("rgcn", "rgat") and set(node_types) <= {e[-1] for e in edge_types}
        )

    def forward(
        self,
        x_dict: Mapping[str, torch.Tensor],
        edge_index_dict: Mapping[tuple[str, str, str], torch.Tensor],
        num_nodes_dict: Mapping[str, int],
    ) -> torch.Tensor:
        h = {}
        for t in self.node_types:
            if t in self.proj:
                h[t] = self.proj[t](x_dict[t].to(self.proj[t].weight.dtype))
            else:
                h[t] = self.embed[t].expand(num_nodes_dict[t], -1)
        if self._one_tensor and h:
            return self._forward_one_tensor(h, edge_index_dict)
        for i, conv in enumerate(self.convs):
            out = conv(h, edge_index_dict)
            # a type no edge type reaches keeps its rows (HGT and PyG's to_hetero return no output for it)
            h = {t: out.get(t, h[t]) for t in self.node_types}
            if i + 1 < len(self.convs):
                h = {t: F.relu(v) for t, v in h.items()}
        return self.head(h[self.target])

    def _forward_one_tensor(
        self, h: dict[str, torch.Tensor], edge_index_dict: Mapping[tuple[str, str, str], torch.Tensor]
    ) -> torch.Tensor:
        # each layer through its module call, so that hooks and activation offload's recompute see every layer
        sizes = {t: v.size(0) for t, v in h.items()}
        layout = self.convs[0].prepare_graph(sizes, edge_index_dict, next(iter(h.values())).device)[0]
        x = layout.concat(h)
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index_dict, sizes)  # every node's row: all types are reached
            if i + 1 < len(self.convs):
                x = F.relu(x)
        start = layout.offset[self.target]
        return self.head(x[start : start + sizes[self.target]])


def _layer(model: str, layers: str, metadata, hidden: int, heads: int) -> nn.Module:
    from dsx.rgnn.hetero import RelationalHetero

    if layers == "pyg":
        import torch_geometric.nn as lib
    else:
        import dsx.rgnn as lib
    r = len(metadata[1])
    if model == "rgcn":
        return RelationalHetero(lib.RGCNConv(hidden, hidden, r), metadata)
    if model == "rgat":
        return RelationalHetero(lib.RGATConv(hidden, hidden // heads, r, heads=heads), metadata)
    return lib.HGTConv(hidden, hidden, metadata, heads=heads)
