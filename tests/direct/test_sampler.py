"""NeighborSampler / NeighborLoader: sampled edges exist, fanouts, no duplicates, uniformity, determinism,
PyG model compatibility, distributed seed split; the same invariants on CUDA (gpu marker)."""

from __future__ import annotations

import math

import pytest
import torch

from dsx.data.rmat import rmat_graph
from dsx.direct import NeighborLoader, NeighborSampler, to_csr


def _graph(n: int = 400, e: int = 6000, seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=g)
    hub = torch.stack(
        [torch.randint(0, n, (300,), generator=g), torch.zeros(300, dtype=torch.long)]
    )  # deg ~300
    ei = torch.unique(torch.cat([ei, hub], 1), dim=1)  # distinct edges, so node ids repeat only if a bug
    rowptr, col, perm = to_csr(ei, n)
    return ei, rowptr.to(device), col.to(device), perm.to(device)


def _check_invariants(rowptr, col, perm, ei, fanouts, seeds, out):
    rowptr, col = rowptr.cpu(), col.cpu()
    n_id, e = out.n_id.cpu(), out.edge_index.cpu()
    assert n_id[: out.batch_size].tolist() == seeds.tolist()
    assert len(set(n_id.tolist())) == n_id.numel()  # relabelling gives each node one local id
    assert sum(out.num_sampled_nodes) == n_id.numel() and sum(out.num_sampled_edges) == e.shape[1]
    src, dst = n_id[e[0]], n_id[e[1]]
    # Every sampled edge exists in the graph, and e_id names it.
    edges = set(zip(ei[0].tolist(), ei[1].tolist()))
    assert all((s, d) in edges for s, d in zip(src.tolist(), dst.tolist()))
    eid = perm.cpu()[out.e_id.cpu()]
    assert torch.equal(ei[0][eid], src) and torch.equal(ei[1][eid], dst)
    deg = rowptr[1:] - rowptr[:-1]
    lo_n, lo_e = 0, 0
    for h, k in enumerate(fanouts):
        frontier = n_id[lo_n : lo_n + out.num_sampled_nodes[h]]
        lo_n += out.num_sampled_nodes[h]
        hop_dst = dst[lo_e : lo_e + out.num_sampled_edges[h]]
        hop_src = src[lo_e : lo_e + out.num_sampled_edges[h]]
        lo_e += out.num_sampled_edges[h]
        # Edges of hop h start exactly at the nodes first reached in hop h - 1 (trim_to_layer relies on it).
        assert set(hop_dst.tolist()) <= set(frontier.tolist())
        for v in frontier.tolist():
            got = hop_src[hop_dst == v]
            want = int(deg[v]) if k < 0 else min(int(deg[v]), k)
            assert got.numel() == want  # fanout respected; d <= k takes all
            assert got.unique().numel() == got.numel()  # no duplicates within a neighborhood
            if k < 0 or deg[v] <= k:
                assert sorted(got.tolist()) == sorted(col[rowptr[v] : rowptr[v + 1]].tolist())


@pytest.mark.parametrize("fanouts", [[5, 3], [15, 10, 5], [-1, 2]])
def test_sampler_invariants(fanouts):
    ei, rowptr, col, perm = _graph()
    s = NeighborSampler(rowptr, col, fanouts, generator=torch.Generator().manual_seed(1))
    seeds = torch.tensor([0, 7, 3, 99, 250])
    _check_invariants(rowptr, col, perm, ei, fanouts, seeds, s.sample(seeds))


