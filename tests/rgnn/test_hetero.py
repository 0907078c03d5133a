"""dsx.rgnn on HeteroData batches: the typed layout is PyG's homogeneous view, RGCN / RGAT through
RelationalHetero match PyG's layers on ``HeteroData.to_homogeneous()`` of the same sampled batch (outputs and
gradients), the layout is shared by a model's layers, and bad input is named."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch_geometric.nn as pygnn

import dsx.rgnn as rg
from dsx.direct import HeteroNeighborLoader
from dsx.id_bounds import vouch, vouched_within
from tests.direct.test_hetero_loader import CITES, WRITES, _TorchCalls, hetero_graph

# the fused path on the PyTorch twins, and with the generated Triton kernels under Triton's interpreter
BACKENDS = [("kernels", "reference"), ("kernels", "interpret")]
LAYERS = {
    "rgcn_mean": lambda r, **kw: (pygnn.RGCNConv(8, 6, r), rg.RGCNConv(8, 6, r, **kw)),
    "rgcn_sum_bases": lambda r, **kw: (
        pygnn.RGCNConv(8, 6, r, aggr="sum", num_bases=2),
        rg.RGCNConv(8, 6, r, aggr="sum", num_bases=2, **kw),
    ),
    "rgat_heads": lambda r, **kw: (pygnn.RGATConv(8, 3, r, heads=2), rg.RGATConv(8, 3, r, heads=2, **kw)),
}


@pytest.fixture(scope="module")
def data():
    return hetero_graph(seed=4)


def _batches(data, n: int = 2):
    # on the CPU also where a GPU is present: the loader's device path is tested in tests/direct
    loader = HeteroNeighborLoader(
        data, [4, 3], ("paper", None), batch_size=16, shuffle=True, prefetch=0, seed=1, device="cpu"
    )
    out = []
    for b in loader:
        out.append(b)
        if len(out) == n:
            return out
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_layout_is_pygs_homogeneous_view(data, device) -> None:
    for b in [data, *_batches(data)]:
        sizes = {t: b[t].num_nodes for t in b.node_types}
        edges = {e: ei.to(device) for e, ei in b.edge_index_dict.items()}
        layout = rg.typed_layout(sizes, edges, b.edge_types)
        narrow = rg.typed_layout(sizes, {e: ei.int() for e, ei in edges.items()}, b.edge_types)
        assert torch.equal(narrow.edge_index, layout.edge_index)
        h = b.to_homogeneous()
        assert layout.edge_index.device.type == device
        assert torch.equal(layout.edge_index.cpu(), h.edge_index)
        assert torch.equal(layout.edge_type.cpu(), h.edge_type)
        far = dict(edges)
        far[CITES] = edges[CITES].clone()
        far[CITES][0, -1] = sizes["paper"]
        with pytest.raises(ValueError, match=r"\('paper', 'cites', 'paper'\): node ids out of range"):
            rg.typed_layout(sizes, far, b.edge_types)
        node_type = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(list(sizes.values())))
        assert torch.equal(node_type, h.node_type)


@pytest.mark.parametrize("backend,kb", BACKENDS)
@pytest.mark.parametrize("layer", list(LAYERS))
def test_relational_layers_on_a_batch_match_pyg_on_its_homogeneous_view(data, layer, backend, kb) -> None:
    torch.manual_seed(0)
    meta = data.metadata()
    theirs, conv = LAYERS[layer](len(meta[1]), backend=backend, kernel_backend=kb)
    ours = rg.RelationalHetero(conv, meta)
    conv.load_state_dict(theirs.state_dict(), strict=True)
    for b in _batches(data):
        h = b.to_homogeneous()
        cot = torch.randn(h.num_nodes, 6)
        # PyG's layer on PyG's homogeneous view of the batch, split back per node type
        x_ref = h.x.clone().requires_grad_(True)
        theirs.zero_grad()
        want = theirs(x_ref, h.edge_index, h.edge_type)
        (want * cot).sum().backward()
        x_dict = {t: x.clone().requires_grad_(True) for t, x in b.x_dict.items()}
        conv.zero_grad()
        got = ours(x_dict, b.edge_index_dict)
        assert sorted(got) == ["author", "field", "paper"]
        got_all = torch.cat([got[t] for t in b.node_types])
        (got_all * cot).sum().backward()
        torch.testing.assert_close(got_all, want, atol=2e-5, rtol=1e-4)
        x_grad = torch.cat([x_dict[t].grad for t in b.node_types])
        torch.testing.assert_close(x_grad, x_ref.grad, atol=2e-5, rtol=1e-4)
        for (name, p), q in zip(
            sorted(conv.named_parameters()), [q for _, q in sorted(theirs.named_parameters())]
        ):
            if q.grad is None:  # PyG's RGAT "mod" parameters take no part in these options
                continue
            torch.testing.assert_close(
                p.grad, q.grad, atol=2e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
            )


def test_a_models_layers_share_one_layout_and_an_edit_rebuilds_it(data) -> None:
    (b,) = _batches(data, 1)
    sizes = {t: b[t].num_nodes for t in b.node_types}
    first = rg.typed_layout(sizes, b.edge_index_dict, b.edge_types)
    assert rg.typed_layout(sizes, b.edge_index_dict, b.edge_types) is first
    # the second layer of a model gets the first layer's prepared graph from prepare's cache
    g = rg.prepare(first.edge_index, first.edge_type, first.num_nodes, len(b.edge_types))
    again = rg.typed_layout(sizes, b.edge_index_dict, b.edge_types)
    assert rg.prepare(again.edge_index, again.edge_type, again.num_nodes, len(b.edge_types)) is g
    b[CITES].edge_index.add_(0)  # an in-place edit of one edge type's ids: a new layout
    assert rg.typed_layout(sizes, b.edge_index_dict, b.edge_types) is not first
    with torch.inference_mode():  # inference tensors have no version to check: never reused
        ei = {k: v.clone() for k, v in b.edge_index_dict.items()}
        assert rg.typed_layout(sizes, ei, b.edge_types) is not rg.typed_layout(sizes, ei, b.edge_types)


def test_an_edge_type_missing_from_a_batch_keeps_the_others_relation_ids(data) -> None:
    (b,) = _batches(data, 1)
    sizes = {t: b[t].num_nodes for t in b.node_types}
    some = {k: v for k, v in b.edge_index_dict.items() if k != WRITES}
    layout = rg.typed_layout(sizes, some, b.edge_types)
    want = torch.cat([torch.full((v.size(1),), b.edge_types.index(k)) for k, v in some.items()])
    assert torch.equal(layout.edge_type, want)
    empty = rg.typed_layout(sizes, {CITES: torch.zeros(2, 0, dtype=torch.long)}, b.edge_types)
    assert empty.edge_index.shape == (2, 0)


def test_bad_input_is_named(data) -> None:
    meta = data.metadata()
    sizes = {t: data[t].num_nodes for t in data.node_types}
    eid = dict(data.edge_index_dict)
    with pytest.raises(ValueError, match=r"\('paper', 'cited_by', 'paper'\) is not in the metadata"):
        rg.typed_layout(sizes, {("paper", "cited_by", "paper"): eid[CITES]}, meta[1])
    bad = eid[CITES].clone()
    bad[1, 3] = sizes["paper"]
    with pytest.raises(ValueError, match=r"\('paper', 'cites', 'paper'\): node ids out of range"):
        rg.typed_layout(sizes, {**eid, CITES: bad}, meta[1])
    # an id one past its type's last, where the type is not first in the layout (its ids start above 0)
    far = eid[WRITES].clone()
    far[0, 2] = sizes["author"]
    assert list(sizes).index("author") > 0
    with pytest.raises(ValueError, match=r"\('author', 'writes', 'paper'\): node ids out of range"):
        rg.typed_layout(sizes, {**eid, WRITES: far}, meta[1])
    negative = eid[WRITES].clone()
    negative[0, 5] = -1
    with pytest.raises(
        ValueError, match=r"\('author', 'writes', 'paper'\): node ids out of range.*smallest -1"
    ):
        rg.typed_layout(sizes, {**eid, WRITES: negative}, meta[1])
    with pytest.raises(ValueError, match="needs node types 'author'"):
        rg.typed_layout({"paper": sizes["paper"]}, {WRITES: eid[WRITES]}, meta[1])
    with pytest.raises(TypeError, match="int32 or int64"):
        rg.typed_layout(sizes, {CITES: eid[CITES].float()}, meta[1])
    with pytest.raises(ValueError, match="num_relations=3; the metadata has 5 edge types"):
        rg.RelationalHetero(rg.RGCNConv(8, 6, 3), meta)
    conv = rg.RelationalHetero(rg.RGCNConv(8, 6, 5), meta)
    x = dict(data.x_dict)
    x["field"] = torch.randn(sizes["field"], 4)
    with pytest.raises(ValueError, match="different feature widths"):
        conv(x, eid)
    with pytest.raises(ValueError, match="a layout-order tensor needs sizes"):
        conv(torch.randn(sum(sizes.values()), 8), eid)
    with pytest.raises(ValueError, match=rf"tensor of {sum(sizes.values()) + 1} rows for sizes"):
        conv(torch.randn(sum(sizes.values()) + 1, 8), eid, sizes)


def test_a_batchs_graph_is_prepared_in_few_calls_as_from_separate_tensors(data, monkeypatch) -> None:
    """On a GPU preparation is a chain of small launches whose host time sets its cost: RGCN's typed layout and
    graph (the table path a GPU takes for a batch) in at most 24 torch calls for the loader's edge lists, whose
    ids it vouches for, and 28 with the range check of other edge lists, whatever the number of edge types; the
    layout's rows, gathered together, give the graph that separate tensors give; and a row kept from that
    gather (HGT keeps the relations) does not keep the other two alive."""
    import dsx.rgnn.graph as graph_mod

    monkeypatch.setattr(graph_mod, "_dense_fits", lambda keys, edges, device: True)
    b = _batches(data, 1)[0]
    sizes = {t: b[t].num_nodes for t in b.node_types}
    conv = rg.RelationalHetero(rg.RGCNConv(8, 6, len(b.edge_types)), b.metadata())
    calls, layouts = {}, {}
    for name, edges in (("vouched", b.edge_index_dict),
                        ("checked", {e: ei.clone() for e, ei in b.edge_index_dict.items()})):  # fmt: skip
        rg.clear_cache()
        conv.prepare_graph(sizes, edges, torch.device("cpu"))  # (the first call may allocate)
        rg.clear_cache()
        with _TorchCalls() as counter:
            layouts[name] = conv.prepare_graph(sizes, edges, torch.device("cpu"))[0]
        rg.clear_cache()
        calls[name] = counter.calls
    assert calls["vouched"] <= 24 and calls["checked"] <= 28, calls
    fields = ("src", "dst", "rel", "perm", "dst_row_idx", "dst_rel_ptr", "edge_dst_row", "inv_deg_rel")
    n, r = next(iter(layouts.values())).num_nodes, len(b.edge_types)
    for layout in layouts.values():
        ei, et = layout.edge_index, layout.edge_type
        apart = rg.prepare(ei.clone(), et.clone(), n, r, cache=False, needs=fields)
        assert graph_mod._rows_of_one(ei, et) is not None
        together = rg.prepare(ei, et, n, r, cache=False, needs=fields)
        for name in ("dst_ptr", "src_row_idx", "src_rel_ptr", "edge_src_row", *fields):
            assert torch.equal(getattr(together, name), getattr(apart, name)), name
        rel_only = rg.prepare(ei, et, n, r, cache=False, needs=("rel",))
        assert rel_only.rel.untyped_storage().nbytes() == 8 * rel_only.num_edges
        assert torch.equal(rel_only.rel, apart.rel)


def test_the_loaders_vouched_edge_lists_are_checked_once_edited_or_laid_over_fewer_nodes(data) -> None:
    """The layout skips the range check only for edge lists as the loader made them, over at least the node
    counts it made them for: edited in place, or laid out over fewer nodes, out-of-range ids are named."""
    b = _batches(data, 1)[0]
    sizes = {t: b[t].num_nodes for t in b.node_types}
    edges = dict(b.edge_index_dict)
    assert all(vouched_within(ei, (sizes[e[0]], sizes[e[-1]])) for e, ei in edges.items())
    rg.typed_layout(sizes, edges, b.edge_types, cache=False)
    edges[CITES][0, 0] = sizes["paper"]  # in place: the loader's promise no longer holds
    assert not vouched_within(edges[CITES], (sizes["paper"], sizes["paper"]))
    with pytest.raises(ValueError, match=r"\('paper', 'cites', 'paper'\): node ids out of range"):
        rg.typed_layout(sizes, edges, b.edge_types, cache=False)
    b = _batches(data, 1)[0]
    fewer = {t: b[t].num_nodes for t in b.node_types}
    fewer["author"] = int(b[WRITES].edge_index[0].max())  # the largest author id is now one past the last
    with pytest.raises(ValueError, match=r"\('author', 'writes', 'paper'\): node ids out of range"):
        rg.typed_layout(fewer, b.edge_index_dict, b.edge_types, cache=False)
    ei = torch.zeros(2, 3, dtype=torch.long)
    vouch(ei, (5, 5))
    assert (
        vouched_within(ei, (5, 6))
        and not vouched_within(ei, (4, 6))
        and not vouched_within(ei.clone(), (5, 5))
    )
    ei.data = torch.full((2, 3), 7)  # other memory, at the same version
    assert not vouched_within(ei, (5, 5))
    with torch.inference_mode():
        frozen = torch.zeros(2, 3, dtype=torch.long)
    vouch(frozen, (5, 5))  # no version counter: an edit could not be seen, so no promise is kept
    assert not vouched_within(frozen, (5, 5))


@pytest.mark.gpu
def test_a_loader_batchs_graph_waits_for_the_device_once_on_cuda(data) -> None:
    """RGCN's preparation of a loader batch on CUDA: the unique-pair map's size is its only wait (CUDA's sync
    debug mode names every other: the layout's range check, a table copied from pageable memory)."""
    loader = HeteroNeighborLoader(data, [4, 3], ("paper", None), batch_size=16, prefetch=0, device="cuda")
    b = next(iter(loader))
    sizes = {t: b[t].num_nodes for t in b.node_types}
    conv = rg.RelationalHetero(rg.RGCNConv(8, 6, len(b.edge_types)), b.metadata()).cuda()
    conv.prepare_graph(sizes, b.edge_index_dict, torch.device("cuda"))  # (the first call allocates)
    rg.clear_cache()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graph = conv.prepare_graph(sizes, b.edge_index_dict, torch.device("cuda"))[1]
    finally:
        torch.cuda.set_sync_debug_mode(0)
        rg.clear_cache()
    waits = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(waits) == 1, waits
    assert graph is not None and graph.num_edges > 0


def test_a_models_hgt_layers_share_one_prepared_graph_and_clear_cache_drops_it(data) -> None:
    (b,) = _batches(data, 1)
    convs = [rg.HGTConv(8, 8, data.metadata(), heads=2, kernel_backend="reference") for _ in range(2)]
    opts = convs[0].options()
    g1, off1 = convs[0]._homogeneous(b.x_dict, b.edge_index_dict, opts)
    g2, off2 = convs[1]._homogeneous(b.x_dict, b.edge_index_dict, opts)
    assert g1 is g2 and off1 == off2  # prepared once per batch, whatever the number of layers
    rg.clear_cache()
    assert convs[1]._homogeneous(b.x_dict, b.edge_index_dict, opts)[0] is not g1


def test_an_empty_layout_is_made_on_the_given_device(data) -> None:
    sizes = {t: data[t].num_nodes for t in data.node_types}
    layout = rg.typed_layout(sizes, {}, data.edge_types, device="meta")
    assert layout.edge_index.device.type == "meta" and layout.edge_index.shape == (2, 0)
    assert rg.typed_layout(sizes, {}, data.edge_types).edge_index.device.type == "cpu"


@pytest.mark.parametrize("model_name", ["rgcn", "rgat", "hgt"])
def test_prepare_graph_in_the_loader_serves_the_models_layers(data, model_name, monkeypatch) -> None:
    import threading

    from dsx.models.hetero_gnn import HeteroClassifier
    from dsx.rgnn import graph as graph_mod
    from dsx.rgnn import hetero as hetero_mod

    main = threading.current_thread()
    built_here = []
    for mod in (graph_mod, hetero_mod):  # count the graph builds that run on the training thread
        real = mod._build
        monkeypatch.setattr(
            mod, "_build", lambda *a, _r=real: built_here.append(threading.current_thread() is main) or _r(*a)
        )
    torch.manual_seed(0)
    model = HeteroClassifier(model_name, data.metadata(), {t: 8 for t in data.node_types}, 8, 4, heads=2)
    for conv in model.convs:  # the PyTorch twins: the graph, not the kernels, is under test
        (conv.conv if hasattr(conv, "conv") else conv).kernel_backend = "reference"
    opts = dict(batch_size=16, shuffle=True, seed=1, device="cpu")
    plain = HeteroNeighborLoader(data, [4, 3], ("paper", None), prefetch=0, **opts)
    prepped = HeteroNeighborLoader(data, [4, 3], ("paper", None), prefetch=2, transform=rg.PrepareGraph(model),
                                   **opts)  # fmt: skip
    want = [model(b.x_dict, b.edge_index_dict, {t: b[t].num_nodes for t in b.node_types}) for b in plain]
    assert sum(built_here) >= len(want)  # the plain batches' graphs were built here: the count can fail
    rg.clear_cache()  # (so that the plain batches' entries do not push the prefetched ones out)
    n = 0
    for b1, out0 in zip(prepped, want):
        assert b1.prepared_graph
        before = sum(built_here)
        out1 = model(b1.x_dict, b1.edge_index_dict, {t: b1[t].num_nodes for t in b1.node_types})
        assert sum(built_here) == before, "the step rebuilt a graph the loader had prepared"
        torch.testing.assert_close(out1, out0)
        n += 1
    plain.close()
    prepped.close()
    assert n == len(plain) > 2


def test_prepare_graph_and_transform_refuse_what_cannot_work(data) -> None:
    with pytest.raises(ValueError, match="no layer that prepares"):
        rg.PrepareGraph(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="transform must be callable"):
        HeteroNeighborLoader(data, [4, 3], ("paper", None), batch_size=16, device="cpu", transform=3)
    from dsx.models.hetero_gnn import HeteroClassifier

    model = HeteroClassifier("rgcn", data.metadata(), {t: 8 for t in data.node_types}, 8, 4)
    with pytest.raises(ValueError, match="at most prefetch=2"):  # more would push prepared graphs out
        HeteroNeighborLoader(data, [4, 3], "paper", batch_size=16, device="cpu", prefetch=3,
                             transform=rg.PrepareGraph(model))  # fmt: skip
    lost = HeteroNeighborLoader(data, [4, 3], "paper", batch_size=16, device="cpu", prefetch=0,
                                transform=lambda b: None)  # fmt: skip
    with pytest.raises(TypeError, match="must return the batch"):
        next(iter(lost))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("model_name,target", [("rgcn", "paper"), ("rgat", "paper"), ("rgcn", "author")])
def test_a_model_on_one_layout_tensor_matches_its_per_type_layers(data, model_name, target, device) -> None:
    """HeteroClassifier runs dsx's RGCN / RGAT on one layout-order tensor when every node type is reached; the
    per-type path (each layer through RelationalHetero, dicts between) is its reference: same outputs and
    gradients on fresh random features, with each layer recomputed as activation offload does or not, every
    layer called as a module."""
    from dsx.models.hetero_gnn import HeteroClassifier
    from dsx.offload.checkpointing import checkpointed

    torch.manual_seed(7)
    feats = {t: 8 for t in data.node_types}
    model = HeteroClassifier(model_name, data.metadata(), feats, 8, 4, heads=2, target=target).to(device)
    if device == "cpu":  # the PyTorch twins; on CUDA the generated kernels
        for conv in model.convs:
            conv.conv.kernel_backend = "reference"
    assert model._one_tensor
    calls, inner = (
        [],
        [],
    )  # the layers' module calls (offload's hooks and recompute hang on them), their convs'
    for conv in model.convs:
        conv.register_forward_pre_hook(lambda m, a, kw: calls.append(m), with_kwargs=True)
        conv.conv.register_forward_pre_hook(lambda m, a: inner.append(m))
    for b in _batches(data):
        x = {t: torch.randn(b[t].num_nodes, 8, device=device) for t in b.node_types}
        edges = {e: ei.to(device) for e, ei in b.edge_index_dict.items()}
        sizes = {t: b[t].num_nodes for t in b.node_types}
        outs, grads = [], []
        for one, recompute in ((True, True), (True, False), (False, False)):
            model._one_tensor = one
            saved: dict = {}
            for i, conv in enumerate(model.convs):  # as activation offload recomputes a whole layer
                checkpointed(conv, recompute, i, saved, reentrant=True)
            model.zero_grad()
            calls.clear()
            inner.clear()
            out = model(x, edges, sizes)
            out.square().sum().backward()
            assert calls == list(model.convs)
            assert len(inner) == len(calls) * (2 if recompute else 1)  # a recomputed layer runs again
            for i, conv in enumerate(model.convs):
                checkpointed(conv, False, i, saved)
            outs.append(out.detach())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        torch.testing.assert_close(outs[0], outs[2])
        for n in grads[0]:
            torch.testing.assert_close(grads[0][n], grads[2][n], msg=n)
        torch.testing.assert_close(outs[0], outs[1])
        assert grads[0].keys() == grads[1].keys() and grads[0]
        for n in grads[0]:
            torch.testing.assert_close(grads[0][n], grads[1][n], msg=n)
    # a node type that no edge type reaches keeps its rows only through the per-type path
    nodes, edges = data.metadata()
    unreached = [e for e in edges if e[-1] != "author"]
    assert not HeteroClassifier(model_name, (nodes, unreached), {t: 8 for t in nodes}, 8, 4)._one_tensor
