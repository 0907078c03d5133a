"""HeteroNeighborLoader against a brute-force reference: every sampled edge exists with its type, fanouts hold
per edge type and hop, features and labels match their node ids, PyG's hop layout (``trim_to_layer``), seeds
per rank and epoch, determinism with and without prefetch, and PyG's HGTConv on the batches."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch_geometric.nn as pygnn
from torch.utils._python_dispatch import TorchDispatchMode
from torch_geometric.data import HeteroData
from torch_geometric.utils import trim_to_layer

import dsx.rgnn as rg
from dsx.config import SchedulerConfig
from dsx.direct import (
    HeteroNeighborLoader,
    HeteroNeighborSampler,
    unified,
)
from dsx.direct.sampler import to_csr
from dsx.models.hetero_gnn import HeteroClassifier
from dsx.runtime.scheduler import Scheduler
from tests.harness import REPO, launch

# the launched test is about gloo ranks on CPU, also on a machine with GPUs (as many ranks as it has or not)
CPU_RANKS = {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
WRITES, REV_WRITES = ("author", "writes", "paper"), ("paper", "rev_writes", "author")
CITES, TOPIC, REV_TOPIC = (
    ("paper", "cites", "paper"),
    ("paper", "has_topic", "field"),
    ("field", "rev_has_topic", "paper"),
)


def hetero_graph(seed: int = 0) -> HeteroData:
    """3 node types, 5 edge types (two reverse pairs), skewed degrees: endpoints ``floor(n u^2)`` favour low
    ids, paper 0 is cited by every other paper, and a few fields collect most topics."""
    g = torch.Generator().manual_seed(seed)
    n = {"paper": 90, "author": 50, "field": 12}

    def edges(src: str, dst: str, m: int) -> torch.Tensor:
        s = (n[src] * torch.rand(m, generator=g) ** 2).long()
        d = (n[dst] * torch.rand(m, generator=g) ** 2).long()
        return torch.stack([s, d])

    data = HeteroData()
    for t, c in n.items():
        data[t].x = torch.randn(c, 8, generator=g)
    data["paper"].y = torch.randint(0, 4, (n["paper"],), generator=g)
    data["author"].y = torch.randint(0, 4, (n["author"],), generator=g)
    data[WRITES].edge_index = edges("author", "paper", 260)
    data[REV_WRITES].edge_index = data[WRITES].edge_index.flip(0)
    hub = torch.stack([torch.arange(1, n["paper"]), torch.zeros(n["paper"] - 1, dtype=torch.long)])
    data[CITES].edge_index = torch.cat([edges("paper", "paper", 300), hub], 1)
    data[TOPIC].edge_index = edges("paper", "field", 150)
    data[REV_TOPIC].edge_index = data[TOPIC].edge_index.flip(0)
    return data


@pytest.fixture(scope="module")
def data() -> HeteroData:
    return hetero_graph()


def check_batch(
    data: HeteroData, batch: HeteroData, fanouts: dict, input_type: str, seeds: torch.Tensor
) -> None:
    """Brute-force reference: raises AssertionError where ``batch`` breaks PyG's hetero NeighborLoader layout."""
    hops = len(next(iter(fanouts.values())))
    bs = batch[input_type].batch_size
    n_id = {t: batch[t].n_id.cpu() for t in data.node_types}
    nsn, nse = batch.num_sampled_nodes_dict, batch.num_sampled_edges_dict
    bound = {t: [0, *torch.tensor(nsn[t]).cumsum(0).tolist()] for t in data.node_types}  # local id per hop
    for t in data.node_types:
        ids = n_id[t]
        assert len(nsn[t]) == hops + 1 and bound[t][-1] == ids.numel() == batch[t].num_nodes
        assert nsn[t][0] == (bs if t == input_type else 0)
        assert ids.unique().numel() == ids.numel()  # one local id per node
        for key in ("x", "y"):
            if key in data[t]:
                assert torch.equal(batch[t][key].cpu(), data[t][key][ids]), (t, key)
    assert bs == seeds.numel() and torch.equal(n_id[input_type][:bs], seeds)
    assert batch[input_type].input_id.numel() == bs  # positions in input_nodes (checked where they are known)
    hop_sources: dict[tuple[str, int], list[torch.Tensor]] = {}
    for et in data.edge_types:
        s, _, d = et
        ei, eid = batch[et].edge_index.cpu(), batch[et].e_id.cpu()
        assert len(nse[et]) == hops and sum(nse[et]) == ei.shape[1] == eid.numel()
        assert eid.unique().numel() == eid.numel()  # without replacement: an edge at most once
        src, dst = n_id[s][ei[0]], n_id[d][ei[1]]
        full = data[et].edge_index
        pairs = set(zip(full[0].tolist(), full[1].tolist()))
        assert all(p in pairs for p in zip(src.tolist(), dst.tolist())), f"{et}: an edge not in the graph"
        assert torch.equal(full[:, eid], torch.stack([src, dst])), f"{et}: e_id names other edges"
        deg = torch.bincount(full[1], minlength=data[d].num_nodes)
        lo = 0
        for h in range(hops):
            part = ei[:, lo : lo + nse[et][h]]
            lo += nse[et][h]
            f_lo, f_hi = bound[d][h], bound[d][h + 1]  # hop h samples the nodes of d first reached at h - 1
            assert ((part[1] >= f_lo) & (part[1] < f_hi)).all(), (
                f"{et} hop {h}: destination outside its frontier"
            )
            assert (part[0] < bound[s][h + 2]).all(), f"{et} hop {h}: source numbered after its hop"
            k = fanouts[et][h]
            want = deg[n_id[d][f_lo:f_hi]]
            want = want if k < 0 else want.clamp(max=k)
            got = torch.bincount(part[1] - f_lo, minlength=f_hi - f_lo)
            assert torch.equal(got, want), f"{et} hop {h}: sampled in-edges != min(degree, {k})"
            hop_sources.setdefault((s, h), []).append(part[0])
    for t in data.node_types:  # each hop's new nodes: numbered in order of first appearance as a source
        for h in range(hops):
            srcs = torch.cat(hop_sources.get((t, h), [torch.empty(0, dtype=torch.long)]))
            new = srcs[srcs >= bound[t][h + 1]]
            order = [] if not new.numel() else list(dict.fromkeys(new.tolist()))
            assert order == list(range(bound[t][h + 1], bound[t][h + 2])), f"{t} hop {h}: PyG node order"


