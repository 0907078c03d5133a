"""PyG parity of dsx.rgnn's RGCNConv / RGATConv / HGTConv: outputs and gradients, every backend; bad input."""

from __future__ import annotations

import pytest
import torch
import torch_geometric.nn as pygnn

import dsx.rgnn as rg

# (layer backend, kernel backend): the fused path on the PyTorch twins, the same path with the generated
# Triton kernels under Triton's interpreter, and the per-edge interpreter spec.
BACKENDS = [("kernels", "reference"), ("kernels", "interpret"), ("interpreter", None)]


def rel_graph(n=23, e=90, r=5, seed=0):
    """Random multigraph: the last relation is empty, the last 3 nodes receive no edges, node 0 sends none."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(1, n, (e,), generator=gen)
    dst = torch.randint(0, n - 3, (e,), generator=gen)
    et = torch.randint(0, r - 1, (e,), generator=gen)
    return torch.stack([src, dst]), et


def check_parity(ours, theirs, run, inputs, atol=2e-5, rtol=1e-4):
    """Same outputs and same gradients w.r.t. inputs and every parameter (by name)."""
    ours.load_state_dict(theirs.state_dict(), strict=True)
    outs, grads = [], []
    for mod in (theirs, ours):
        mod.zero_grad(set_to_none=True)
        xs = [t.detach().clone().requires_grad_(True) for t in inputs]
        out = run(mod, xs)
        outs.append(out)
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        (out * cot).sum().backward()
        grads.append([t.grad for t in xs] + [p.grad for _, p in sorted(mod.named_parameters())])
    torch.testing.assert_close(outs[1], outs[0], atol=atol, rtol=rtol)
    names = [f"input{i}" for i in range(len(inputs))] + [n for n, _ in sorted(ours.named_parameters())]
    for name, g_ours, g_pyg in zip(names, grads[1], grads[0]):
        if g_pyg is None:  # PyG parameters unused by the chosen options (RGAT's "mod" params) get no grad
            assert g_ours is None or torch.count_nonzero(g_ours) == 0, name
            continue
        torch.testing.assert_close(g_ours, g_pyg, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("backend,kb", BACKENDS)
@pytest.mark.parametrize(
    "opts", [{}, {"aggr": "sum"}, {"num_bases": 3}, {"root_weight": False, "bias": False}]
)
def test_rgcn_parity(backend, kb, opts):
    torch.manual_seed(0)
    ei, et = rel_graph()
    theirs = rg_pyg = pygnn.RGCNConv(7, 6, 5, **opts)
    ours = rg.RGCNConv(7, 6, 5, backend=backend, kernel_backend=kb, **opts)
    check_parity(ours, rg_pyg, lambda m, xs: m(xs[0], ei, et), [torch.randn(23, 7)])
    assert theirs is rg_pyg


@pytest.mark.parametrize("backend,kb", BACKENDS)
def test_rgcn_bipartite_and_no_compaction(backend, kb):
    ei, et = rel_graph(seed=3)
    ei[1] = ei[1] % 11  # 11 destination nodes
    theirs = pygnn.RGCNConv((7, 4), 6, 5)
    ours = rg.RGCNConv((7, 4), 6, 5, backend=backend, kernel_backend=kb, compact_materialization=False)
    check_parity(
        ours, theirs, lambda m, xs: m((xs[0], xs[1]), ei, et), [torch.randn(23, 7), torch.randn(11, 4)]
    )


@pytest.mark.parametrize("backend,kb", BACKENDS)
@pytest.mark.parametrize(
    "opts,flags",
    [
        ({}, {}),
        ({"heads": 3}, {"linear_reorder": False}),
        ({"heads": 2, "concat": False}, {"compact_materialization": False}),
        ({"heads": 2, "num_bases": 2}, {}),
        ({"heads": 2, "negative_slope": 0.05}, {}),  # the leaky ReLU's slope is the layer's, not 0.2
    ],
)
def test_rgat_parity(backend, kb, opts, flags):
    torch.manual_seed(0)
    ei, et = rel_graph(seed=1)
    theirs = pygnn.RGATConv(7, 5, 5, **opts)
    ours = rg.RGATConv(7, 5, 5, backend=backend, kernel_backend=kb, **opts, **flags)
    check_parity(ours, theirs, lambda m, xs: m(xs[0], ei, et), [torch.randn(23, 7)])


def hetero(seed=0):
    gen = torch.Generator().manual_seed(seed)
    sizes = {"paper": 13, "author": 9, "venue": 4}
    etypes = [("author", "writes", "paper"), ("paper", "rev_writes", "author"), ("paper", "cites", "paper"),
              ("paper", "in", "venue"), ("venue", "has", "author")]  # fmt: skip
    x = {t: torch.randn(n, 6, generator=gen) for t, n in sizes.items()}
    eid = {}
    for e in etypes[:4]:  # ("venue", "has", "author") is in metadata but absent: an empty relation
        n_e = 20
        s = torch.randint(0, sizes[e[0]], (n_e,), generator=gen)
        d = torch.randint(
            0, max(1, sizes[e[2]] - 1), (n_e,), generator=gen
        )  # last node of each type isolated
        eid[e] = torch.stack([s, d])
    return x, eid, (list(sizes), etypes)


@pytest.mark.parametrize("backend,kb", BACKENDS)
@pytest.mark.parametrize("out,heads", [(6, 2), (8, 4)])
def test_hgt_parity(backend, kb, out, heads):
    torch.manual_seed(0)
    x, eid, meta = hetero()
    theirs = pygnn.HGTConv(6, out, meta, heads=heads)
    with torch.no_grad():  # PyG initialises skip / p_rel to ones: perturb so every parameter matters
        for p in theirs.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ours = rg.HGTConv(6, out, meta, heads=heads, backend=backend, kernel_backend=kb)
    names = list(x)

    def run(m, xs):
        res = m(dict(zip(names, xs)), eid)
        assert sorted(res) == ["author", "paper", "venue"]
        return torch.cat([res[t] for t in names], 0)

    check_parity(ours, theirs, run, [x[t] for t in names])


def test_hgt_hector_residual():
    x, eid, meta = hetero()
    pyg_sem = rg.HGTConv(6, 6, meta, heads=2, kernel_backend="reference")
    hector = rg.HGTConv(6, 6, meta, heads=2, semantics="hector", kernel_backend="reference")
    hector.load_state_dict(pyg_sem.state_dict())
    with torch.no_grad():
        pyg_sem.skip["paper"].fill_(50.0)  # sigmoid -> 1: the gated skip becomes out_lin(...) only
    a, b = pyg_sem(x, eid)["paper"], hector(x, eid)["paper"]
    torch.testing.assert_close(b - x["paper"], a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kb", ["reference", "interpret"])
def test_rgat_hector_matches_interpreter(kb):
    ei, et = rel_graph(seed=2)
    x = torch.randn(23, 7)
    ref = rg.RGATConv(7, 4, 5, heads=2, semantics="hector", backend="interpreter")
    for flags in ({}, {"linear_reorder": False}, {"compact_materialization": False}):
        ours = rg.RGATConv(7, 4, 5, heads=2, semantics="hector", kernel_backend=kb, **flags)
        check_parity(ours, ref, lambda m, xs: m(xs[0], ei, et), [x])


def test_rgat_hector_uses_per_relation_vectors():
    ei, et = rel_graph(seed=2)
    x = torch.randn(23, 7)
    m = rg.RGATConv(7, 4, 5, heads=2, semantics="hector", kernel_backend="reference")
    base = m(x, ei, et)
    with torch.no_grad():
        m.att_src[0].mul_(-3.0)  # changes the scores of relation 0 only
    changed = (m(x, ei, et) - base).abs().sum(-1) > 1e-6
    dst0 = ei[1][et == 0].unique()
    assert changed[dst0].all() and changed.sum() == dst0.numel()


def test_graph_keeps_only_required_fields():
    """An RGCN graph keeps the 1/deg_r weights but not the [E] intermediates that built them."""
    ei, et = rel_graph(seed=3)
    rg.clear_cache()
    g = rg.prepare(ei, et, 23, 5, needs=("inv_deg_rel",))
    assert "inv_deg_rel" in vars(g) and not {"src", "dst", "rel", "edge_dst_row"} & set(vars(g))
    perm = torch.sort(ei[1], stable=True).indices
    key = (et * 23 + ei[1])[perm]
    deg = (key[:, None] == key[None, :]).sum(1).float()  # edges sharing (destination, relation)
    torch.testing.assert_close(g.inv_deg_rel, 1.0 / deg)
    small = g.nbytes()
    assert rg.prepare(ei, et, 23, 5, needs=("edge_dst_row", "rel")) is g  # a second layer adds its fields
    assert {"inv_deg_rel", "edge_dst_row", "rel"} <= set(vars(g)) and g.nbytes() > small
    torch.testing.assert_close(g.inv_deg_rel, 1.0 / deg)
    with pytest.raises(ValueError, match="no derived field"):
        g.require("weights")
    rg.clear_cache()


def test_graph_maps_from_int32_ids_and_either_order_of_fields():
    """int32 edge lists give the int64 graph of their int64 twins; 1/deg_r built after the destination pairs
    (from their counts) equals 1/deg_r built alone (from each edge's key)."""
    ei, et = rel_graph(seed=5)
    rg.clear_cache()
    wide = rg.prepare(ei, et, 23, 5, cache=False, needs=("inv_deg_rel",))
    narrow = rg.prepare(ei.int(), et.int(), 23, 5, cache=False, needs=("inv_deg_rel",))
    for name in ("dst_ptr", "src_row_idx", "src_rel_ptr", "edge_src_row", "inv_deg_rel"):
        a, b = getattr(wide, name), getattr(narrow, name)
        assert b.dtype == a.dtype and torch.equal(a, b), name
    pairs_first = rg.prepare(ei, et, 23, 5, cache=False, needs=("edge_dst_row",)).require("inv_deg_rel")
    torch.testing.assert_close(pairs_first.inv_deg_rel, wide.inv_deg_rel, rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("n,e,r", [(23, 90, 5), (3000, 40000, 9)])
def test_dense_table_and_sorted_keys_build_the_same_graph(monkeypatch, device, n, e, r) -> None:
    """A graph whose (relation, node) keys fit a dense table is built by scattering into it; a larger one by
    sorting its keys (torch.unique): both give the same maps and 1/deg_r, field for field."""
    import dsx.rgnn.graph as graph_mod

    gen = torch.Generator().manual_seed(n + e)
    ei = torch.randint(0, n, (2, e), generator=gen).to(device)
    et = torch.randint(0, r, (e,), generator=gen).to(device)
    fields = ("dst_ptr", "src_row_idx", "src_rel_ptr", "edge_src_row", "dst_row_idx", "dst_rel_ptr",
              "edge_dst_row", "src", "dst", "rel")  # fmt: skip
    built = {}
    for dense in (True, False):
        monkeypatch.setattr(graph_mod, "_dense_fits", lambda keys, edges, device, dense=dense: dense)
        alone = rg.prepare(ei, et, n, r, cache=False, needs=("inv_deg_rel",))  # 1/deg_r from the keys
        built[dense] = rg.prepare(ei, et, n, r, cache=False, needs=fields[4:])
        built[dense].inv_alone = alone.inv_deg_rel
    # the dense table's counts in int64, as a graph of 2**24 edges or more counts them
    with monkeypatch.context() as m:
        m.setattr(graph_mod, "_dense_fits", lambda keys, edges, device: True)
        m.setattr(graph_mod, "_FLOAT_COUNTS_EXACT_BELOW", 1)
        wide_counts = rg.prepare(ei, et, n, r, cache=False, needs=("inv_deg_rel",)).inv_deg_rel
    for name in fields:
        a, b = getattr(built[True], name), getattr(built[False], name)
        assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b), name
    g = built[True]
    deg = torch.zeros(r * n, dtype=torch.int64, device=device).index_add_(
        0, g.rel * n + g.dst, torch.ones_like(g.dst)
    )
    expected = 1.0 / deg[g.rel * n + g.dst].float()
    for inv in (built[True].inv_alone, built[False].inv_alone, wide_counts):
        assert inv.dtype == torch.float32
        torch.testing.assert_close(inv, expected, rtol=0, atol=0)
    # the pairs are the unique (node, relation) keys, grouped by relation and ascending: the sorted path's
    # torch.unique is the reference, and both agree with it
    assert torch.equal(
        g.src_rel_ptr,
        torch.searchsorted(torch.unique(g.rel * n + g.src), torch.arange(r + 1, device=device) * n),
    )


def test_the_dense_table_is_for_gpu_batches_whose_keys_are_few_next_to_their_edges() -> None:
    from dsx.rgnn.graph import _dense_fits

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _dense_fits(
        8 * 486_000, 753_000, cuda
    )  # an ogbn-mag batch (fanouts 25, 20): 8 relations, 486k nodes
    assert not _dense_fits(4 * 1_000_000, 100, cuda)  # few edges over many keys: sorting them is cheaper
    assert not _dense_fits(8 * 200_000, 750_000, cpu)  # on the CPU the sort is the cheaper path


def test_prepare_cache_and_bad_input():
    ei, et = rel_graph()
    g = rg.prepare(ei, et, 23, 5)
    assert rg.prepare(ei, et, 23, 5) is g
    assert g.dst_ptr[-1] == ei.shape[1] and torch.all(g.dst.diff() >= 0)
    # Derived fields against the original edges: the sorted order is a stable sort by destination.
    perm = torch.sort(ei[1], stable=True).indices
    assert torch.equal(g.perm, perm) and torch.equal(g.src, ei[0][perm]) and torch.equal(g.rel, et[perm])
    assert torch.equal(g.dst, ei[1][perm]) and g.src_rel_ptr[-1] == g.src_row_idx.numel()
    assert torch.equal(g.dst_row_idx[g.edge_dst_row], g.dst)
    assert torch.equal(torch.searchsorted(g.dst_rel_ptr, g.edge_dst_row, right=True) - 1, g.rel)
    assert g.src_rel_ptr[-1] == g.src_rel_ptr[-2]  # relation 4 is empty
    # pair keys past int32 (num_relations x num_nodes >= 2**31) take int64 keys: the same maps
    wide = rg.prepare(ei, et, (2**30, 23), 5, cache=False)
    for name in ("dst_ptr", "src_row_idx", "src_rel_ptr", "edge_src_row"):
        assert torch.equal(getattr(wide, name), getattr(g, name)), name
    et2 = et.clone()
    et2[0] = 5
    with pytest.raises(ValueError, match=r"edge_type values span \[0, 5\] but num_relations=5"):
        rg.prepare(ei, et2, 23, 5)
    with pytest.raises(ValueError, match="source node indices"):
        rg.prepare(ei, et, 10, 5)
    with pytest.raises(ValueError, match="one relation id per edge"):
        rg.prepare(ei, et[:-1], 23, 5)
    with pytest.raises(ValueError, match="exceeds 2147483647"):
        rg.prepare(ei, et, (2**31 + 5, 23), 5, index_dtype=torch.int32)
    et.add_(0)  # an in-place edit invalidates the cached entry
    assert rg.prepare(ei, et, 23, 5) is not g
    with pytest.raises(ValueError, match="num_blocks"):
        rg.RGCNConv(4, 4, 2, num_blocks=2)
    with pytest.raises(ValueError, match="mod"):
        rg.RGATConv(4, 4, 2, mod="additive")
    with pytest.raises(ValueError, match="in_channels=7"):
        rg.RGCNConv(7, 6, 5)(torch.randn(23, 3), ei, et)
    x, eid, meta = hetero()
    bad = dict(eid)
    bad[("paper", "cites", "paper")] = torch.tensor([[0], [13]])
    with pytest.raises(ValueError, match="out of range"):
        rg.HGTConv(6, 6, meta)(x, bad)


def test_compiled_program_frees_intermediates_without_gc(monkeypatch):
    """RGCN's projected rows die as soon as the fused edge kernel has consumed them: the compiled program
    keeps no reference (its recursive evaluator must not hold them in a cycle until the cyclic GC runs)."""
    import gc
    import sys
    import weakref

    compile_mod = sys.modules["dsx.rgnn.compile"]  # the package exports compile() under the same name

    refs = []
    real = compile_mod.gather_gemm

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        refs.append(weakref.ref(out))
        return out

    monkeypatch.setattr(compile_mod, "gather_gemm", recording)
    ei, et = rel_graph(seed=5)
    layer = rg.RGCNConv(6, 4, 5, kernel_backend="interpret")
    x = torch.randn(23, 6, requires_grad=True)
    gc.disable()
    try:
        out = layer(x, ei, et)
        assert refs and all(r() is None for r in refs), "projected rows outlived the forward"
        out.square().sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
    finally:
        gc.enable()


@pytest.mark.parametrize("model", ["rgcn", "rgat", "hgt"])
def test_layers_run_under_inference_mode(model):
    """Under torch.inference_mode the prepared graph's tensors keep no version counter; the cached tile
    maps must still work and give the same outputs as a grad-enabled forward."""
    ei, et = rel_graph(seed=11)
    x = torch.randn(23, 8)
    # The graph is first seen inside inference mode (so it is prepared there); the reference forward gets
    # clones, which are prepared apart from it.
    if model == "hgt":
        meta = (["a"], [("a", str(r), "a") for r in range(5)])
        layer = rg.HGTConv(8, 8, meta, heads=2, kernel_backend="interpret")
        xd = {"a": x}
        with torch.inference_mode():
            got = layer(xd, {("a", str(r), "a"): ei[:, et == r] for r in range(5)})["a"]
        want = layer(xd, {("a", str(r), "a"): ei[:, et == r].clone() for r in range(5)})["a"]
    else:
        cls = rg.RGCNConv if model == "rgcn" else rg.RGATConv
        layer = cls(8, 8, 5, kernel_backend="interpret")
        with torch.inference_mode():
            got = layer(x, ei, et)
        want = layer(x, ei.clone(), et.clone())
    torch.testing.assert_close(got, want.detach())
