"""rgnn kernels on CPU: the generated Triton kernels under Triton's interpreter against the PyTorch twins;
the twins against naive loops; code generation, the kernel cache, input checks. GPU: test_kernels_gpu.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dsx.rgnn.codegen import generate_edge_kernel_source, generate_gather_gemm_source, load_source
from dsx.rgnn.kernels import EdgeSpec, fused_edge, fused_edge_ref, gather_gemm, gather_gemm_ref
from dsx.rgnn.kernels.gather_gemm import build_tile_map
from tests.rgnn._kernel_cases import GRAD_KEYS, assert_close, edge_case, gemm_case
from tests.rgnn._rgnn_graphs import LOGIT_SPECS, SPECS, edge_graph, segments


@pytest.mark.parametrize("k,nout,m", [(5, 7, 90), (16, 33, 90), (40, 16, 90), (8, 16, 1200)])
def test_gather_gemm_interpret_matches_reference(k, nout, m):
    # m=1200 over 3 non-empty relations: several 64-row tiles and several 256-row weight-gradient tiles each.
    (out, dx, dw), (out_r, dx_r, dw_r) = gemm_case("interpret", "cpu", 30, k, nout, 5, m, seed=k + nout)
    assert_close(out, out_r, 1e-5, 1e-5, "out")
    assert_close(dx, dx_r, 1e-5, 1e-5, "dx")
    assert_close(dw, dw_r, 1e-5, 1e-5, "dw")


@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_empty_inputs(backend):
    """No rows at all (every relation empty) and a graph without edges: zero outputs, zero gradients."""
    x, w = torch.randn(4, 5, requires_grad=True), torch.randn(3, 5, 6, requires_grad=True)
    out = gather_gemm(
        x, w, torch.zeros(0, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), backend=backend
    )
    assert out.shape == (0, 6)
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(w.grad, torch.zeros_like(w))
    spec = SPECS["hgt"]
    msg = torch.randn(2, 2, 4, requires_grad=True)
    none = torch.zeros(0, dtype=torch.int64)
    kw = dict(edge_src_row=none, edge_dst_row=none, edge_rel=none, rel_scale=torch.rand(2, 2))
    kw |= dict(src_term=torch.randn(2, 2, 3), dst_term=torch.randn(2, 2, 3))
    out = fused_edge(spec, torch.zeros(6, dtype=torch.int64), msg, none, backend=backend, **kw)
    assert out.shape == (5, 2, 4) and torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(msg.grad, torch.zeros_like(msg))


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_gather_gemm_interpret_reduced_precision(precision):
    """bf16 rounds the inputs (checked exactly against the reference on rounded inputs); tf32 runs."""
    gen = torch.Generator().manual_seed(9)
    row_idx, rel_ptr = segments(4, 70, 20, gen)
    x, w = torch.randn(20, 24, generator=gen), torch.randn(4, 24, 18, generator=gen)
    out = gather_gemm(x, w, row_idx, rel_ptr, precision=precision, backend="interpret")
    exact = gather_gemm_ref(x.double(), w.double(), row_idx, rel_ptr)
    assert_close(out.double(), exact, 3e-2, 3e-2 * exact.abs().max().item(), precision)
    if precision == "bf16":
        rounded = gather_gemm_ref(x.bfloat16().double(), w.bfloat16().double(), row_idx, rel_ptr)
        assert_close(out.double(), rounded, 1e-5, 1e-5, "bf16 vs reference on bf16-rounded inputs")
        assert (out.double() - exact).abs().max() > 1e-4, "bf16 precision did not round the inputs"


def test_gather_gemm_reference_is_per_row_product():
    gen = torch.Generator().manual_seed(0)
    row_idx, rel_ptr = segments(4, 25, 10, gen)
    x, w = torch.randn(10, 6, generator=gen), torch.randn(4, 6, 3, generator=gen)
    out = gather_gemm_ref(x, w, row_idx, rel_ptr)
    rel = torch.searchsorted(rel_ptr[1:], torch.arange(25), right=True)
    for i in range(25):
        torch.testing.assert_close(out[i], x[row_idx[i]] @ w[rel[i]])


def test_tile_map_covers_every_row_once():
    rel_ptr = torch.tensor([0, 0, 130, 131, 131, 400], dtype=torch.int64)
    tile_rel, tile_row = build_tile_map(rel_ptr, 400, 64)
    assert tile_rel.numel() == -(-400 // 64) + 5
    covered = torch.zeros(400, dtype=torch.int64)
    for r, row0 in zip(tile_rel.tolist(), tile_row.tolist()):
        if r < 5:
            end = min(row0 + 64, rel_ptr[r + 1].item())
            assert rel_ptr[r] <= row0 < rel_ptr[r + 1], "a tile starts outside its relation"
            covered[row0:end] += 1
    assert torch.equal(covered, torch.ones(400, dtype=torch.int64))


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("heads,dim,block_e", [(1, 4, None), (2, 5, 4), (2, 16, 8), (3, 4, 2)])
def test_fused_edge_interpret_matches_reference(name, heads, dim, block_e):
    # block_e below the in-degrees (~8) runs the online softmax over several chunks per destination.
    spec = SPECS[name]
    dst_ptr, ((out, grads), (out_r, grads_r)) = edge_case(
        spec, "interpret", "cpu", heads, dim, seed=heads * 7 + dim, block_e=block_e
    )
    assert_close(out.double(), out_r, 1e-5, 1e-5, f"{name} out")
    isolated = (dst_ptr[1:] == dst_ptr[:-1]).nonzero().flatten()
    assert isolated.numel() >= 2 and torch.all(out[isolated] == 0), "isolated destinations must get 0"
    for key, g in grads_r.items():
        assert grads[key] is not None, f"{name}: no gradient for {key}"
        assert_close(grads[key].double(), g, 1e-5, 1e-5, f"{name} d{key}")


@pytest.mark.parametrize("name", ["rgcn_mean", "hgt"])
def test_fused_edge_interpret_bf16_inputs(name):
    """bf16 messages and terms: fp32 accumulation inside, output rounded to bf16 once."""
    _, ((out, grads), (out_r, grads_r)) = edge_case(
        SPECS[name], "interpret", "cpu", 2, 5, seed=21, dtype=torch.bfloat16, block_e=4
    )
    assert out.dtype == torch.bfloat16 and grads["msg"].dtype == torch.bfloat16
    assert_close(out.double(), out_r, 2e-2, 2e-2 * out_r.abs().max().item(), f"{name} bf16 out")
    # The backward reads the bf16-rounded output for delta = <out, dout>, as flash attention does.
    for key, g in grads_r.items():
        assert_close(grads[key].double(), g, 5e-2, 5e-2 * g.abs().max().item(), f"{name} bf16 d{key}")


@pytest.mark.parametrize("name", LOGIT_SPECS)
@pytest.mark.parametrize("heads,dim,block_e", [(1, 4, None), (3, 5, 2)])
def test_fused_edge_interpret_dst_term_per_node(name, heads, dim, block_e):
    """edge_dst_row=None: dst_term indexed by destination (gradient summed in registers, no atomics)."""
    spec = SPECS[name]
    _, ((out, grads), (out_r, grads_r)) = edge_case(
        spec, "interpret", "cpu", heads, dim, seed=11 + dim, block_e=block_e, node_dst=True
    )
    assert_close(out.double(), out_r, 1e-5, 1e-5, f"{name} out")
    for key, g in grads_r.items():
        assert_close(grads[key].double(), g, 1e-5, 1e-5, f"{name} d{key}")


@pytest.mark.parametrize("wanted", [("msg",), ("src_term", "rel_scale"), ("dst_term", "edge_weight")])
def test_fused_edge_interpret_partial_gradients(wanted):
    """Only the inputs that require grad get gradients; the others' kernels paths are compiled out."""
    spec = SPECS["dot_all"]
    gen = torch.Generator().manual_seed(5)
    dst_ptr, msg, rows, kw = edge_graph(spec, 9, 7, 4, 50, 2, 5, gen)
    inputs = {"msg": msg, **{k: kw[k] for k in GRAD_KEYS}}
    grads = []
    for impl in (lambda *a, **k: fused_edge(*a, backend="interpret", block_e=4, **k), fused_edge_ref):
        leaves = {k: v.clone().requires_grad_(k in wanted) for k, v in inputs.items()}
        args = kw | {k: leaves[k] for k in GRAD_KEYS}
        impl(spec, dst_ptr, leaves["msg"], rows, **args).pow(2).sum().backward()
        grads.append({k: t.grad for k, t in leaves.items()})
    for key in inputs:
        if key in wanted:
            assert_close(grads[0][key], grads[1][key], 1e-5, 1e-5, f"d{key}")
        else:
            assert grads[0][key] is None, f"{key} does not require grad but got one"


