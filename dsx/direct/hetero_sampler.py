"""Typed neighbor sampling: uniform without replacement per edge type, hop by hop, one host sync per hop
(and one that sizes the first).

PyG's heterogeneous semantics (``torch_geometric.loader.NeighborLoader`` on ``HeteroData``): edges of type
``(src, rel, dst)`` point from a ``src`` node to a ``dst`` node; the seeds are destinations. At hop ``h``
the frontier of every node type (the nodes of that type first reached at hop ``h - 1``; the seeds at hop 0)
is sampled along every edge type whose destination is that type, with that edge type's fanout for hop
``h``. Sources not seen before join their type's next frontier; each type's local ids follow PyG's order
(seeds, then each hop's new nodes in order of first appearance, edge types in order).

Each edge type has its own CSR over destinations; the per-edge-type draws are
:func:`dsx.direct.sampler.sample_positions` (Robert Floyd's algorithm, vectorised) and the relabelling is
:func:`dsx.direct.sampler.claim_nodes` on one dense map per node type. A hop's sources of one node type
(from all edge types that reach it) are relabelled together, so that a node reached along two edge types
in one hop gets one local id. The only host synchronisation per hop reads, in one transfer, every node
type's new-node count and every edge type's edge count for the next hop: the next hop needs them as shapes
and PyG needs them as Python ints (the first hop's counts are read once before it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsx.direct.sampler import claim_nodes, fanout_take, new_node_ids, sample_positions, seeds_on

__all__ = ["EdgeType", "HeteroNeighborSampler", "HeteroSampledSubgraph"]

EdgeType = tuple[str, str, str]


@dataclass
class HeteroSampledSubgraph:
    """One sampled heterogeneous mini-batch in PyG form (local ids per node type; the seeds are
    ``n_id[input_type][:batch_size]``)."""

    n_id: dict[str, torch.Tensor]
    edge_index: dict[EdgeType, torch.Tensor]  # [2, E] local ids: row 0 = source (src type), row 1 = dst
    e_id: dict[EdgeType, torch.Tensor]  # CSR edge positions (or the user's edge ids when given)
    input_type: str
    batch_size: int
    num_sampled_nodes: dict[str, list[int]]  # per hop, hop 0 = the seeds
    num_sampled_edges: dict[EdgeType, list[int]]  # per hop


class HeteroNeighborSampler:
    """Uniform neighbor sampling without replacement over typed edges, on the CSRs' device.

    Parameters
    ----------
    csr:
        Per edge type ``(src, rel, dst)``: ``(rowptr, col)``, the CSR over destinations
        (``col[rowptr[v]:rowptr[v + 1]]`` are the ``src`` nodes with an edge to ``dst`` node ``v``).
        All on one device (CUDA: every op runs there; or the CPU).
    num_nodes:
        Nodes per node type.
    num_neighbors:
        Per edge type, the fanout of each hop (every edge type the same number of hops); ``-1`` takes every
        neighbor, ``0`` none (that edge type is skipped on that hop).
    edge_id:
        Optional per edge type map from CSR positions to the user's edge ids (returned as ``e_id``).
    generator:
        A ``torch.Generator`` on the CSRs' device, shared by all edge types; the same seed gives the same
        samples.

    Notes
    -----
    Memory: one dense ``int64`` map per node type (8 bytes a node, allocated once), so a call must not run
    concurrently with another call on the same sampler.
    """

    def __init__(
        self,
        csr: dict[EdgeType, tuple[torch.Tensor, torch.Tensor]],
        num_nodes: dict[str, int],
        num_neighbors: dict[EdgeType, list[int]],
        *,
        edge_id: dict[EdgeType, torch.Tensor] | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if not csr:
            raise ValueError("HeteroNeighborSampler needs at least one edge type")
        self.edge_types = [tuple(et) for et in csr]
        devices = {t.device for rc in csr.values() for t in rc}
        if len(devices) != 1:
            raise ValueError(
                f"HeteroNeighborSampler needs every CSR on one device; got {sorted(map(str, devices))}"
            )
        self.device = devices.pop()
        hops = {len(num_neighbors.get(et, ())) for et in self.edge_types}
        if len(hops) != 1 or 0 in hops:
            raise ValueError(
                f"num_neighbors needs the same, non-zero number of hops for every edge type {self.edge_types}; "
                f"got {num_neighbors}"
            )
        self.num_hops = hops.pop()
        self.num_neighbors = {et: [int(k) for k in num_neighbors[et]] for et in self.edge_types}
        for et, ks in self.num_neighbors.items():
            if any(k < -1 for k in ks):
                raise ValueError(f"num_neighbors of {et} must be ints >= -1 (-1: all, 0: none); got {ks}")
        self.num_nodes = {t: int(n) for t, n in num_nodes.items()}
        self.rowptr, self.col = {}, {}
        for et, (rowptr, col) in csr.items():
            et = tuple(et)
            src, _, dst = et
            if src not in self.num_nodes or dst not in self.num_nodes:
                raise ValueError(f"edge type {et}: node types {src!r} / {dst!r} need an entry in num_nodes")
            if rowptr.dim() != 1 or rowptr.numel() != self.num_nodes[dst] + 1 or col.dim() != 1:
                raise ValueError(
                    f"edge type {et}: rowptr must be [num_nodes[{dst!r}] + 1 = {self.num_nodes[dst] + 1}] "
                    f"and col 1-D; got {tuple(rowptr.shape)} and {tuple(col.shape)}"
                )
            self.rowptr[et], self.col[et] = rowptr.long(), col
        self.edge_id = {tuple(et): ids.to(self.device) for et, ids in (edge_id or {}).items()}
        self.generator = generator
        self.node_types = list(self.num_nodes)
        self._maps = {
            t: torch.full((n,), -1, dtype=torch.long, device=self.device) for t, n in self.num_nodes.items()
        }

    def _next_totals(
        self, hop: int, nbr: dict[str, torch.Tensor], first: dict[str, torch.Tensor] | None
    ) -> dict:
        """Per edge type, the (device) number of edges hop ``hop`` samples from the new nodes ``nbr[first]``
        of its destination type (``first=None``: every node of ``nbr`` is new)."""
        out = {}
        for et in self.edge_types:
            k, dst = self.num_neighbors[et][hop], et[2]
            if k != 0 and dst in nbr:
                take = fanout_take(self.rowptr[et], nbr[dst], k)[1]
                out[et] = (take if first is None else take * first[dst]).sum()
        return out

    def sample(self, input_type: str, seeds: torch.Tensor) -> HeteroSampledSubgraph:
        """Sample the multi-hop typed neighborhood of distinct ``seeds`` (global ids of ``input_type``; host
        seeds are range-checked on the host, device seeds with one synchronisation)."""
        if input_type not in self.num_nodes:
            raise ValueError(f"input type {input_type!r} is not a node type of this graph {self.node_types}")
        seeds = seeds_on(seeds, self.num_nodes[input_type], self.device, f"seed ids of {input_type!r}")
        dev, maps, hops = self.device, self._maps, self.num_hops
        maps[input_type].index_put_((seeds,), torch.arange(seeds.numel(), device=dev))
        empty = torch.empty(0, dtype=torch.long, device=dev)
        n_ids = {t: [seeds] if t == input_type else [] for t in self.node_types}
        count = {t: seeds.numel() if t == input_type else 0 for t in self.node_types}
        n_nodes = {t: [count[t]] for t in self.node_types}
        rows, cols, eids = ({et: [] for et in self.edge_types} for _ in range(3))
        n_edges: dict[EdgeType, list[int]] = {et: [] for et in self.edge_types}
        frontier = {t: seeds if t == input_type else empty for t in self.node_types}
        offset = dict.fromkeys(self.node_types, 0)  # local id of each type's frontier's first node
        pending = self._next_totals(0, {input_type: seeds}, None) if seeds.numel() else {}
        totals = dict(zip(pending, torch.stack(list(pending.values())).tolist())) if pending else {}
        touched: list[tuple[str, torch.Tensor]] = []
        try:
            for h in range(hops):
                # Sample every edge type from its destination type's frontier; group sources by type.
                parts: dict[str, list[tuple[EdgeType, torch.Tensor, torch.Tensor]]] = {}
                for et in self.edge_types:
                    total = totals.get(et, 0)
                    if total == 0:
                        n_edges[et].append(0)
                        continue
                    owner, epos = sample_positions(
                        self.rowptr[et], frontier[et[2]], self.num_neighbors[et][h], total, self.generator
                    )
                    parts.setdefault(et[0], []).append((et, owner, epos))
                    n_edges[et].append(total)
                    eids[et].append(
                        epos if et not in self.edge_id else self.edge_id[et].index_select(0, epos)
                    )
                # Relabel each source type's neighbors of this hop together (one local id per node).
                nbr, first, rank = {}, {}, {}
                for t, group in parts.items():
                    nbr[t] = torch.cat([self.col[et].index_select(0, epos).long() for et, _, epos in group])
                    touched.append((t, nbr[t]))  # undone by the except clause if the hop fails
                    local, first[t], rank[t] = claim_nodes(maps[t], nbr[t], count[t])
                    start = 0
                    for et, owner, _ in group:
                        rows[et].append(local[start : start + owner.numel()])
                        cols[et].append(owner + offset[et[2]])  # the frontier's local ids start at offset
                        start += owner.numel()
                # One synchronisation: every type's new-node count and the next hop's edge counts.
                nxt = self._next_totals(h + 1, nbr, first) if h + 1 < hops else {}
                counts = [first[t].sum() for t in nbr] + list(nxt.values())
                values = torch.stack(counts).tolist() if counts else []
                n_new = dict(zip(nbr, values[: len(nbr)]))
                totals = dict(zip(nxt, values[len(nbr) :]))
                for t in self.node_types:
                    k = n_new.get(t, 0)
                    new = new_node_ids(nbr[t], first[t], rank[t], k) if k else empty
                    n_ids[t].append(new)
                    n_nodes[t].append(k)
                    frontier[t], offset[t], count[t] = new, count[t], count[t] + k
                touched = []
            out_nodes = {t: torch.cat(v) if v else empty for t, v in n_ids.items()}
        except BaseException:
            for t, ids in touched:  # a failed hop leaves claims (< -1) or local ids on its neighbors
                maps[t].index_fill_(0, ids, -1)
            raise
        finally:
            for t, v in n_ids.items():  # reset only the touched entries
                if v:
                    maps[t].index_fill_(0, torch.cat(v), -1)
        # one launch per edge type: rows then columns, as one [2 * E] buffer seen as [2, E]
        edge_index = {
            et: torch.cat(rows[et] + cols[et]).view(2, -1) if rows[et] else empty.view(2, 0)
            for et in self.edge_types
        }
        e_id = {et: torch.cat(v) if v else empty for et, v in eids.items()}
        return HeteroSampledSubgraph(out_nodes, edge_index, e_id, input_type, seeds.numel(), n_nodes, n_edges)