def _chi2_quantile(dof: int, p: float = 0.999) -> float:
    # Wilson-Hilferty: chi2_q ~ dof * (1 - 2/(9 dof) + z sqrt(2/(9 dof)))^3
    z = math.sqrt(2) * torch.erfinv(torch.tensor(2 * p - 1.0, dtype=torch.float64)).item()
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("deg,k", [(20, 5), (12, 11), (16, 10), (300, 15), (31, 15)])
def test_sampler_uniform_chi_square(deg, k):
    # One target with `deg` in-neighbors; each neighbor must be drawn with probability k / deg.
    ei = torch.stack([torch.arange(1, deg + 1), torch.zeros(deg, dtype=torch.long)])
    rowptr, col, _ = to_csr(ei, deg + 1)
    s = NeighborSampler(rowptr, col, [k], generator=torch.Generator().manual_seed(3))
    trials = 4000
    owner, pos = s.sample_positions(torch.zeros(trials, dtype=torch.long), k)  # 4000 independent draws
    assert torch.bincount(owner, minlength=trials).eq(k).all()
    key = owner * deg + pos
    assert key.unique().numel() == key.numel()  # k distinct per draw
    counts = torch.bincount(pos, minlength=deg).double()
    expected = trials * k / deg
    stat = ((counts - expected) ** 2 / expected).sum().item()
    assert stat < _chi2_quantile(deg - 1), (stat, counts)
    # The test can fail: a biased sampler (always the first k) is rejected by the same statistic.
    biased = torch.zeros(deg, dtype=torch.float64)
    biased[:k] = trials
    assert ((biased - expected) ** 2 / expected).sum().item() > _chi2_quantile(deg - 1)


def test_sampler_seeded_determinism():
    _, rowptr, col, _ = _graph()
    seeds = torch.tensor([0, 1, 2, 3])
    a = NeighborSampler(rowptr, col, [5, 5], generator=torch.Generator().manual_seed(5)).sample(seeds)
    b = NeighborSampler(rowptr, col, [5, 5], generator=torch.Generator().manual_seed(5)).sample(seeds)
    c = NeighborSampler(rowptr, col, [5, 5], generator=torch.Generator().manual_seed(6)).sample(seeds)
    assert torch.equal(a.n_id, b.n_id) and torch.equal(a.edge_index, b.edge_index)
    assert not torch.equal(a.e_id, c.e_id)


def test_loader_batches_train_pyg_sage():
    from torch_geometric.nn import GraphSAGE

    data = rmat_graph(3000, 30000, 16, 4, seed=2)
    loader = NeighborLoader(
        data, [10, 5], batch_size=128, shuffle=True, input_nodes=data.train_mask, prefetch=2
    )
    model = GraphSAGE(16, 32, 2, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen = 0
    for b in loader:
        b = b.cpu()  # (the loader's default device is the GPU where there is one)
        assert torch.equal(b.x, data.x[b.n_id]) and torch.equal(b.y, data.y[b.n_id])
        assert torch.equal(loader.input_nodes[b.input_id], b.n_id[: b.batch_size])
        out = model(b.x, b.edge_index, num_sampled_nodes_per_hop=b.num_sampled_nodes,
                    num_sampled_edges_per_hop=b.num_sampled_edges)[: b.batch_size]  # fmt: skip
        ref = model(b.x, b.edge_index)[: b.batch_size]  # trim_to_layer must not change seed outputs
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        loss = torch.nn.functional.cross_entropy(out, b.y[: b.batch_size])
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        seen += b.batch_size
    assert seen == int(data.train_mask.sum())


def test_loader_rejects_unsupported_pyg_kwargs():
    data = rmat_graph(100, 400, 4, 2)
    with pytest.raises(TypeError, match="replace"):
        NeighborLoader(data, [2], batch_size=4, replace=True)


@pytest.mark.parametrize("drop_last", [False, True])
def test_distributed_seed_split_disjoint_and_covering(drop_last):
    data = rmat_graph(1000, 4000, 4, 2)
    world = 3
    for epoch in (0, 1):
        shares = []
        for r in range(world):
            ld = NeighborLoader(data, [2], batch_size=32, shuffle=True, rank=r, world_size=world, seed=4,
                                drop_last=drop_last, prefetch=0)  # fmt: skip
            ld.set_epoch(epoch)
            shares.append(ld.rank_seeds())
        assert len({s.numel() for s in shares}) == 1  # equal counts: equal batch counts
        allseeds = torch.cat(shares)
        if drop_last:
            assert allseeds.unique().numel() == allseeds.numel() == 999  # disjoint (1000 // 3 * 3)
        else:
            assert allseeds.unique().numel() == 1000 and allseeds.numel() == 1002  # covering; 2 wrap-pads
            assert torch.cat(shares[:1]).unique().numel() == shares[0].numel()
    e0 = NeighborLoader(data, [2], shuffle=True, seed=4).rank_seeds()
    ld = NeighborLoader(data, [2], shuffle=True, seed=4)
    ld.set_epoch(1)
    assert not torch.equal(e0, ld.rank_seeds())  # the shuffle changes per epoch


@pytest.mark.gpu
def test_sampler_cuda_invariants():
    ei, rowptr, col, perm = _graph(device="cuda")
    for fanouts in ([15, 10, 5], [3, 3]):
        g = torch.Generator(device="cuda").manual_seed(0)
        s = NeighborSampler(rowptr, col, fanouts, generator=g)
        seeds = torch.tensor([0, 7, 3, 99, 250], device="cuda")
        _check_invariants(rowptr, col, perm, ei, fanouts, seeds.cpu(), s.sample(seeds))


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["host", "gpu"])
def test_loader_cuda_features_equal_index_select(placement):
    data = rmat_graph(5000, 50000, 33, 4, seed=9)
    loader = NeighborLoader(
        data, [10, 5], batch_size=256, shuffle=True, feature_placement=placement, device="cuda"
    )
    for b in loader:
        assert b.x.is_cuda and b.edge_index.is_cuda
        torch.testing.assert_close(b.x.cpu(), data.x.index_select(0, b.n_id.cpu()), rtol=0, atol=0)
        assert torch.equal(b.y.cpu(), data.y[b.n_id.cpu()])
    loader.close()


