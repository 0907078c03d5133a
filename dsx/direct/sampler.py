"""Uniform neighbor sampling without replacement, vectorised torch ops (CUDA or CPU, same code).

The graph is a CSR over *incoming* edges (``rowptr`` indexed by target node, ``col`` = source node), so
sampling node ``v``'s neighbors follows messages into ``v``, exactly as PyG's ``NeighborLoader`` (which samples
over CSC). Output follows PyG's conventions: seeds first, then nodes in hop order; ``edge_index[0]`` is the
sampled neighbor (message source), ``edge_index[1]`` the seed-side target; ``num_sampled_nodes`` /
``num_sampled_edges`` per hop so that ``torch_geometric.utils.trim_to_layer`` works.

Performance: per hop, sampling costs O(n·k²) elementwise work for n frontier nodes and fanout k (Floyd's
algorithm, vectorised across nodes: k iterations, each comparing against the ≤ k picks so far), independent
of node degree, so power-law hubs cost no more than any other node. Relabelling uses a dense ``assoc`` table
(one int64 per graph node, reset after each batch) instead of a global sort; each hop makes two host
syncs (boolean compaction and ``unique`` of the new nodes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["NeighborSampler", "SampledSubgraph", "csr_from_edge_index"]


def csr_from_edge_index(
    edge_index: torch.Tensor, num_nodes: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CSR over incoming edges: returns ``(rowptr, col, perm)``; ``col[j]`` is the source of edge ``perm[j]``.

    One stable sort of the targets; done once per loader.
    """
    dev = torch.device(device) if device is not None else edge_index.device
    ei = edge_index.to(dev)
    dst, src = ei[1].long(), ei[0].long()
    if dst.numel() and (int(dst.min()) < 0 or int(dst.max()) >= num_nodes or int(src.max()) >= num_nodes):
        raise ValueError(f"edge_index has node ids outside [0, {num_nodes}); pass the right num_nodes")
    perm = torch.sort(dst, stable=True).indices
    col = src[perm]
    counts = torch.bincount(dst, minlength=num_nodes)
    rowptr = torch.zeros(num_nodes + 1, dtype=torch.long, device=dev)
    torch.cumsum(counts, 0, out=rowptr[1:])
    return rowptr, col, perm


@dataclass
class SampledSubgraph:
    """One sampled mini-batch in PyG ``NeighborLoader`` form (before features are attached)."""

    n_id: torch.Tensor  # global ids, seeds first then hop by hop
    edge_index: torch.Tensor  # local ids, [0] = neighbor (source), [1] = target
    e_id: torch.Tensor  # positions in the original edge_index
    batch_size: int
    num_sampled_nodes: list[int]
    num_sampled_edges: list[int]