@pytest.mark.parametrize("edge_weight_grad", [False, True])
def test_fused_edge_frees_messages_without_logit(edge_weight_grad):
    """RGCN's spec (no logit): backward needs no messages, so forward does not keep them alive; the
    gradients still match the reference (with a weight gradient the messages are kept and read)."""
    import weakref

    spec = EdgeSpec(edge_weight=True)
    gen = torch.Generator().manual_seed(11)
    dst_ptr, msg, rows, kw = edge_graph(spec, 9, 7, 4, 50, 2, 5, gen)
    gout = torch.randn(9, 2, 5, generator=gen)
    grads = []
    for impl in (lambda *a, **k: fused_edge(*a, backend="interpret", block_e=4, **k), fused_edge_ref):
        base = msg.clone().requires_grad_()
        weight = kw["edge_weight"].clone().requires_grad_(edge_weight_grad)
        rows_msg = base * 1.0  # a non-leaf only the autograd graph could keep
        ref = weakref.ref(rows_msg)
        out = impl(spec, dst_ptr, rows_msg, rows, edge_weight=weight)
        del rows_msg
        if impl is not fused_edge_ref:
            assert (ref() is not None) == edge_weight_grad, "messages kept alive only for the weight gradient"
        out.backward(gout)
        grads.append((base.grad, weight.grad))
    assert_close(grads[0][0], grads[1][0], 1e-5, 1e-5, "dmsg")
    if edge_weight_grad:
        assert_close(grads[0][1], grads[1][1], 1e-5, 1e-5, "dedge_weight")