FANOUTS = {
    "list": [4, 3],
    "all-then-2": [-1, 2],
    "dict": {WRITES: [2, 0], REV_WRITES: [3, 2], CITES: [5, 1], TOPIC: [1, 1], REV_TOPIC: [0, 4]},
    # every edge and a few in one hop: rows of both kinds in one draw
    "dict with all": {WRITES: [-1, 2], REV_WRITES: [3, -1], CITES: [2, 3], TOPIC: [-1, 0], REV_TOPIC: [2, 2]},
}


def _fanouts(spec, data):
    return spec if isinstance(spec, dict) else {et: spec for et in data.edge_types}


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("name", list(FANOUTS))
def test_batches_match_the_brute_force_reference(data, name, device) -> None:
    spec = FANOUTS[name]
    mask = torch.rand(90, generator=torch.Generator().manual_seed(1)) < 0.6
    loader = HeteroNeighborLoader(data, spec, ("paper", mask), batch_size=16, shuffle=True, prefetch=0,
                                  device=device, seed=3)  # fmt: skip
    batches = list(loader)
    assert len(batches) == len(loader) == -(-int(mask.sum()) // 16)
    seeds = torch.split(loader.rank_seeds(), 16)
    assert torch.equal(torch.sort(loader.rank_seeds()).values, mask.nonzero().flatten())
    for b, s in zip(batches, seeds, strict=True):
        check_batch(data, b, _fanouts(spec, data), "paper", s)
        # as in PyG: input_id is the seeds' positions in input_nodes (the mask's nonzero ids), not their ids
        assert torch.equal(loader.input_nodes[b["paper"].input_id.cpu()], s)
    assert torch.equal(torch.cat([b["paper"].input_id.cpu() for b in batches]), loader.rank_positions())
    # Hub paper 0 (cited by every paper) is sampled at exactly its fanout when it is a seed.
    hub = HeteroNeighborLoader(data, spec, ("paper", torch.tensor([0])), prefetch=0, device=device)
    b = next(iter(hub))
    k, deg = _fanouts(spec, data)[CITES][0], int((data[CITES].edge_index[1] == 0).sum())
    assert deg > 89 and b[CITES].num_sampled_edges[0] == (deg if k < 0 else k)
    check_batch(data, b, _fanouts(spec, data), "paper", torch.tensor([0]))
    loader.close()


@pytest.mark.parametrize(
    "corrupt",
    ["edge remapped", "edge of another type", "feature row", "fanout exceeded", "seed order", "hop counts"],
)
def test_the_reference_rejects_a_corrupted_batch(data, corrupt) -> None:
    loader = HeteroNeighborLoader(data, [4, 3], ("paper", None), batch_size=20, prefetch=0)
    seeds = loader.rank_seeds()[:20]
    b = next(iter(loader))
    check_batch(data, b, _fanouts([4, 3], data), "paper", seeds)  # the real batch passes
    ei = b[WRITES].edge_index
    if corrupt == "edge remapped":  # one source id off by one
        ei[0, 0] = (ei[0, 0] + 1) % b["author"].num_nodes
    elif corrupt == "edge of another type":  # cites edges relabelled as writes-by-paper-ids
        b[CITES].edge_index = b[CITES].edge_index.flip(0)
    elif corrupt == "feature row":
        b["author"].x[[0, 1]] = b["author"].x[[1, 0]]
    elif corrupt == "fanout exceeded":  # an edge duplicated: one destination gets one more in-edge
        b[WRITES].edge_index = torch.cat([ei, ei[:, :1]], 1)
        b[WRITES].e_id = torch.cat([b[WRITES].e_id, b[WRITES].e_id[:1]])
        b[WRITES].num_sampled_edges = [b[WRITES].num_sampled_edges[0] + 1, *b[WRITES].num_sampled_edges[1:]]
    elif corrupt == "seed order":
        b["paper"].n_id[[0, 1]] = b["paper"].n_id[[1, 0]]
    else:
        nsn = b["author"].num_sampled_nodes
        b["author"].num_sampled_nodes = [nsn[0], nsn[1] - 1, nsn[2] + 1]
    with pytest.raises(AssertionError):
        check_batch(data, b, _fanouts([4, 3], data), "paper", seeds)


def test_pyg_options_and_bad_arguments_fail_with_names(data) -> None:
    with pytest.raises(TypeError, match=r"replace.*PyG NeighborLoader options not implemented"):
        HeteroNeighborLoader(data, [2], ("paper", None), replace=True)
    with pytest.raises(TypeError, match="num_workers"):
        HeteroNeighborLoader(data, [2], "paper", num_workers=4)
    with pytest.raises(ValueError, match=r"missing the edge types \[\('paper', 'rev_writes', 'author'\)"):
        HeteroNeighborLoader(data, {et: [2] for et in data.edge_types if et != REV_WRITES}, "paper")
    with pytest.raises(ValueError, match=r"not in the graph.*'venue'"):
        HeteroNeighborLoader(
            data, {**{et: [2] for et in data.edge_types}, ("venue", "x", "paper"): [1]}, "paper"
        )
    with pytest.raises(ValueError, match="same, non-zero number of hops"):
        HeteroNeighborLoader(data, {et: [2] if et != CITES else [2, 2] for et in data.edge_types}, "paper")
    with pytest.raises(ValueError, match="node type 'venue'"):
        HeteroNeighborLoader(data, [2], ("venue", None))
    with pytest.raises(TypeError, match="HeteroData"):
        HeteroNeighborLoader(data.to_homogeneous(), [2], "paper")
    bad = hetero_graph()
    bad[CITES].edge_index[0, 5] = 90
    with pytest.raises(ValueError, match=r"\('paper', 'cites', 'paper'\): node ids out of range"):
        HeteroNeighborLoader(bad, [2], "paper")


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_edge_types_given_as_csrs_sample_the_same_batches(data, device) -> None:
    """Edge types stored as ``rowptr`` / ``col`` (int32 or int64 sources) give the batches that their edge
    lists give, with CSR positions as ``e_id``."""
    as_csr, perm = hetero_graph(), {}
    for i, et in enumerate(as_csr.edge_types):
        if i % 2 == 0:  # half the types: a graph may mix the two forms
            rowptr, col, perm[et] = to_csr(as_csr[et].edge_index, as_csr[et[2]].num_nodes)
            del as_csr[et].edge_index
            as_csr[et].rowptr, as_csr[et].col = rowptr, col.int() if i % 4 == 0 else col
    kw = dict(batch_size=16, shuffle=True, seed=2, device=device, prefetch=0)
    coo = HeteroNeighborLoader(data, [3, 2], ("paper", None), **kw)
    csr = HeteroNeighborLoader(as_csr, [3, 2], ("paper", None), **kw)
    batches = 0
    for a, b in zip(coo, csr, strict=True):
        for et, p in perm.items():
            assert torch.equal(a[et].e_id.cpu(), p[b[et].e_id.cpu()])  # CSR position p is edge perm[p]
            b[et].e_id = a[et].e_id
        assert _same(a, b)
        batches += 1
    assert batches == len(coo) > 1


def test_a_bad_csr_is_named(data) -> None:
    def with_csr(**change) -> HeteroData:
        g = hetero_graph()
        rowptr, col, _ = to_csr(g[CITES].edge_index, 90)
        del g[CITES].edge_index
        g[CITES].rowptr, g[CITES].col = change.get("rowptr", rowptr), change.get("col", col)
        return g

    rowptr, col, _ = to_csr(data[CITES].edge_index, 90)
    cases = {
        r"1-D of num_nodes \+ 1 = 91": with_csr(rowptr=rowptr[:-1]),
        r"end at len\(col\) = 390; it starts at 0, ends at 389": with_csr(col=torch.cat([col, col[:1]])),
        "decreases": with_csr(rowptr=rowptr.index_put((torch.tensor([3]),), rowptr[10])),
        r"source ids in col lie in \[0, 90\], outside \[0, 90\)": with_csr(
            col=col.index_fill(0, col[:1] * 0, 90)
        ),
        "int32 or int64": with_csr(col=col.float()),
        "give both rowptr and col": with_csr(col=None),
    }
    for message, g in cases.items():
        with pytest.raises(ValueError, match=rf"\('paper', 'cites', 'paper'\).*{message}"):
            HeteroNeighborLoader(g, [2], "paper")


def test_seed_inputs_and_types_without_features(data) -> None:
    plain = HeteroData()  # "field" has neither x nor y: only its ids come back
    plain["paper"].x, plain["field"].num_nodes = data["paper"].x, 12
    plain[TOPIC].edge_index, plain[REV_TOPIC].edge_index = data[TOPIC].edge_index, data[REV_TOPIC].edge_index
    ld = HeteroNeighborLoader(
        plain, [3, 3], ("field", torch.tensor([4, 0, 2])), batch_size=2, prefetch=0, device="cpu"
    )
    batches = list(ld)
    assert [b["field"].batch_size for b in batches] == [2, 1] and "x" not in batches[0]["field"]
    for b, s in zip(batches, [torch.tensor([4, 0]), torch.tensor([2])]):
        check_batch(plain, b, _fanouts([3, 3], plain), "field", s)
    assert [b["field"].input_id.tolist() for b in batches] == [[0, 1], [2]]  # positions in input_nodes
    assert len(HeteroNeighborLoader(plain, [1], "field", batch_size=5)) == 3  # a node type: all its nodes
    # x given as a UnifiedTensor: used as is and left open by close().
    with unified(data["author"].x.clone(), shared="off") as ut:
        shared = hetero_graph()
        shared["author"].x = ut
        ld = HeteroNeighborLoader(shared, [3], ("author", None), batch_size=25, prefetch=0, device="cpu")
        for b in ld:
            assert torch.equal(b["author"].x, data["author"].x[b["author"].n_id])
        ld.close()
        assert ld._unified_tensors() == [ut]


def test_seeds_per_rank_epoch_shuffle_and_drop_last(data) -> None:
    kw = dict(batch_size=7, shuffle=True, seed=4, prefetch=0)
    for drop_last in (False, True):
        ranks = [HeteroNeighborLoader(data, [2], ("author", None), rank=r, world_size=3, drop_last=drop_last, **kw)
                 for r in range(3)]  # fmt: skip
        per = [ld.rank_seeds() for ld in ranks]
        assert len({p.numel() for p in per}) == 1  # equal counts: no rank waits for another
        allr = torch.cat(per)
        if drop_last:
            assert allr.unique().numel() == allr.numel() == 48  # disjoint, 50 // 3 * 3
            assert all(len(ld) == 16 // 7 for ld in ranks)
            assert all(b["author"].batch_size == 7 for b in ranks[0])
        else:
            assert set(allr.tolist()) == set(range(50)) and allr.numel() == 51  # covering, wrapped
            assert [b["author"].batch_size for b in ranks[1]] == [7, 7, 3]
        ranks[0].set_epoch(1)
        assert not torch.equal(ranks[0].rank_seeds(), per[0])  # a new shuffle per epoch
        ranks[0].set_epoch(0)
        assert torch.equal(ranks[0].rank_seeds(), per[0])  # the same on every rank for the same epoch
    unshuffled = HeteroNeighborLoader(data, [2], ("author", None), batch_size=10)
    assert torch.equal(unshuffled.rank_seeds(), torch.arange(50))


@pytest.mark.slow
def test_distributed_variant_across_two_launched_ranks(tmp_path) -> None:
    """Two ranks through the deepspeed launcher (gloo): each takes its rank and world size from the process
    group, the ranks' seeds of an epoch are disjoint and cover every paper, every batch passes the reference
    check, and the shuffle changes from epoch to epoch."""
    res = launch(REPO / "tests/direct/_hetero_worker.py", [str(tmp_path)], 2, env=CPU_RANKS)
    res.check()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["loader"] for r in ranks] == [[0, 2], [1, 2]]
    for epoch in ("0", "1"):
        mine = [set(r["seeds"][epoch]) for r in ranks]
        assert not mine[0] & mine[1] and mine[0] | mine[1] == set(range(ranks[0]["num_papers"]))
    assert ranks[0]["seeds"]["0"] != ranks[0]["seeds"]["1"]


def _same(a: HeteroData, b: HeteroData) -> bool:
    return all(
        sorted(sa.keys()) == sorted(sb.keys())
        and all(torch.equal(sa[k], sb[k]) if torch.is_tensor(sa[k]) else sa[k] == sb[k] for k in sa.keys())
        for sa, sb in zip(a.stores, b.stores, strict=True)
    )


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_same_seed_same_batches_with_and_without_prefetch(data, device) -> None:
    sched = Scheduler(SchedulerConfig(), device=torch.device(device, 0) if device == "cuda" else None)
    kw = dict(batch_size=12, shuffle=True, seed=5, device=device, scheduler=sched)
    loaders = [HeteroNeighborLoader(data, [3, 2], ("paper", None), prefetch=p, **kw) for p in (0, 1, 3)]
    for epoch in range(2):
        runs = []
        for ld in loaders:
            ld.set_epoch(epoch)
            runs.append(list(ld))
        for other in runs[1:]:
            assert len(other) == len(runs[0]) and all(_same(a, b) for a, b in zip(runs[0], other))
    # A broken epoch leaves nothing running: the next epoch equals an unpipelined loader in the same state.
    for i, _ in enumerate(loaders[2]):
        if i == 1:
            break
    ref = loaders[0]
    ref.sampler.generator.set_state(loaders[2].sampler.generator.get_state())
    assert all(_same(a, b) for a, b in zip(loaders[2], ref, strict=True))
    other = HeteroNeighborLoader(data, [3, 2], ("paper", None), prefetch=0, **{**kw, "seed": 6})
    assert not all(_same(a, b) for a, b in zip(other, loaders[0]))
    for ld in loaders:
        ld.close()
    sched.close()


def _wide_rows_graph(n: int = 60_000, width: int = 2048) -> HeteroData:
    """Papers with 8 KB feature rows citing each other at random: a batch of 1024 seeds at fanouts [10, 10]
    gathers tens of thousands of rows, milliseconds over the host link."""
    g = torch.Generator().manual_seed(11)
    data = HeteroData()
    data["paper"].x = torch.randn(n, width, generator=g)
    data["paper"].y = torch.randint(0, 9, (n,), generator=g)
    data[CITES].edge_index = torch.randint(0, n, (2, 10 * n), generator=g)
    return data


@pytest.mark.gpu
def test_pipelined_batches_are_gathered_on_the_gather_stream_and_arrive_with_their_gathers_done() -> None:
    """Gathers run on the scheduler's ``"gather"`` stream, not the ``"loader"`` stream whose per-hop host
    reads would then wait for them. Each batch's gather takes milliseconds over the host link, and the step
    reads every batch's features at once on its own stream: a batch handed over before its gather finished
    compares unequal."""
    data = _wide_rows_graph()
    sched = Scheduler(SchedulerConfig(), device=torch.device("cuda", 0))
    loader = HeteroNeighborLoader(data, [10, 10], ("paper", None), batch_size=1024, shuffle=True, prefetch=2,
                                  device="cuda", scheduler=sched)  # fmt: skip
    want, labels = data["paper"].x.cuda(), data["paper"].y.cuda()
    ut = loader._x["paper"][1]
    streams: list[int] = []
    real = ut.gather

    def gather(*args, **kwargs):
        streams.append(torch.cuda.current_stream().stream_id)
        return real(*args, **kwargs)

    ut.gather = gather
    rows = 0
    for i, b in enumerate(loader):
        n_id = b["paper"].n_id
        assert torch.equal(b["paper"].x, want[n_id]), f"batch {i}: features read before their gather ended"
        assert torch.equal(b["paper"].y, labels[n_id])
        rows += n_id.numel()
        if i == 12:
            break
    assert rows > 13 * 10_000, rows  # over 10,000 rows of 8 KB a batch: each gather takes milliseconds
    assert streams and set(streams) == {sched.stream("gather").stream_id} != {
        sched.stream("loader").stream_id
    }
    loader.close()
    sched.close()


@pytest.mark.gpu
def test_a_transform_reads_the_gathered_features_unless_it_says_it_reads_none() -> None:
    """A transform runs on the loader stream after the batch's gathers on the gather stream: a copy of ``x`` it
    takes there equals the table's rows. ``dsx.rgnn.PrepareGraph`` says it reads no features, and runs beside
    the gathers; its batches come out whole too."""
    data = _wide_rows_graph()
    sched = Scheduler(SchedulerConfig(), device=torch.device("cuda", 0))
    want = data["paper"].x.cuda()

    def copy_x(batch):
        batch["paper"].x_seen = batch["paper"].x.clone()
        return batch

    loader = HeteroNeighborLoader(data, [10, 10], ("paper", None), batch_size=1024, shuffle=True, prefetch=2,
                                  device="cuda", scheduler=sched, transform=copy_x)  # fmt: skip
    for i, b in enumerate(loader):
        assert torch.equal(b["paper"].x_seen, want[b["paper"].n_id]), f"batch {i}: the transform ran early"
        if i == 12:
            break
    loader.close()
    model = HeteroClassifier("rgcn", data.metadata(), {"paper": 2048}, 16, 9).cuda()
    prep = rg.PrepareGraph(model)
    assert prep.reads_features is False
    loader = HeteroNeighborLoader(data, [10, 10], ("paper", None), batch_size=1024, shuffle=True, prefetch=2,
                                  device="cuda", scheduler=sched, transform=prep)  # fmt: skip
    for i, b in enumerate(loader):
        assert torch.equal(b["paper"].x, want[b["paper"].n_id]) and b.prepared_graph, f"batch {i}"
        if i == 6:
            break
    loader.close()
    sched.close()


def test_one_host_read_per_hop(data, monkeypatch) -> None:
    csr = {et: to_csr(data[et].edge_index, data[et[2]].num_nodes)[:2] for et in data.edge_types}
    nodes = {t: data[t].num_nodes for t in data.node_types}
    s = HeteroNeighborSampler(
        csr, nodes, {et: [3, 3, 2] for et in csr}, generator=torch.Generator().manual_seed(0)
    )
    reads = []
    for name in ("tolist", "item", "__int__", "__bool__", "__float__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _r=real, _n=name: reads.append(_n) or _r(self, *a)
        )
    out = s.sample("paper", torch.tensor([3, 0, 7]))
    monkeypatch.undo()
    # The seeds' range check (host seeds: no device sync), the first hop's edge counts, then one per hop.
    assert reads == ["tolist"] * (1 + 1 + 3), reads
    assert (s._map == -1).all()  # the map is clean for the next call
    assert sum(out.num_sampled_edges[CITES]) > 0


def test_int32_sources_beside_int64_ones_are_read_as_given(data) -> None:
    csr = {et: to_csr(data[et].edge_index, data[et[2]].num_nodes)[:2] for et in data.edge_types}
    narrow = {**csr, CITES: (csr[CITES][0], csr[CITES][1].int())}
    nodes = {t: data[t].num_nodes for t in data.node_types}
    outs = []
    for given in (csr, narrow):
        s = HeteroNeighborSampler(given, nodes, {et: [4, 3] for et in given},
                                  generator=torch.Generator().manual_seed(2))  # fmt: skip
        outs.append(s.sample("paper", torch.arange(0, 90, 4)))
    assert s.col[CITES] is narrow[CITES][1]  # not widened: a copy of a whole col
    for et in data.edge_types:  # the same draws, the same batch
        assert torch.equal(outs[0].edge_index[et], outs[1].edge_index[et]), et
    assert all(torch.equal(outs[0].n_id[t], outs[1].n_id[t]) for t in nodes)


def test_samplers_on_the_same_pointers_share_one_joined_copy(data) -> None:
    csr = {et: to_csr(data[et].edge_index, data[et[2]].num_nodes)[:2] for et in data.edge_types}
    nodes = {t: data[t].num_nodes for t in data.node_types}
    fanouts = {et: [2] for et in csr}
    train, val = (HeteroNeighborSampler(csr, nodes, fanouts) for _ in range(2))
    assert val.rowptr is train.rowptr  # (a training and a validation loader on one graph)
    csr[CITES][0].add_(0)  # written in place: the copy may no longer match it
    fresh = HeteroNeighborSampler(csr, nodes, fanouts)
    assert fresh.rowptr is not train.rowptr and torch.equal(fresh.rowptr, train.rowptr)
    other = {**csr, CITES: (csr[CITES][0].clone(), csr[CITES][1])}
    assert HeteroNeighborSampler(other, nodes, fanouts).rowptr is not fresh.rowptr


@pytest.mark.gpu
def test_one_host_synchronisation_per_hop_on_cuda(data) -> None:
    """On CUDA the hop's one read is the only wait: CUDA's sync debug mode names every other (a small host
    table copied from pageable memory would be one), which the read count above cannot see."""
    csr = {
        et: tuple(c.cuda() for c in to_csr(data[et].edge_index, data[et[2]].num_nodes)[:2])
        for et in data.edge_types
    }
    nodes = {t: data[t].num_nodes for t in data.node_types}
    s = HeteroNeighborSampler(csr, nodes, {et: [3, -1, 2] if et != CITES else [2, 3, 0] for et in csr},
                              generator=torch.Generator("cuda").manual_seed(0))  # fmt: skip
    seeds = torch.tensor([3, 0, 7])
    s.sample("paper", seeds)  # (the first call allocates)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = s.sample("paper", seeds)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    waits = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(waits) == 1 + 3, waits  # the first hop's edge counts, then one read a hop
    assert sum(out.num_sampled_edges[CITES]) > 0


class _TorchCalls(TorchDispatchMode):
    """Counts the torch calls that compute (views excluded): on a GPU each is a launch."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += not func.is_view
        return func(*args, **(kwargs or {}))


def test_a_hop_samples_every_edge_type_in_one_set_of_calls() -> None:
    """The same edges split into more edge types add only each edge type's source reads and outputs (four
    calls each over two hops), not a sampling of its own (dozens of calls each)."""
    g = torch.Generator().manual_seed(0)
    cites = torch.randint(0, 300, (2, 4000), generator=g)
    writes = torch.stack(
        [torch.randint(0, 100, (1500,), generator=g), torch.randint(0, 300, (1500,), generator=g)]
    )
    calls = {}
    for parts in (1, 6):
        csr = {("author", "writes", "paper"): to_csr(writes, 300)[:2]}
        for i in range(parts):
            csr[("paper", f"cites_{i}", "paper")] = to_csr(cites[:, i::parts], 300)[:2]
        s = HeteroNeighborSampler(csr, {"paper": 300, "author": 100}, {et: [5, 4] for et in csr},
                                  generator=torch.Generator().manual_seed(1))  # fmt: skip
        seeds = torch.arange(0, 300, 7)
        s.sample("paper", seeds)  # (the first call may allocate)
        with _TorchCalls() as counter:
            out = s.sample("paper", seeds)
        assert all(n > 0 for et, ns in out.num_sampled_edges.items() for n in ns), out.num_sampled_edges
        calls[parts] = counter.calls
    assert calls[6] - calls[1] <= 4 * 5, calls


def test_pyg_trim_to_layer_keeps_the_seeds_outputs(data) -> None:
    torch.manual_seed(0)
    convs = [pygnn.HeteroConv({et: pygnn.SAGEConv((i, i), 16) for et in data.edge_types}) for i in (8, 16)]
    loader = HeteroNeighborLoader(data, [4, 3], ("paper", None), batch_size=24, prefetch=0, device="cpu")
    for b in loader:
        outs = []
        for trim in (False, True):
            x, ei = b.x_dict, b.edge_index_dict
            for i, conv in enumerate(convs):
                if trim:
                    x, ei, _ = trim_to_layer(i, b.num_sampled_nodes_dict, b.num_sampled_edges_dict, x, ei)
                x = {t: v.relu() for t, v in conv(x, ei).items()}
            outs.append(x["paper"][: b["paper"].batch_size])
        torch.testing.assert_close(outs[1], outs[0])
        x, ei, _ = trim_to_layer(
            1, b.num_sampled_nodes_dict, b.num_sampled_edges_dict, b.x_dict, b.edge_index_dict
        )
        assert all(v.size(0) == sum(b[t].num_sampled_nodes[:2]) for t, v in x.items())
        assert all(e.size(1) == b[k].num_sampled_edges[0] for k, e in ei.items())


def test_dsx_and_pyg_hgtconv_agree_on_a_batch(data) -> None:
    torch.manual_seed(0)
    theirs = pygnn.HGTConv(8, 8, data.metadata(), heads=2)
    with torch.no_grad():  # PyG initialises skip / p_rel to ones: perturb so that every parameter matters
        for p in theirs.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ours = rg.HGTConv(8, 8, data.metadata(), heads=2)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    loader = HeteroNeighborLoader(data, [4, 3], ("paper", None), batch_size=32, prefetch=0, device="cpu")
    for b in loader:
        want, got = theirs(b.x_dict, b.edge_index_dict), ours(b.x_dict, b.edge_index_dict)
        assert sorted(got) == sorted(want) == ["author", "field", "paper"]
        for t in want:
            torch.testing.assert_close(got[t], want[t], atol=2e-5, rtol=1e-4)