class NeighborSampler:
    """Uniform k-out-of-d neighbor sampling without replacement, fanouts per hop.

    Parameters
    ----------
    rowptr, col : torch.Tensor
        CSR over incoming edges (see :func:`csr_from_edge_index`); on the GPU, on the CPU, or pinned host
        memory (pinned host CSR is indexed on the host and the picks copied over; correct, not zero-copy).
    num_neighbors : list[int]
        Fanout per hop; ``-1`` takes all neighbors.
    perm : torch.Tensor, optional
        Edge permutation returned by :func:`csr_from_edge_index`, to report original edge ids (``e_id``).
    device : torch.device, optional
        Where sampling runs; defaults to ``rowptr.device``.
    seed : int, optional
        Seeds the sampler's own generator: the same seed gives the same batches.
    """

    def __init__(
        self,
        rowptr: torch.Tensor,
        col: torch.Tensor,
        num_neighbors: list[int],
        *,
        perm: torch.Tensor | None = None,
        device: torch.device | str | None = None,
        seed: int | None = None,
    ) -> None:
        if not num_neighbors or any((not isinstance(k, int)) or (k < 1 and k != -1) for k in num_neighbors):
            raise ValueError(f"num_neighbors={num_neighbors!r}: expected a non-empty list of ints >= 1 or -1")
        self.device = torch.device(device) if device is not None else rowptr.device
        self.rowptr = rowptr if rowptr.device == self.device or rowptr.is_pinned() else rowptr.to(self.device)
        self.col = col if col.device == self.device or col.is_pinned() else col.to(self.device)
        self.perm = perm
        self.num_nodes = rowptr.numel() - 1
        self.num_neighbors = list(num_neighbors)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed if seed is not None else int(torch.randint(2**62, (1,))))
        self._assoc = torch.full((self.num_nodes,), -1, dtype=torch.long, device=self.device)

    # -- per-hop sampling -------------------------------------------------------------------------
    def _sample_offsets(
        self, start: torch.Tensor, deg: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, k) matrix of picked CSR offsets and its validity mask; Floyd's algorithm where deg > k."""
        n = deg.numel()
        if k == -1:
            k = int(deg.max()) if n else 0
        j = torch.arange(k, device=self.device)
        off = j.expand(n, k).clone()  # deg <= k: take offsets 0..deg-1
        valid = j.unsqueeze(0) < deg.unsqueeze(1)
        big = (deg > k).nonzero().squeeze(1)
        if big.numel():
            d = deg[big]
            sel = torch.empty((big.numel(), k), dtype=torch.long, device=self.device)
            for i in range(k):  # Floyd: for J = d-k+i, pick t in [0, J]; if already picked, take J
                upper = d - k + i
                r = torch.rand(big.numel(), generator=self.generator, device=self.device, dtype=torch.float64)
                t = (r * (upper + 1).double()).long().clamp_(max=upper)
                if i:
                    taken = (sel[:, :i] == t.unsqueeze(1)).any(1)
                    t = torch.where(taken, upper, t)
                sel[:, i] = t
            off[big] = sel
        return start.unsqueeze(1) + off, valid

    def sample(self, seeds: torch.Tensor) -> SampledSubgraph:
        """Sample the multi-hop neighborhood of ``seeds`` (distinct global node ids)."""
        seeds = seeds.to(self.device).long()
        assoc = self._assoc
        n_ids = [seeds]
        assoc[seeds] = torch.arange(seeds.numel(), device=self.device)
        num_nodes_total = seeds.numel()
        rows, cols, eids = [], [], []
        nsn, nse = [seeds.numel()], []
        frontier, frontier_local = seeds, torch.arange(seeds.numel(), device=self.device)
        try:
            for k in self.num_neighbors:
                rp = self.rowptr
                fr = frontier.to(rp.device)  # pinned host CSR: index on the host (no UVA kernel yet)
                start = rp[fr].to(self.device)
                deg = rp[fr + 1].to(self.device) - start
                pos, valid = self._sample_offsets(start, deg, k)
                pos = pos[valid]  # host sync: number of edges this hop
                tgt = frontier_local.unsqueeze(1).expand_as(valid)[valid]
                nbr = self.col[pos.to(self.col.device)].to(self.device).long()
                new = torch.unique(nbr[assoc[nbr] < 0])  # host sync: number of new nodes
                assoc[new] = torch.arange(num_nodes_total, num_nodes_total + new.numel(), device=self.device)
                num_nodes_total += new.numel()
                rows.append(assoc[nbr])
                cols.append(tgt)
                eids.append(pos if self.perm is None else self.perm[pos.to(self.perm.device)].to(self.device))
                n_ids.append(new)
                nsn.append(new.numel())
                nse.append(pos.numel())
                frontier = new
                frontier_local = assoc[new]
            n_id = torch.cat(n_ids)
        finally:
            assoc[torch.cat(n_ids)] = -1  # reset only what this batch touched
        edge_index = torch.stack([torch.cat(rows), torch.cat(cols)])
        return SampledSubgraph(n_id, edge_index, torch.cat(eids), seeds.numel(), nsn, nse)
