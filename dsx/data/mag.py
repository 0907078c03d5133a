"""A synthetic heterogeneous graph shaped like ogbn-mag, as a ``torch_geometric.data.HeteroData``.

:func:`synthetic_mag` at ``scale=1`` has ogbn-mag's node and edge counts: paper 736,389, author 1,134,649,
institution 8,740, field_of_study 59,965 nodes; writes 7,145,660, cites 5,416,271, affiliated_with
1,043,998, has_topic 7,505,078 edges, each with its reverse (``rev_<name>``): 8 edge types, 42.2M edges.
Only papers have features (``paper_features`` wide, 128 as in ogbn-mag, 768 as in MAG240M) and labels
(``num_classes`` venues, 349 as in ogbn-mag).

Structure that makes the typed neighbourhood matter: every paper and author has a venue class (its id
modulo ``num_classes``); degrees are skewed (an endpoint ``floor(n u^2)``, shifted per edge type by a
multiple of the class count, so every edge type has its own hubs); a citation and an authorship stay within
the venue with probability ``homophily``; a paper's features are its venue's embedding under noise of
``noise`` times its scale, so that the paper alone is a weak witness of its label and the papers it is
cited by, and its authors' other papers, are strong ones: accuracy rises with training, and more with
neighbours than without.

Cost: a few vectorised passes over the edges; 8 s on the H100 machine's CPU and 2 GB of host memory (int64
edge lists) at ``scale=1``. ``layout="csr", device="cuda"`` builds the edges on the GPU as CSRs (4 bytes an
edge), for scales whose edge lists would not fit in host memory beside the features.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsx.direct.gather import host_empty

if TYPE_CHECKING:
    from torch_geometric.data import HeteroData

__all__ = ["MAG_EDGES", "MAG_NODES", "synthetic_mag"]

MAG_NODES = {"paper": 736_389, "author": 1_134_649, "institution": 8_740, "field_of_study": 59_965}
MAG_EDGES = {
    ("author", "writes", "paper"): 7_145_660,
    ("paper", "cites", "paper"): 5_416_271,
    ("author", "affiliated_with", "institution"): 1_043_998,
    ("paper", "has_topic", "field_of_study"): 7_505_078,
}
_CLASSED = ("paper", "author")  # node types with a venue class: homophilous edges between them


def synthetic_mag(
    scale: float = 1.0,
    *,
    paper_features: int = 128,
    num_classes: int = 349,
    homophily: float = 0.8,
    noise: float = 2.0,
    feature_dtype: torch.dtype = torch.float32,
    split: tuple[float, float, float] = (0.8, 0.1, 0.1),
    layout: str = "coo",
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> HeteroData:
    """Build the graph at ``scale`` times ogbn-mag's counts (at least ``2 * num_classes`` nodes per type).

    ``data["paper"]`` carries ``x [N, paper_features]`` (``feature_dtype``, in host memory), ``y [N]`` and
    ``train_mask`` / ``val_mask`` / ``test_mask`` drawn with the fractions ``split`` (ogbn-mag's 80 / 10 / 10 %
    by default; MAG240M labels about 1 % of its papers); the other node types carry ``num_nodes`` only. Edge
    types are ``MAG_EDGES`` and their reverses.

    ``layout="coo"``: each edge type's ``edge_index`` (row 0 the source), in host memory. ``layout="csr"``:
    each edge type's ``rowptr`` and ``col``, a CSR over destinations (int32 sources where they fit), left on
    ``device``, as ``dsx.direct.HeteroNeighborLoader`` takes it: 4 bytes an edge instead of 16, no host copy
    of the edges, so graphs whose edge lists would not fit in host memory beside their features (billions of
    edges) can be built on a GPU; the reverse types are the exact transposes. The numbers are drawn on
    ``device``: another device gives another graph of the same statistics, either layout the same one.
    """
    from torch_geometric.data import HeteroData

    if not 0.0 < scale:
        raise ValueError(f"scale={scale} must be > 0")
    if not 0.0 <= homophily <= 1.0:
        raise ValueError(f"homophily={homophily} must lie in [0, 1]")
    if num_classes < 2 or paper_features < 1:
        raise ValueError(
            f"need num_classes >= 2 and paper_features >= 1, got {num_classes}, {paper_features}"
        )
    if len(split) != 3 or min(split) < 0 or sum(split) > 1 + 1e-9:
        raise ValueError(f"split={split}: three fractions (train, val, test) >= 0 with a sum <= 1")
    if layout not in ("coo", "csr"):
        raise ValueError(f"layout={layout!r}: 'coo' (edge_index) or 'csr' (rowptr, col)")
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    n = {t: max(int(c * scale), 2 * num_classes) for t, c in MAG_NODES.items()}
    data = HeteroData()
    for t, c in n.items():
        data[t].num_nodes = c
    for (src, name, dst), count in MAG_EDGES.items():
        m = max(int(count * scale), 1)
        s, d = _edges(n[src], n[dst], m, src in _CLASSED and dst in _CLASSED, num_classes, homophily, gen)
        if layout == "coo":
            ei = torch.stack([s, d]).cpu()
            del s, d
            data[src, name, dst].edge_index = ei
            data[dst, f"rev_{name}", src].edge_index = ei.flip(0)
            continue
        data[src, name, dst].rowptr, data[src, name, dst].col = _csr(d, s, n[dst], n[src])
        data[dst, f"rev_{name}", src].rowptr, data[dst, f"rev_{name}", src].col = _csr(s, d, n[src], n[dst])
        del s, d
    p = n["paper"]
    y = torch.arange(p) % num_classes
    emb = torch.randn(num_classes, paper_features, generator=gen, device=dev)
    # page-aligned, so rows of a multiple of 128 bytes start on a line (docs/unified.md, 'Where the table starts')
    x = host_empty((p, paper_features), feature_dtype)
    rows = max(1, _CHUNK_BYTES // (4 * paper_features))
    for lo in range(0, p, rows):  # in slices: the table may be most of host memory and not fit on the device
        hi = min(p, lo + rows)
        z = torch.randn(hi - lo, paper_features, generator=gen, device=dev).mul_(noise)
        x[lo:hi].copy_(z.add_(emb[y[lo:hi].to(dev)]).to(feature_dtype))
        del z
    data["paper"].x = x
    data["paper"].y = y
    u = torch.rand(p, generator=gen, device=dev).cpu()
    a, b, c = split
    data["paper"].train_mask = u < a
    data["paper"].val_mask = (u >= a) & (u < a + b)
    data["paper"].test_mask = (u >= a + b) & (u < a + b + c)
    return data


# Edges drawn per slice of this many, feature rows per slice of this many fp32 bytes: the draws' temporaries
# stay per slice (what is left is the ids, 16 bytes an edge, and the sort of one edge type), and at ogbn-mag's
# size there is one slice each, so the graph is the one drawn at once.
_CHUNK = 1 << 25
_CHUNK_BYTES = 1 << 30


def _edges(
    ns: int, nd: int, m: int, classed: bool, classes: int, homophily: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``m`` (source, destination) ids: skewed endpoints; between classed types, within the source's venue
    with probability ``homophily``; then each side's hubs moved per edge type."""
    dev = gen.device
    s_all = torch.empty(m, dtype=torch.long, device=dev)
    d_all = torch.empty(m, dtype=torch.long, device=dev)
    for lo in range(0, m, _CHUNK):
        k = min(m, lo + _CHUNK) - lo
        s = _skewed(ns, k, gen)
        d = _skewed(nd, k, gen)
        if classed:
            # within the venue: a skewed id of the source's class (ids c, c + C, c + 2C, ... hold class c)
            same = torch.rand(k, generator=gen, device=dev) < homophily
            c = s % classes
            slots = torch.div(nd - 1 - c, classes, rounding_mode="floor") + 1
            within = (
                slots.double() * torch.rand(k, generator=gen, device=dev, dtype=torch.float64) ** 2
            ).long()
            d = torch.where(same, within * classes + c, d)
            del same, c, slots, within
        s_all[lo : lo + k] = s
        d_all[lo : lo + k] = d
        del s, d
    # per edge type hubs: a shift by whole classes keeps every id's class
    _shift(s_all, ns, classes, gen)
    _shift(d_all, nd, classes, gen)
    return s_all, d_all


