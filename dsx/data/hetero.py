"""Synthetic heterogeneous graphs whose statistics follow real relational benchmarks.

:func:`synthetic_hetero` builds, fully vectorised (tens of millions of edges in seconds), a graph with:

* node types with a schema: each relation ``r`` connects a fixed source type to a fixed destination type;
  type sizes decay like ``1 / (t + 1)``;
* Zipf-distributed relation sizes (``|E_r| ∝ (r + 1)^-1.1``, every relation non-empty when ``E >= R``);
* skewed degrees: endpoint ``i = floor(n_t * u^2)`` (``u`` uniform) shifted by a per-relation offset, so
  each relation has its own hubs;
* labels that depend on structure: every node has a latent class ``z``; each relation shifts classes
  (``π_r(z) = z + (r mod 2) mod C``); a node's label is the most frequent ``π_r(z_u)`` over its incoming edges (its own ``z`` when it
  has none). Features are a noisy embedding of ``z`` only, so a model must aggregate over typed edges
  to predict labels: accuracy rises with training.

``PRESETS`` holds the (nodes, edges, relations, node types) of the graphs ``benchmarks/bench_rgnn.py`` runs:
public relational datasets' shapes, from aifb to ogbn-mag and ogbl-wikikg2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PRESETS", "HeteroGraph", "Preset", "synthetic_hetero"]


@dataclass(frozen=True)
class Preset:
    num_nodes: int
    num_edges: int
    num_relations: int  # including reverse relations
    num_node_types: int = 1
    reverse: bool = False  # second half of the relations are the reverses of the first half


PRESETS: dict[str, Preset] = {
    "aifb": Preset(7_262, 48_810, 104),
    "mutag": Preset(27_163, 148_100, 50),
    "bgs": Preset(94_806, 672_884, 122),
    "am": Preset(881_680, 5_668_682, 108),
    "ogbn-mag": Preset(1_939_743, 21_111_007, 8, num_node_types=4, reverse=True),
    "fb15k-237": Preset(14_541, 620_232, 474),
    "biokg": Preset(93_773, 5_088_434, 51, num_node_types=5),
    "wikikg2": Preset(2_500_604, 16_109_182, 535),
}


@dataclass
class HeteroGraph:
    """A typed graph in homogeneous layout (node ids grouped by type) plus the schema.

    ``x [N, F]`` (or None), ``y [N]``, ``node_type [N]``, ``type_ptr [T+1]`` (type ``t`` owns ids
    ``type_ptr[t] <= i < type_ptr[t+1]``), ``edge_index [2, E]``, ``edge_type [E]``, ``rel_src_type``,
    ``rel_dst_type [R]``, ``train_mask`` / ``test_mask [N]``.
    """

    x: torch.Tensor | None
    y: torch.Tensor | None
    node_type: torch.Tensor
    type_ptr: torch.Tensor
    edge_index: torch.Tensor
    edge_type: torch.Tensor
    rel_src_type: torch.Tensor
    rel_dst_type: torch.Tensor
    num_classes: int
    train_mask: torch.Tensor
    test_mask: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return self.node_type.numel()

    @property
    def num_relations(self) -> int:
        return self.rel_src_type.numel()

    @property
    def node_types(self) -> list[str]:
        return [f"t{t}" for t in range(self.type_ptr.numel() - 1)]

    def metadata(self):
        """``(node_types, edge_types)`` as torch_geometric's ``HeteroData.metadata()``."""
        return self.node_types, [
            (f"t{int(s)}", f"r{r}", f"t{int(d)}")
            for r, (s, d) in enumerate(zip(self.rel_src_type, self.rel_dst_type))
        ]

    def to_hetero(self, x: torch.Tensor | None = None):
        """``(x_dict, edge_index_dict)`` with per-type local node ids (HGTConv's inputs)."""
        x = self.x if x is None else x
        ptr = self.type_ptr.tolist()
        x_dict = {f"t{t}": x[ptr[t] : ptr[t + 1]] for t in range(len(ptr) - 1)}
        order = torch.argsort(self.edge_type, stable=True)
        counts = torch.bincount(self.edge_type, minlength=self.num_relations).tolist()
        ei, start, out = self.edge_index[:, order], 0, {}
        start_of = self.type_ptr
        for r, (name, c) in enumerate(zip(self.metadata()[1], counts)):
            part = ei[:, start : start + c]
            start += c
            shift = torch.stack([start_of[self.rel_src_type[r]], start_of[self.rel_dst_type[r]]]).view(2, 1)
            out[name] = part - shift.to(part.device)
        return x_dict, out