def _naive_edge(spec, dst_ptr, msg, rows, kw):
    """Per-node, per-head loops written straight from the docstring: an independent check of the reference."""
    num_dst, (_, heads, dim) = dst_ptr.numel() - 1, msg.shape
    out = torch.zeros(num_dst, heads, dim, dtype=torch.float64)
    for v in range(num_dst):
        edges = range(int(dst_ptr[v]), int(dst_ptr[v + 1]))
        for h in range(heads):
            logits = []
            for e in edges:
                if spec.score == "none":
                    logits.append(1.0)
                    continue
                d_row = kw["edge_dst_row"][e] if "edge_dst_row" in kw else v
                a, b = kw["src_term"][kw["edge_src_row"][e], h], kw["dst_term"][d_row, h]
                z = float(a + b) if spec.score == "add" else float((a * b).sum())
                if spec.leaky_relu_slope is not None and z < 0:
                    z *= spec.leaky_relu_slope
                if spec.rel_scale:
                    z *= float(kw["rel_scale"][kw["edge_rel"][e], h])
                logits.append(z)
            if spec.softmax and logits:
                mx = max(logits)
                ex = [math.exp(z - mx) for z in logits]
                logits = [z / sum(ex) for z in ex]
            for e, alpha in zip(edges, logits):
                if spec.edge_weight:
                    alpha *= float(kw["edge_weight"][e])
                out[v, h] += alpha * msg[rows[e], h].double()
    return out


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("node_dst", [False, True])
def test_reference_matches_naive_loops(name, node_dst):
    spec = SPECS[name]
    gen = torch.Generator().manual_seed(3)
    dst_ptr, msg, rows, kw = edge_graph(spec, 8, 6, 3, 30, 2, 3, gen, node_dst=node_dst)
    got = fused_edge_ref(spec, dst_ptr, msg, rows, **kw)
    torch.testing.assert_close(got.double(), _naive_edge(spec, dst_ptr, msg, rows, kw), rtol=1e-5, atol=1e-5)