def test_loaders_share_one_unified_table():
    from dsx.direct import unified

    data = rmat_graph(2000, 20000, 12, 4, seed=5)
    x = data.x.clone()
    with unified(x, shared="off") as ux:
        data.x = ux
        a = NeighborLoader(data, [4, 4], batch_size=200, input_nodes=data.train_mask, prefetch=1)
        b = NeighborLoader(data, [4, 4], batch_size=200, input_nodes=data.val_mask, prefetch=0)
        for loader in (a, b):
            for batch in loader:
                assert torch.equal(batch.x.cpu(), x[batch.n_id.cpu()])
            loader.close()
        assert torch.equal(ux[torch.tensor([0, 5])], x[[0, 5]])  # still open after the loaders closed


def test_loader_from_csr_tensors_matches_data_input():
    data = rmat_graph(1500, 15000, 8, 3, seed=6)
    rowptr, col, _ = to_csr(data.edge_index, data.num_nodes)
    csr = {"rowptr": rowptr, "col": col, "x": data.x, "y": data.y}
    a = NeighborLoader(csr, [5, 5], batch_size=100, shuffle=True, seed=3, prefetch=0)
    b = NeighborLoader(data, [5, 5], batch_size=100, shuffle=True, seed=3, prefetch=2)
    n = 0
    for ba, bb in zip(a, b):  # same CSR, same seeds: identical batches, pipelined or not
        assert torch.equal(ba.n_id, bb.n_id) and torch.equal(ba.edge_index, bb.edge_index)
        assert torch.equal(ba.x, bb.x) and ba.num_sampled_edges == bb.num_sampled_edges
        n += 1
    assert n == len(a) == 15


def test_failed_hop_leaves_the_node_map_clean(monkeypatch):
    """An error in the middle of a hop (after claims were written to the node map) must not leak into the
    next call: the map is reset and the next sample equals a fresh sampler's."""
    _, rowptr, col, _ = _graph()
    seeds = torch.tensor([0, 5, 9])
    s = NeighborSampler(rowptr, col, [4, 3], generator=torch.Generator().manual_seed(2))
    real_take = s._take

    def failing_take(nodes, k, *args, **kwargs):
        if k == 3:  # sizing hop 1 happens after hop 0 wrote its claims and local ids to the map
            raise RuntimeError("injected failure mid-hop")
        return real_take(nodes, k, *args, **kwargs)

    monkeypatch.setattr(s, "_take", failing_take)
    with pytest.raises(RuntimeError, match="injected"):
        s.sample(seeds)
    monkeypatch.setattr(s, "_take", real_take)
    assert (s._map == -1).all()
    s.generator.manual_seed(7)
    got = s.sample(seeds)
    want = NeighborSampler(rowptr, col, [4, 3], generator=torch.Generator().manual_seed(7)).sample(seeds)
    assert torch.equal(got.n_id, want.n_id) and torch.equal(got.edge_index, want.edge_index)