def synthetic_hetero(
    preset: str | Preset = "aifb",
    *,
    scale: float = 1.0,
    num_features: int = 16,
    num_classes: int = 4,
    labels: bool = True,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> HeteroGraph:
    """Generate a graph shaped like ``preset`` with nodes and edges multiplied by ``scale``.

    ``num_features=0`` skips features (benchmarks draw their own), ``labels=False`` skips labels. Cost:
    a few vectorised passes over ``E``; ``ogbn-mag`` at full scale takes seconds on a GPU.
    """
    p = PRESETS[preset] if isinstance(preset, str) else preset
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n = max(int(p.num_nodes * scale), p.num_node_types * 2)
    e = max(int(p.num_edges * scale), 1)
    t_count, r_count = p.num_node_types, p.num_relations
    # Node types: sizes ∝ 1/(t+1), at least 2 nodes each.
    tw = 1.0 / torch.arange(1, t_count + 1, dtype=torch.float64)
    sizes = (tw / tw.sum() * (n - 2 * t_count)).floor().long() + 2
    sizes[0] += n - int(sizes.sum())
    type_ptr = torch.zeros(t_count + 1, dtype=torch.long)
    type_ptr[1:] = torch.cumsum(sizes, 0)
    node_type = torch.repeat_interleave(torch.arange(t_count), sizes)
    # Schema: relation r's endpoint types; reverses mirror the first half.
    base = r_count // 2 if p.reverse else r_count
    src_t = torch.arange(base) % t_count
    dst_t = torch.randint(0, t_count, (base,), generator=gen)
    if p.reverse:
        src_t, dst_t = torch.cat([src_t, dst_t]), torch.cat([dst_t, src_t])
        if src_t.numel() < r_count:  # odd count: one extra forward relation
            src_t, dst_t = torch.cat([src_t, src_t[:1]]), torch.cat([dst_t, dst_t[:1]])
    # Zipf relation sizes; every relation gets an edge while E >= R.
    rw = 1.0 / torch.arange(1, r_count + 1, dtype=torch.float64) ** 1.1
    counts = (rw / rw.sum() * max(e - r_count, 0)).floor().long() + (1 if e >= r_count else 0)
    counts[0] += e - int(counts.sum())
    rel = torch.repeat_interleave(torch.arange(r_count), counts)

    def endpoint(types: torch.Tensor) -> torch.Tensor:
        size, start = sizes[types], type_ptr[types]
        shift = torch.randint(0, 1 << 30, (r_count,), generator=gen)[rel]
        local = (size.double() * torch.rand(e, generator=gen, dtype=torch.float64) ** 2).long()
        return start + (local + shift) % size

    src, dst = endpoint(src_t[rel]), endpoint(dst_t[rel])
    perm = torch.randperm(e, generator=gen)
    edge_index, edge_type = torch.stack([src, dst])[:, perm], rel[perm]
    x = y = None
    z = torch.randint(0, num_classes, (n,), generator=gen)
    if labels:
        # pi_r = a class shift of 0 or 1 (by relation parity): learnable from few edges per relation.
        pi = (torch.arange(num_classes).view(1, -1) + (torch.arange(r_count) % 2).view(-1, 1)) % num_classes
        votes = torch.bincount(edge_index[1] * num_classes + pi[edge_type, z[edge_index[0]]],
                               minlength=n * num_classes).view(n, num_classes)  # fmt: skip
        y = torch.where(votes.sum(1) > 0, votes.argmax(1), z)
    if num_features > 0:
        emb = torch.randn(num_classes, num_features, generator=gen)
        x = emb[z] + 0.5 * torch.randn(n, num_features, generator=gen)
    split = torch.rand(n, generator=gen) < 0.7
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return HeteroGraph(to(x), to(y), to(node_type), to(type_ptr), to(edge_index), to(edge_type), to(src_t),
                       to(dst_t), num_classes, to(split), to(~split))  # fmt: skip
