"""dsx.direct sampler and loader: invariants against the graph itself, PyG conventions, seed splits."""

from __future__ import annotations

import math

import pytest
import torch

from dsx.direct import DistributedNeighborLoader, NeighborLoader, NeighborSampler, csr_from_edge_index

Data = pytest.importorskip("torch_geometric.data").Data


def _graph(n: int = 300, m: int = 4000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # power-law-ish targets so some nodes have degree far above the fanout and some below
    dst = (torch.rand(m, generator=g) ** 3 * n).long()
    src = torch.randint(0, n, (m,), generator=g)
    ei = torch.stack([src, dst])
    return torch.unique(ei, dim=1)  # simple graph: neighbor sets without duplicates


def _check(ei: torch.Tensor, n: int, out, fanouts: list[int]) -> None:
    edges = set(map(tuple, ei.t().tolist()))
    indeg = torch.bincount(ei[1], minlength=n)
    n_id = out.n_id.cpu()
    assert n_id.unique().numel() == n_id.numel(), "n_id has duplicates"
    assert sum(out.num_sampled_nodes) == n_id.numel()
    assert sum(out.num_sampled_edges) == out.edge_index.size(1)
    g = n_id[out.edge_index.cpu()]
    assert all(tuple(e) in edges for e in g.t().tolist()), "sampled edge not in graph"
    assert torch.equal(ei[:, out.e_id.cpu()], g), "e_id does not point at the sampled edges"
    # hop by hop: targets of hop h are the nodes added at hop h-1
    bounds = torch.tensor([0, *out.num_sampled_nodes]).cumsum(0)
    ebounds = torch.tensor([0, *out.num_sampled_edges]).cumsum(0)
    for h, k in enumerate(fanouts):
        tgt = out.edge_index[1, ebounds[h] : ebounds[h + 1]].cpu()
        src = out.edge_index[0, ebounds[h] : ebounds[h + 1]].cpu()
        assert ((tgt >= bounds[h]) & (tgt < bounds[h + 1])).all()
        assert (src < bounds[h + 2]).all()  # sources known by the end of this hop
        for t in tgt.unique().tolist():
            picks = g[0, ebounds[h] : ebounds[h + 1]][tgt == t]
            d = int(indeg[n_id[t]])
            assert picks.numel() == (d if k == -1 else min(d, k)), (
                "fanout not respected / degree<=fanout must take all"
            )
            assert picks.unique().numel() == picks.numel(), "duplicate neighbor within a neighborhood"
        # nodes with degree 0 in the frontier produce no edges; the rest appear as targets
        frontier = torch.arange(int(bounds[h]), int(bounds[h + 1]))
        has_nbr = indeg[n_id[frontier]] > 0
        assert set(frontier[has_nbr].tolist()) == set(tgt.unique().tolist())


@pytest.mark.parametrize("fanouts", [[15, 10, 5], [3, 2], [-1, 4]])
def test_sampler_invariants(fanouts: list[int]) -> None:
    n = 300
    ei = _graph(n)
    rowptr, col, perm = csr_from_edge_index(ei, n)
    s = NeighborSampler(rowptr, col, fanouts, perm=perm, seed=3)
    seeds = torch.randperm(n)[:40]
    out = s.sample(seeds)
    assert torch.equal(out.n_id[:40], seeds), "seeds must come first, in input order"
    _check(ei, n, out, fanouts)
    # the relabel table is reset: a second batch is still correct
    _check(ei, n, s.sample(torch.randperm(n)[:25]), fanouts)


def test_sampler_deterministic_with_seed() -> None:
    ei = _graph()
    rowptr, col, _ = csr_from_edge_index(ei, 300)
    a = NeighborSampler(rowptr, col, [5, 5], seed=11).sample(torch.arange(50))
    b = NeighborSampler(rowptr, col, [5, 5], seed=11).sample(torch.arange(50))
    c = NeighborSampler(rowptr, col, [5, 5], seed=12).sample(torch.arange(50))
    assert torch.equal(a.n_id, b.n_id) and torch.equal(a.edge_index, b.edge_index)
    assert not torch.equal(a.edge_index, c.edge_index)


def _chi2_quantile(p: float, df: int) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (accurate to <1% for df >= 10)."""
    z = math.sqrt(2) * torch.special.erfinv(torch.tensor(2 * p - 1, dtype=torch.float64)).item()
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _uniform_counts(device: str, d: int = 20, k: int = 5, nodes: int = 400, rounds: int = 20) -> torch.Tensor:
    # `nodes` targets, each with exactly d in-neighbors: offsets 0..d-1 inside its CSR row
    tgt = torch.arange(nodes).repeat_interleave(d)
    src = nodes + torch.arange(nodes * d)
    rowptr, col, _ = csr_from_edge_index(torch.stack([src, tgt]), nodes * (d + 1))
    s = NeighborSampler(rowptr.to(device), col.to(device), [k], seed=5)
    counts = torch.zeros(d, dtype=torch.long)
    for _ in range(rounds):
        out = s.sample(torch.arange(nodes, device=device))
        nbr = out.n_id[out.edge_index[0]].cpu()
        counts += torch.bincount((nbr - nodes) % d, minlength=d)
    return counts


def _assert_uniform(counts: torch.Tensor) -> None:
    exp = counts.sum().item() / counts.numel()
    stat = ((counts.double() - exp) ** 2 / exp).sum().item()
    limit = _chi2_quantile(0.9999, counts.numel() - 1)
    assert stat < limit, f"chi-square {stat:.1f} >= {limit:.1f}: picks not uniform ({counts.tolist()})"


def test_sampler_uniform_chi_square() -> None:
    counts = _uniform_counts("cpu")
    _assert_uniform(counts)
    # the test has power: a biased sampler (always offsets 0..k-1) fails it
    biased = torch.zeros(20, dtype=torch.long)
    biased[:5] = counts.sum() // 5
    with pytest.raises(AssertionError):
        _assert_uniform(biased)


def test_bad_fanout_message() -> None:
    rowptr, col, _ = csr_from_edge_index(_graph(), 300)
    with pytest.raises(ValueError, match="num_neighbors"):
        NeighborSampler(rowptr, col, [0])


def _data(n: int = 300) -> Data:
    ei = _graph(n)
    return Data(x=torch.randn(n, 16), y=torch.randint(0, 4, (n,)), edge_index=ei)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_loader_batches_train_pyg_sage(prefetch: int) -> None:
    from torch_geometric.nn import SAGEConv
    from torch_geometric.utils import trim_to_layer

    data = _data()
    loader = NeighborLoader(
        data, [5, 4], batch_size=64, shuffle=True, seed=0, prefetch=prefetch, device="cpu"
    )
    convs = torch.nn.ModuleList([SAGEConv(16, 32), SAGEConv(32, 4)])
    opt = torch.optim.SGD(convs.parameters(), lr=0.1)
    seen = []
    for batch in loader:
        assert torch.equal(batch.n_id[: batch.batch_size], batch.input_id)
        assert sum(batch.num_sampled_nodes) == batch.n_id.numel() == batch.x.size(0)
        assert torch.equal(batch.x, data.x[batch.n_id]) and torch.equal(batch.y, data.y[batch.n_id])
        x, ei = batch.x, batch.edge_index
        for i, conv in enumerate(convs):
            x, ei, _ = trim_to_layer(i, batch.num_sampled_nodes, batch.num_sampled_edges, x, ei)
            x = conv(x, ei).relu() if i == 0 else conv(x, ei)
        # trimming dropped the last hop's nodes before the last layer: seeds + hop-1 nodes remain
        assert x.size(0) == sum(batch.num_sampled_nodes[:2])
        loss = torch.nn.functional.cross_entropy(x[: batch.batch_size], batch.y[: batch.batch_size])
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in convs.parameters())
        opt.step()
        seen.append(batch.input_id)
    assert len(seen) == len(loader)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(300))  # an epoch covers every seed once


def test_loader_rejects_unsupported_pyg_kwarg() -> None:
    with pytest.raises(TypeError, match="replace"):
        NeighborLoader(_data(), [5], batch_size=8, replace=True)


@pytest.mark.parametrize("n,world", [(300, 3), (301, 4)])
def test_distributed_seed_split(n: int, world: int) -> None:
    data = _data(n)
    inputs = torch.arange(n)
    per_rank, lens = [], set()
    for rank in range(world):
        dl = DistributedNeighborLoader(
            data, [3], batch_size=16, shuffle=True, rank=rank, world_size=world, device="cpu", seed=7
        )
        dl.set_epoch(2)
        per_rank.append(dl._seeds())
        lens.add((per_rank[-1].numel(), len(dl)))
    assert len(lens) == 1, "ranks must see equal batch counts"
    allseeds = torch.cat(per_rank)
    assert set(allseeds.tolist()) == set(inputs.tolist()), "split must cover every seed"
    if n % world == 0:
        assert allseeds.unique().numel() == allseeds.numel(), "split must be disjoint"
    else:
        assert allseeds.numel() - allseeds.unique().numel() == world - n % world  # only the padding repeats


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampler_cuda_invariants_and_uniform() -> None:
    n = 300
    ei = _graph(n)
    rowptr, col, perm = csr_from_edge_index(ei, n, device="cuda")
    s = NeighborSampler(rowptr, col, [15, 10, 5], perm=perm, seed=3)
    out = s.sample(torch.randperm(n)[:40].cuda())
    assert out.n_id.is_cuda and out.edge_index.is_cuda
    _check(ei, n, out, [15, 10, 5])
    _assert_uniform(_uniform_counts("cuda"))
    # CSR in pinned host memory, sampling on the GPU (zero-copy reads)
    rp, cl, pm = csr_from_edge_index(ei, n)
    s2 = NeighborSampler(rp.pin_memory(), cl.pin_memory(), [5, 5], perm=pm, device="cuda", seed=1)
    _check(ei, n, s2.sample(torch.arange(30, device="cuda")), [5, 5])