def test_reference_gradcheck_float64():
    spec = SPECS["dot_all"]
    gen = torch.Generator().manual_seed(4)
    dst_ptr, msg, rows, kw = edge_graph(spec, 6, 5, 3, 16, 2, 3, gen, dtype=torch.float64)
    leaves = {k: kw[k].requires_grad_() for k in GRAD_KEYS}
    msg.requires_grad_()

    def f(m, s, d, r, w):
        return fused_edge_ref(
            spec, dst_ptr, m, rows, **(kw | dict(src_term=s, dst_term=d, rel_scale=r, edge_weight=w))
        )

    assert torch.autograd.gradcheck(f, (msg, *leaves.values()))


def test_generated_source_follows_spec_and_uses_int64_offsets():
    plain = generate_edge_kernel_source(SPECS["rgcn_sum"])
    hgt = generate_edge_kernel_source(SPECS["hgt"])
    assert "src_term_ptr" not in plain and "lse_ptr" not in plain and "tl.exp" not in plain
    assert "rel_scale_ptr" in hgt and "lse_ptr" in hgt and "DP: tl.constexpr" in hgt
    assert "raw * 0.2" in generate_edge_kernel_source(SPECS["rgat"])
    per_node = generate_edge_kernel_source(SPECS["hgt"], dst_term_per_node=True)
    assert "dst_row_ptr" not in per_node and "atomic_add(ddst_ptr" not in per_node
    assert "tl.store(ddst_ptr" in per_node and "atomic_add(ddst_ptr" in hgt
    for src in (plain, hgt):
        # Program ids are widened before any address arithmetic; all index arrays are int64 tensors.
        assert "v = tl.program_id(0).to(tl.int64)" in src and "rows[:, None, None] * (H * D)" in src
        for jit_helper in ("tl.sum(", "tl.max(", "tl.zeros(", "tl.cdiv("):
            assert jit_helper not in src, f"{jit_helper} cannot run in an interpreter started after import"
    for precision in ("fp32", "tf32", "bf16"):
        assert (
            f'input_precision="{precision if precision != "fp32" else "ieee"}"'
            in (generate_gather_gemm_source(precision))
            or precision == "bf16"
        )


def test_loader_caches_files_and_modules(tmp_path, monkeypatch):
    monkeypatch.setenv("DSX_KERNEL_CACHE", str(tmp_path))
    src = generate_edge_kernel_source(EdgeSpec(score="add", softmax=True))
    mod = load_source("edge_test", src, interpret=True)
    assert load_source("edge_test", src, interpret=True) is mod
    files = list(tmp_path.glob("edge_test_interp_*.py"))
    assert len(files) == 1 and files[0].read_text() == src
    assert mod.FWD_ARGS[0] == "dst_ptr"
    assert type(mod.edge_fwd_kernel).__name__ == "InterpretedFunction"  # not compiled, not the reference


def test_bad_inputs_raise_clear_errors():
    spec = SPECS["rgat"]
    dst_ptr, msg, rows = torch.tensor([0, 1]), torch.randn(1, 1, 4), torch.tensor([0])
    with pytest.raises(ValueError, match="needs"):
        fused_edge(spec, dst_ptr, msg, rows, backend="reference")
    with pytest.raises(ValueError, match="int64"):
        fused_edge(SPECS["rgcn_sum"], dst_ptr.int(), msg, rows, backend="reference")
    with pytest.raises(ValueError, match="score='none'"):
        EdgeSpec(softmax=True)
    with pytest.raises(IndexError, match="edge_msg_row holds values in \\[3, 3\\] but msg has 1 rows"):
        fused_edge(
            SPECS["rgcn_sum"], dst_ptr, msg, torch.tensor([3]), backend="reference", check_indices=True
        )
    with pytest.raises(ValueError, match="dst_ptr must start at 0 and end at 1"):
        fused_edge(
            SPECS["rgcn_sum"], torch.tensor([0, 2]), msg, rows, backend="reference", check_indices=True
        )
    with pytest.raises(IndexError, match="row_idx"):
        gather_gemm(
            torch.randn(3, 4),
            torch.randn(1, 4, 5),
            torch.tensor([5]),
            torch.tensor([0, 1]),
            check_indices=True,
        )
    with pytest.raises(ValueError, match="R\\+1"):
        gather_gemm(torch.randn(3, 4), torch.randn(2, 4, 5), torch.tensor([0]), torch.tensor([0, 1]))