def _csr(
    dst: torch.Tensor, src: torch.Tensor, num_dst: int, num_src: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR over destinations: ``(rowptr int64, col)``, ``col`` int32 where the source ids fit."""
    fits = lambda n: n <= torch.iinfo(torch.int32).max  # noqa: E731
    key, order = torch.sort(dst.int() if fits(num_dst) else dst)  # int32 keys: half the sort's memory
    rowptr = torch.searchsorted(key, torch.arange(num_dst + 1, device=dst.device, dtype=key.dtype)).long()
    del key
    return rowptr, (src.int() if fits(num_src) else src)[order]


def _skewed(n: int, m: int, gen: torch.Generator) -> torch.Tensor:
    """``m`` ids in ``[0, n)``, low ids favoured (density ∝ 1 / sqrt(id)): a few hubs, a long tail."""
    u = torch.rand(m, generator=gen, device=gen.device, dtype=torch.float64)
    return u.pow_(2).mul_(n).long().clamp_(max=n - 1)


def _shift(ids: torch.Tensor, n: int, classes: int, gen: torch.Generator) -> None:
    """Rotate ids, in place, by a random multiple of ``classes`` within the largest multiple of it that ``n``
    holds, so that each edge type has its own hubs and every id keeps its class (ids beyond stay where they
    are); in slices, so that the temporaries stay small at billions of edges."""
    span = (n // classes) * classes
    k = int(torch.randint(0, max(1, span // classes), (1,), generator=gen, device=gen.device)) * classes
    for lo in range(0, ids.numel(), _CHUNK):
        part = ids[lo : lo + _CHUNK]
        part.copy_(torch.where(part < span, (part + k) % max(span, 1), part))
