"""Uniform neighbor sampling without replacement over a CSR, vectorised (the same torch ops on CUDA and CPU).

The graph is given as CSR over *targets*: ``col[rowptr[v]:rowptr[v + 1]]`` are the sources ``u`` of the
edges ``u -> v`` (PyG's ``flow="source_to_target"``: a node aggregates its in-neighbors). Each hop expands
only the nodes first reached in the previous hop (as PyG's ``NeighborLoader`` does).

Per frontier node with degree ``d`` and fanout ``k``: ``d <= k`` takes every edge; otherwise ``k`` distinct
edge positions are drawn by Robert Floyd's algorithm, run for all nodes at once on a ``[nodes, k]`` matrix:
for ``t = 0 .. k-1`` draw ``r`` uniform in ``[0, d-k+t]`` and take ``r``, or ``d-k+t`` if ``r`` was taken
already. This yields every ``k``-subset with equal probability, in exactly ``k`` steps whatever the degree
(no rejection rounds, no data-dependent shapes, no host synchronisation).

Relabelling (global id -> local id, PyG order: seeds, then the new nodes of each hop in order of first
appearance) uses one dense ``num_nodes`` map: a scatter-min claims each newly seen node for the first edge
that reached it, a cumulative sum numbers the claims. The only host synchronisation per hop reads two
counts (new nodes, edges of the next hop), which the next hop needs as shapes and PyG needs as Python ints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsx.direct.floyd import floyd

__all__ = [
    "NeighborSampler",
    "SampledSubgraph",
    "check_csr",
    "claim_nodes",
    "draw_positions",
    "fanout_rows",
    "fanout_take",
    "floyd",
    "new_node_ids",
    "sample_positions",
    "seeds_on",
    "to_csr",
]


@dataclass
class SampledSubgraph:
    """One sampled mini-batch in PyG ``NeighborLoader`` form (local ids; seeds are ``n_id[:batch_size]``)."""

    n_id: torch.Tensor
    edge_index: torch.Tensor  # [2, E] local ids: row 0 = neighbor (source), row 1 = target
    e_id: torch.Tensor  # CSR edge positions (or the user's edge ids when given)
    batch_size: int
    num_sampled_nodes: list[int]
    num_sampled_edges: list[int]


def seeds_on(
    seeds: torch.Tensor, num_nodes: int, device: torch.device, what: str = "seed ids"
) -> torch.Tensor:
    """``seeds`` as int64 on ``device``, after an IndexError naming them if any lies outside
    ``[0, num_nodes)`` (host seeds are checked on the host; device seeds cost one synchronisation)."""
    if seeds.numel():
        lo, hi = (int(v) for v in torch.stack([seeds.min(), seeds.max()]).tolist())
        if lo < 0 or hi >= num_nodes:
            raise IndexError(f"{what} must lie in [0, {num_nodes}); got [{lo}, {hi}]")
    # non_blocking only towards the GPU: a non-blocking copy to the host returns before the bytes land
    return seeds.to(device, torch.long, non_blocking=device.type == "cuda")


class NeighborSampler:
    """Uniform neighbor sampling without replacement, hop by hop, on the CSR's device.

    Parameters
    ----------
    rowptr, col:
        CSR over targets (int64 or int32). Both on the same device: a CUDA device (all sampling ops run
        there) or the CPU.
    num_neighbors:
        Fanout per hop, e.g. ``[15, 10, 5]``; ``-1`` takes every neighbor on that hop.
    edge_id:
        Optional ``[E]`` map from CSR positions to the user's edge ids (returned as ``e_id``).
    generator:
        A ``torch.Generator`` on the CSR's device; with the same seed the samples are identical.

    Notes
    -----
    Performance: one host synchronisation per hop (two counts read together) plus one for the first hop's
    edge count; every other op is asynchronous with shapes known on the host. Work per hop is
    ``O(frontier * k^2)`` for Floyd's membership checks (``k <= 15`` in practice) plus ``O(edges)`` for
    relabelling — never proportional to a hub's degree. Relabelling uses a dense ``num_nodes`` map (8 bytes
    a node, allocated once), so a call must not run concurrently with another call on the same sampler.
    """

    def __init__(
        self,
        rowptr: torch.Tensor,
        col: torch.Tensor,
        num_neighbors: list[int],
        *,
        edge_id: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if rowptr.dim() != 1 or col.dim() != 1 or rowptr.device != col.device:
            raise ValueError(
                f"NeighborSampler needs 1-D rowptr and col on one device; got rowptr {tuple(rowptr.shape)} on "
                f"{rowptr.device}, col {tuple(col.shape)} on {col.device}"
            )
        if rowptr.dtype not in (torch.int32, torch.int64) or col.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"rowptr/col must be int32 or int64, got {rowptr.dtype}/{col.dtype}")
        if not num_neighbors or any(int(k) == 0 or int(k) < -1 for k in num_neighbors):
            raise ValueError(
                f"num_neighbors must be a non-empty list of positive ints or -1, got {num_neighbors}"
            )
        self.rowptr = rowptr.long()
        self.col = col
        self.num_neighbors = [int(k) for k in num_neighbors]
        self.edge_id = None if edge_id is None else edge_id.to(rowptr.device)  # (index_select: one device)
        self.device = rowptr.device
        self.num_nodes = rowptr.numel() - 1
        self.generator = generator
        self._map = torch.full((self.num_nodes,), -1, dtype=torch.long, device=self.device)

    def _take(self, nodes: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(CSR start, edges taken) of ``nodes`` at fanout ``k``."""
        return fanout_take(self.rowptr, nodes, k)

    def sample_positions(
        self, nodes: torch.Tensor, k: int, total: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For frontier ``nodes``: (owner index into ``nodes``, CSR edge position) of every sampled edge,
        grouped by owner. ``total`` (the number of sampled edges, if known) saves a host synchronisation."""
        return sample_positions(self.rowptr, nodes, k, total, self.generator)

    def sample(self, seeds: torch.Tensor) -> SampledSubgraph:
        """Sample the multi-hop neighborhood of distinct ``seeds`` (global ids; host seeds are range-checked
        on the host, device seeds with one synchronisation)."""
        seeds = seeds_on(seeds, self.num_nodes, self.device)
        m, dev = self._map, self.device
        m.index_put_((seeds,), torch.arange(seeds.numel(), device=dev))
        n_ids, rows, cols, eids = [seeds], [], [], []
        n_nodes, n_edges = [seeds.numel()], []
        frontier, offset, count = seeds, 0, seeds.numel()
        total = int(self._take(seeds, self.num_neighbors[0])[1].sum()) if seeds.numel() else 0
        touched = None
        try:
            for h, k in enumerate(self.num_neighbors):
                owner, epos = self.sample_positions(frontier, k, total)
                nbr = self.col.index_select(0, epos).long()
                e = nbr.numel()
                touched = nbr  # claims written below are undone by the except clause if the hop fails
                local, first, rank, new_count = claim_nodes(m, nbr, count)
                # One synchronisation: the new nodes' count and, for the next hop, their sampled edges.
                if h + 1 < len(self.num_neighbors):
                    nxt = torch.where(first, self._take(nbr, self.num_neighbors[h + 1])[1], 0).sum()
                else:
                    nxt = torch.zeros((), dtype=torch.long, device=dev)
                n_new, total = (int(v) for v in torch.stack([new_count, nxt]).tolist()) if e else (0, 0)
                new = new_node_ids(nbr, first, rank, n_new)
                rows.append(local)
                cols.append(owner + offset)  # the frontier holds local ids offset .. offset + len - 1
                eids.append(epos if self.edge_id is None else self.edge_id.index_select(0, epos))
                n_ids.append(new)
                n_nodes.append(n_new)
                n_edges.append(e)
                frontier, offset, count = new, count, count + n_new
                touched = None
            n_id = torch.cat(n_ids)
        except BaseException:
            if touched is not None:  # a failed hop leaves claims (< -1) or local ids on its neighbors
                m.index_fill_(0, touched, -1)
            raise
        finally:
            m.index_fill_(0, torch.cat(n_ids), -1)  # reset only the touched entries
        edge_index = (
            torch.stack([torch.cat(rows), torch.cat(cols)]) if rows else torch.empty(2, 0, dtype=torch.long)
        )
        return SampledSubgraph(n_id, edge_index, torch.cat(eids), seeds.numel(), n_nodes, n_edges)


def fanout_take(rowptr: torch.Tensor, nodes: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(CSR start, edges taken) of ``nodes`` at fanout ``k`` (``-1``: every edge)."""
    start, _, take = fanout_rows(rowptr, nodes, k)
    return start, take


def fanout_rows(
    rowptr: torch.Tensor, nodes: torch.Tensor, k: int | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(CSR start, degree, edges taken at fanout ``k``) of ``nodes``; ``k`` is one fanout for all of them or
    a tensor of one per node (``-1``: every edge)."""
    # index_select rather than ``rowptr[nodes]``: the same rows for less host time a call (the sampler is a
    # chain of small launches whose host cost sets its pace), and ``rowptr[1:]`` is a view, not an add
    start = rowptr.index_select(0, nodes)
    deg = rowptr[1:].index_select(0, nodes) - start
    if isinstance(k, torch.Tensor):
        return start, deg, torch.where(k < 0, deg, torch.minimum(deg, k))
    return start, deg, (deg if k < 0 else deg.clamp(max=k))


def sample_positions(
    rowptr: torch.Tensor,
    nodes: torch.Tensor,
    k: int,
    total: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For frontier ``nodes`` of the CSR ``rowptr``: (owner index into ``nodes``, CSR edge position) of every
    sampled edge, grouped by owner. ``total`` (the number of sampled edges, if known) saves a host
    synchronisation."""
    start, deg, take = fanout_rows(rowptr, nodes, k)
    if total is None:
        total = int(take.sum())
    return draw_positions(start, deg, take, k, total, generator)


def draw_positions(
    start: torch.Tensor,
    deg: torch.Tensor,
    take: torch.Tensor,
    k: int,
    total: int,
    generator: torch.Generator | None = None,
    row_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner row, CSR edge position) of the ``total`` edges sampled from rows that start at ``start`` with
    degree ``deg``, ``take`` edges each, grouped by row: a row whose fanout is ``-1`` takes every edge, the
    others a uniform subset (Floyd's draws). ``k`` is every row's fanout, or with ``row_k`` (each row's own)
    the largest of them (``-1`` only if every row's is)."""
    owner = torch.repeat_interleave(take, output_size=total)  # = repeat_interleave(arange(n), take)
    first = torch.cumsum(take, 0) - take
    slot = torch.arange(total, device=start.device) - first.index_select(0, owner)  # 0 .. take-1 in each row
    if k < 0:
        return owner, start.index_select(0, owner) + slot
    if row_k is None:
        # (the draws as [owner, slot])
        pos = floyd(deg, k, generator).view(-1).index_select(0, torch.add(slot, owner, alpha=k))
    else:  # rows that take every edge draw nothing and keep their slot
        draws = floyd(deg, k, generator, row_k=row_k.clamp(min=0)).view(-1)
        pos = draws.index_select(0, torch.add(slot.clamp(max=k - 1), owner, alpha=k))
        pos = torch.where(row_k.index_select(0, owner) < 0, slot, pos)
    return owner, start.index_select(0, owner) + pos


def claim_nodes(
    node_map: torch.Tensor,
    nbr: torch.Tensor,
    count: int | torch.Tensor,
    number: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local ids of the non-empty ``nbr`` (global ids) in PyG order: ``(local, first, rank, new)``.

    ``node_map`` holds each node's local id, or ``-1`` if unseen; ``count`` nodes have local ids already.
    Every unseen node is claimed by the first entry of ``nbr`` that names it (a scatter-min of
    ``i - (e + 2)``: seen nodes keep their id >= 0, unseen ones hold -1 and take the smallest claim) and
    numbered ``count, count + 1, ...`` in order of first appearance. ``first`` marks the claiming entries,
    ``rank`` (1-based) numbers them; ``new`` is how many there are; the map holds every node's local id
    afterwards.

    ``number`` numbers the claims in groups instead (e.g. per node type): from ``first`` it gives each entry's
    1-based rank among its group's claims and the count per group; ``count`` is then each entry's group's
    count (a tensor like ``nbr``).
    """
    e = nbr.numel()
    claims = torch.arange(-(e + 2), -2, device=nbr.device)  # entry i's claim: i - (e + 2)
    cur = node_map.index_select(0, nbr)
    node_map.scatter_reduce_(0, nbr, torch.where(cur >= 0, cur, claims), "amin")
    claim = node_map.index_select(0, nbr)
    first = claim == claims
    if number is None:
        rank = torch.cumsum(first, 0)  # 1-based number of the claim among the new nodes
        new = rank[-1] if e else torch.zeros((), dtype=torch.long, device=nbr.device)
    else:
        rank, new = number(first)
    new_of = rank + (count - 1)
    local = torch.where(claim >= 0, claim, new_of.index_select(0, (claim + (e + 2)).clamp_(0, max(e - 1, 0))))
    node_map.index_put_((nbr,), local)  # every write to one node writes the same value
    return local, first, rank, new


def new_node_ids(nbr: torch.Tensor, first: torch.Tensor, rank: torch.Tensor, n_new: int) -> torch.Tensor:
    """The ``n_new`` nodes :func:`claim_nodes` numbered, in their order (``n_new`` read on the host)."""
    new = torch.empty(n_new + 1, dtype=torch.long, device=nbr.device)  # last slot: a dump for non-claims
    new.index_put_((torch.where(first, rank - 1, n_new),), nbr)
    return new[:n_new]


def to_csr(edge_index: torch.Tensor, num_nodes: int, device: torch.device | str | None = None):
    """CSR over targets from a COO ``edge_index`` (row 0 source, row 1 target): ``(rowptr, col, perm)``.

    ``perm[p]`` is the COO edge id of CSR position ``p``. Built on ``device`` (the sort by target dominates:
    build it on the GPU when the graph fits there).
    """
    ei = edge_index.to(device) if device is not None else edge_index
    dst = ei[1].long()
    perm = torch.argsort(dst, stable=True)
    col = ei[0].long()[perm]
    counts = torch.bincount(dst, minlength=num_nodes)
    rowptr = torch.zeros(num_nodes + 1, dtype=torch.long, device=ei.device)
    torch.cumsum(counts, 0, out=rowptr[1:])
    return rowptr, col, perm


def check_csr(rowptr: torch.Tensor, col: torch.Tensor, num_dst: int, num_src: int, what: str = "CSR") -> None:
    """Raise ``ValueError`` naming ``what`` unless ``(rowptr, col)`` is a CSR over ``num_dst`` destinations
    whose ``col`` holds source ids in ``[0, num_src)``: one host read, on the arrays' device. A bad pointer or
    id would make the sampler read another node's neighbours or outside the arrays."""
    if rowptr.dim() != 1 or rowptr.numel() != num_dst + 1 or col.dim() != 1:
        raise ValueError(
            f"{what}: rowptr must be 1-D of num_nodes + 1 = {num_dst + 1} entries and col 1-D; got "
            f"{tuple(rowptr.shape)} and {tuple(col.shape)}"
        )
    if rowptr.dtype not in (torch.int32, torch.int64) or col.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: rowptr and col must be int32 or int64, got {rowptr.dtype} and {col.dtype}")
    if rowptr.device != col.device:
        raise ValueError(
            f"{what}: rowptr and col must be on one device, got {rowptr.device} and {col.device}"
        )
    zero = torch.zeros((), dtype=torch.long, device=col.device)
    lo, hi = (col.min().long(), col.max().long()) if col.numel() else (zero, zero)
    first, last = rowptr[0].long(), rowptr[-1].long()
    falls = (rowptr[1:] < rowptr[:-1]).any().long()
    lo, hi, first, last, falls = torch.stack([lo, hi, first, last, falls]).tolist()
    if first != 0 or last != col.numel() or falls:
        raise ValueError(
            f"{what}: rowptr must start at 0, never decrease and end at len(col) = {col.numel()}; it starts at "
            f"{first}, ends at {last}" + (" and decreases somewhere" if falls else "")
        )
    if col.numel() and (lo < 0 or hi >= num_src):
        raise ValueError(f"{what}: source ids in col lie in [{lo}, {hi}], outside [0, {num_src})")
