"""rgnn kernels compiled by Triton: on a CUDA GPU against the PyTorch twins, and ahead of time for sm_90
(down to PTX, no GPU needed) to check what the generated code turns into."""

from __future__ import annotations

import pytest
import torch

from dsx.rgnn.codegen import generate_edge_kernel_source, generate_gather_gemm_source, load_source
from dsx.rgnn.kernels import fused_edge, gather_gemm
from tests.rgnn._kernel_cases import assert_close, edge_case, gemm_case
from tests.rgnn._rgnn_graphs import SPECS


@pytest.mark.gpu
@pytest.mark.parametrize("precision,rtol", [("fp32", 1e-5), ("tf32", 1e-2), ("bf16", 3e-2)])
@pytest.mark.parametrize("k,nout", [(64, 64), (128, 96), (37, 130)])
def test_gather_gemm_cuda(precision, rtol, k, nout):
    (out, dx, dw), (out_r, dx_r, dw_r) = gemm_case("triton", "cuda", 3000, k, nout, 12, 20000, 1, precision)
    for got, want, what in ((out, out_r, "out"), (dx, dx_r, "dx"), (dw, dw_r, "dw")):
        scale = want.abs().max().item()
        assert_close(got.cpu(), want.cpu(), rtol, rtol * scale, f"{precision} {what}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("heads,dim", [(1, 64), (2, 32), (3, 5), (8, 128)])
@pytest.mark.parametrize("node_dst", [False, True])
def test_fused_edge_cuda(name, heads, dim, node_dst):
    # ~60 in-edges per destination: several BLOCK_E chunks per node on every configuration.
    spec = SPECS[name]
    _, ((out, grads), (out_r, grads_r)) = edge_case(
        spec,
        "triton",
        "cuda",
        heads,
        dim,
        seed=dim,
        num_dst=500,
        num_edges=30000,
        num_src=1500,
        node_dst=node_dst,
    )
    # fp32 sums of ~60 terms (outputs) and atomically accumulated gradients: tolerances scale with magnitude.
    assert_close(
        out.double().cpu(), out_r.cpu(), 1e-5, 1e-5 * max(1.0, out_r.abs().max().item()), f"{name} out"
    )
    for key, g in grads_r.items():
        atol = 1e-4 * max(1.0, g.abs().max().item())
        assert_close(grads[key].double().cpu(), g.cpu(), 1e-4, atol, f"{name} d{key}")


@pytest.mark.gpu
def test_fused_edge_cuda_bf16_messages():
    spec = SPECS["rgat"]
    _, ((out, _), (out_r, _)) = edge_case(spec, "triton", "cuda", 2, 64, 5, 500, 8000, dtype=torch.bfloat16)
    assert_close(out.double().cpu(), out_r.cpu(), 3e-2, 3e-2, "bf16 out")


@pytest.mark.gpu
def test_int64_offsets_past_2_31_cuda():
    """Message rows whose element offset exceeds 2^31 (an ~8.6 GB table): int32 addressing would wrap."""
    heads, dim = 1, 64
    first = (2**31) // (heads * dim) + 8  # rows at and past this index start beyond 2^31 elements
    msg = torch.empty(first + 64, heads, dim, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    msg[first:] = torch.randn(64, heads, dim, device="cuda", generator=gen)
    msg[:64] = torch.randn(64, heads, dim, device="cuda", generator=gen)
    rows = torch.cat([torch.arange(first, first + 64), torch.arange(0, 64)]).cuda()
    dst_ptr = torch.tensor([0, 64, 128], device="cuda")
    spec = SPECS["rgcn_sum"]
    out = fused_edge(spec, dst_ptr, msg, rows, backend="triton")
    want = torch.stack([msg[first:].sum(0), msg[:64].sum(0)])
    assert_close(out, want, 1e-5, 1e-4, "int64 fused_edge")
    x = msg.view(-1, dim)  # gather_gemm rows past 2^31 elements too
    w = torch.randn(1, dim, 16, device="cuda", generator=gen)
    ptr = torch.tensor([0, 128], device="cuda")
    got = gather_gemm(x, w, rows, ptr, backend="triton")
    assert_close(got, x[rows] @ w[0], 1e-5, 1e-4, "int64 gather_gemm")


def _ahead_of_time_compile(fn, ptr_args, consts, int_args=()):
    """Compile a generated kernel for sm_90 without a GPU (Triton's full pipeline down to a cubin)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    index_names = (
        "dst_ptr",
        "edge_rel_ptr",
        "a_idx_ptr",
        "out_idx_ptr",
        "rel_ptr_ptr",
        "tile_rel_ptr",
        "tile_row_ptr",
    )
    sig = {a: "*i64" if ("row" in a or a in index_names) else "*fp32" for a in ptr_args}
    sig |= {a: "i32" for a in int_args} | {k: "constexpr" for k in consts}
    # Pointers 16-byte aligned, as Triton specialises them at a real launch with torch allocations.
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(ptr_args))}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32))


@pytest.mark.parametrize(
    "name,node_dst", [("rgcn_mean", False), ("rgat", True), ("dot_all", False), ("hgt", True)]
)
def test_generated_edge_kernels_compile_for_sm90(name, node_dst):
    spec = SPECS[name]
    src = generate_edge_kernel_source(spec, dst_term_per_node=node_dst)
    mod = load_source(f"edge_{spec.key()}_n{int(node_dst)}", src, interpret=False)
    consts = {"H": 2, "D": 64, "BLOCK_E": 16, "BLOCK_H": 2, "BLOCK_D": 64} | (
        {"DP": 32, "BLOCK_DP": 32} if spec.score == "dot" else {}
    )
    flags = {f: True for f in mod.BWD_FLAGS}
    for fn, args, c in (
        (mod.edge_fwd_kernel, mod.FWD_ARGS, consts),
        (mod.edge_bwd_kernel, mod.BWD_ARGS, consts | flags),
    ):
        kernel = _ahead_of_time_compile(fn, args, c)
        ptx = kernel.asm["ptx"]
        assert ".entry" in ptx and ("atom" in ptx or fn is mod.edge_fwd_kernel)
        # Message rows (H * D contiguous fp32) are read with 16-byte vector loads.
        assert "ld.global.v4" in ptx, "message-row loads are not vectorised"


def test_generated_gather_gemm_uses_tensor_cores_for_sm90():
    for precision in ("tf32", "bf16"):
        mod = load_source(f"gemm_{precision}", generate_gather_gemm_source(precision), interpret=False)
        ptrs = [
            "a_ptr",
            "a_idx_ptr",
            "w_ptr",
            "out_ptr",
            "out_idx_ptr",
            "rel_ptr_ptr",
            "tile_rel_ptr",
            "tile_row_ptr",
        ]
        ints = ["K", "N", "R", "stride_am", "stride_wr", "stride_wk", "stride_wn", "stride_om"]
        consts = {"GATHER_A": True, "SCATTER_OUT": False, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}
        ptx = _ahead_of_time_compile(mod.gather_gemm_kernel, ptrs, consts, ints).asm["ptx"]
        assert "mma" in ptx, f"{precision}: no tensor-core instruction in the PTX"