@pytest.mark.slow
def test_benchmark_quick_smoke(tmp_path):
    import json
    import runpy

    bench = runpy.run_path(str(Path(__file__).resolve().parents[2] / "benchmarks" / "bench_rgnn_kernels.py"))
    result = bench["main"](["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_rgnn_kernels.json").read_text())
    assert (tmp_path / "bench_rgnn_kernels.png").stat().st_size > 0
    assert {r["spec"] for r in saved["edge"]} == {"rgcn_mean", "rgat", "hgt"}
    assert all(r["fwd_GBps"] > 0 for r in result["edge"]) and len(saved["gemm"]) == 3


def _rgcn_from_kernels(x, weight, root, bias, edge_index, edge_type, backend):
    """RGCN (mean per relation) composed from the two kernels, as dsx.rgnn's layer does after its passes."""
    n, num_rel = x.shape[0], weight.shape[0]
    src, dst = edge_index
    # Compact materialization: one message row per unique (relation, source) pair, grouped by relation.
    pair, edge_pair = torch.unique(edge_type * n + src, return_inverse=True)
    rel_ptr = torch.zeros(num_rel + 1, dtype=torch.int64)
    rel_ptr[1:] = torch.cumsum(torch.bincount(pair // n, minlength=num_rel), 0)
    msg = gather_gemm(x, weight, pair % n, rel_ptr, backend=backend)
    # Destination CSR; mean within each relation = edge weight 1 / |N_r(v)|.
    order = torch.argsort(dst, stable=True)
    dst_ptr = torch.zeros(n + 1, dtype=torch.int64)
    dst_ptr[1:] = torch.cumsum(torch.bincount(dst, minlength=n), 0)
    _, dst_rel, counts = torch.unique(dst * num_rel + edge_type, return_inverse=True, return_counts=True)
    norm = (1.0 / counts.float())[dst_rel]
    agg = fused_edge(
        EdgeSpec(edge_weight=True), dst_ptr, msg[:, None, :], edge_pair[order],
        edge_weight=norm[order], backend=backend,
    )  # fmt: skip
    return agg[:, 0, :] + x @ root + bias


def test_kernels_compose_to_pyg_rgcnconv():
    """The interface suffices for PyG's RGCNConv (mean aggregation): same outputs and gradients."""
    nn = pytest.importorskip("torch_geometric.nn")
    torch.manual_seed(0)
    n, num_rel, cin, cout, num_edges = 12, 5, 6, 7, 60
    conv = nn.RGCNConv(cin, cout, num_rel, aggr="mean")
    torch.nn.init.normal_(conv.bias)
    x = torch.randn(n, cin, requires_grad=True)
    edge_index = torch.randint(0, n - 2, (2, num_edges))  # the last two nodes stay isolated
    edge_type = torch.randint(0, num_rel - 1, (num_edges,))  # the last relation stays empty
    want = conv(x, edge_index, edge_type)
    want.pow(2).sum().backward()
    params = [p.detach().clone().requires_grad_() for p in (conv.weight, conv.root, conv.bias)]
    x2 = x.detach().clone().requires_grad_()
    got = _rgcn_from_kernels(x2, *params, edge_index, edge_type, backend="interpret")
    got.pow(2).sum().backward()
    assert_close(got, want, 1e-5, 1e-5, "RGCN output")
    assert_close(x2.grad, x.grad, 1e-5, 1e-5, "RGCN dx")
    for p, ref in zip(params, (conv.weight, conv.root, conv.bias)):
        assert_close(p.grad, ref.grad, 1e-5, 1e-5, "RGCN parameter gradient")
