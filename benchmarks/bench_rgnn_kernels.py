"""Benchmark the rgnn kernels: fused edge kernel bandwidth and gather-GEMM TFLOP/s against PyTorch baselines.

Edge kernel: achieved bandwidth = bytes the kernel must move (message rows once per edge, score terms,
index arrays, outputs) / elapsed time, as a fraction of (a) a large device-to-device copy measured in the same
run (the practical ceiling) and (b) the data-sheet peak of the device when known. Messages are edge-wise
(one row per edge) for the headline figure, so no row can be served twice from cache and every counted byte
is DRAM traffic. Baseline: the PyTorch twin (index_select / index_add / scatter_reduce) on the same data.

Gather-GEMM: TFLOP/s (2*M*K*N per forward) of the one-launch kernel in fp32 / tf32 / bf16 against the
per-relation loop of ``torch.matmul`` (the PyG RGCNConv pattern) at the same precision.

    python benchmarks/bench_rgnn_kernels.py                 # GPU, ~2-3 min on an H100
    python benchmarks/bench_rgnn_kernels.py --quick         # CPU smoke run (Triton interpreter, tiny sizes)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median_seconds, save_png

from dsx.rgnn.kernels import EdgeSpec, fused_edge, fused_edge_ref, gather_gemm, gather_gemm_ref

PEAK_GBPS = {
    "H100 80GB HBM3": 3350.0,
    "H100 SXM": 3350.0,
    "H100 PCIe": 2000.0,
    "H100 NVL": 3900.0,
    "H200": 4800.0,
}
SPECS = {
    "rgcn_mean": EdgeSpec(edge_weight=True),
    "rgat": EdgeSpec(score="add", leaky_relu_slope=0.2, softmax=True),
    "hgt": EdgeSpec(score="dot", rel_scale=True, softmax=True),
}


def _timer(device: torch.device, repeats: int):
    def run(fn) -> float:
        fn()  # warm-up: compiles the kernel and fills the allocator
        return median_seconds(fn, repeats, device.type == "cuda")

    return run


def _peak_mb(fn, device: torch.device) -> float | None:
    """Peak memory allocated by ``fn`` above what was live before it (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def copy_ceiling_gbps(device: torch.device, nbytes: int, timeit) -> float:
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timeit(lambda: dst.copy_(src)) / 1e9  # read + write


def make_edges(spec, num_dst, num_edges, num_rel, heads, dim, device, gen):
    """Edge-wise messages (row e for edge e), Zipf-ish in-degrees, terms per (node, relation) as in RGAT/HGT."""
    deg_w = 1.0 / torch.arange(1, num_dst + 1, dtype=torch.float64) ** 0.6
    dst = torch.multinomial(deg_w.float(), num_edges, replacement=True, generator=gen).sort().values
    dst_ptr = torch.zeros(num_dst + 1, dtype=torch.int64)
    dst_ptr[1:] = torch.cumsum(torch.bincount(dst, minlength=num_dst), 0)
    rel = torch.randint(0, num_rel, (num_edges,), generator=gen)
    kw = {}
    if spec.has_logit:
        shape = (heads,) if spec.score == "add" else (heads, dim)
        kw["edge_src_row"] = torch.randint(0, num_dst, (num_edges,), generator=gen)
        kw["edge_dst_row"] = dst
        kw["src_term"] = torch.randn(num_dst, *shape, generator=gen)
        kw["dst_term"] = torch.randn(num_dst, *shape, generator=gen)
    if spec.rel_scale:
        kw["edge_rel"], kw["rel_scale"] = rel, torch.rand(num_rel, heads, generator=gen) + 0.5
    if spec.edge_weight:
        kw["edge_weight"] = torch.rand(num_edges, generator=gen)
    msg = torch.randn(num_edges, heads, dim, generator=gen)
    move = {k: v.to(device) for k, v in kw.items()}
    return dst_ptr.to(device), msg.to(device), torch.arange(num_edges, device=device), move


def edge_bytes(spec, num_dst, num_edges, heads, dim) -> int:
    """Bytes a forward must move: per-edge message rows and terms, indices, CSR, outputs (fp32 / int64)."""
    b = 8 * (num_dst + 1) + 8 * num_edges + 4 * num_edges * heads * dim + 4 * num_dst * heads * dim
    if spec.has_logit:
        per = heads if spec.score == "add" else heads * dim
        b += 2 * 8 * num_edges + 2 * 4 * num_edges * per
    if spec.rel_scale:
        b += 8 * num_edges + 4 * num_edges * heads  # relation id + a (cached) scale per edge
    if spec.edge_weight:
        b += 4 * num_edges
    if spec.softmax:
        b += 4 * num_dst * heads
    return b


def _bench_edge_spec(name, spec, args, device, backend, timeit, ceiling, peak, gen) -> dict:
    heads, dim = (1, args.dim) if name == "rgcn_mean" else (args.heads, args.dim // args.heads)
    dst_ptr, msg, msg_row, kw = make_edges(
        spec, args.nodes, args.edges, args.relations, heads, dim, device, gen
    )
    leaves = [msg] + [kw[k] for k in ("src_term", "dst_term", "rel_scale", "edge_weight") if k in kw]

    def fwd(impl=fused_edge):
        extra = {"backend": backend} if impl is fused_edge else {}
        return impl(spec, dst_ptr, msg, msg_row, **kw, **extra)

    def fwd_bwd(impl=fused_edge):
        for t in leaves:
            t.requires_grad_(True)
        out = fwd(impl)
        out.backward(torch.ones_like(out))
        for t in leaves:
            t.grad = None
            t.requires_grad_(False)

    with torch.no_grad():
        t_fwd = timeit(fwd)
        t_ref = timeit(lambda: fwd(fused_edge_ref))
        want = fwd(fused_edge_ref)
        torch.testing.assert_close(fwd(), want, rtol=1e-4, atol=1e-4 * max(1.0, want.abs().max().item()))
        del want
    t_fb, t_fb_ref = timeit(fwd_bwd), timeit(lambda: fwd_bwd(fused_edge_ref))
    # (Named apart from ``peak``, the data-sheet GB/s, so that the two cannot be confused.)
    mem, mem_ref = _peak_mb(fwd_bwd, device), _peak_mb(lambda: fwd_bwd(fused_edge_ref), device)
    nbytes = edge_bytes(spec, args.nodes, args.edges, heads, dim)
    gbps = nbytes / t_fwd / 1e9
    of_peak = "" if peak is None else f", {gbps / peak:5.1%} of the {peak:.0f} GB/s data-sheet peak"
    print(f"edge {name:10s} fwd {1e3 * t_fwd:8.3f} ms ({gbps:7.1f} GB/s, {gbps / ceiling:5.1%} of copy{of_peak}) "
          f"ref {1e3 * t_ref:8.3f} ms | fwd+bwd {1e3 * t_fb:8.3f} ms ref {1e3 * t_fb_ref:8.3f} ms", flush=True)  # fmt: skip
    return {
        "spec": name, "heads": heads, "dim": dim, "bytes": nbytes,
        "fwd_ms": 1e3 * t_fwd, "fwd_ref_ms": 1e3 * t_ref, "fwd_bwd_ms": 1e3 * t_fb, "fwd_bwd_ref_ms": 1e3 * t_fb_ref,
        "fwd_GBps": gbps, "fraction_of_copy": gbps / ceiling,
        "fraction_of_peak": None if peak is None else gbps / peak,
        "speedup_fwd": t_ref / t_fwd, "speedup_fwd_bwd": t_fb_ref / t_fb,
        "fwd_bwd_peak_extra_MB": mem, "fwd_bwd_ref_peak_extra_MB": mem_ref,
    }  # fmt: skip


def bench_edges(args, device, backend, timeit, ceiling, peak):
    gen = torch.Generator().manual_seed(0)
    return [
        _bench_edge_spec(name, spec, args, device, backend, timeit, ceiling, peak, gen)
        for name, spec in SPECS.items()
    ]


def _bench_gemm_precision(x, w, row_idx, rel_ptr, bounds, precision, backend, timeit) -> dict:
    num_rel, m, dim = w.shape[0], row_idx.numel(), x.shape[1]
    flops = 2.0 * m * dim * w.shape[2]
    xp, wp = (x.bfloat16(), w.bfloat16()) if precision == "bf16" else (x, w)

    def loop():
        return torch.cat([xp[row_idx[bounds[r] : bounds[r + 1]]] @ wp[r] for r in range(num_rel)])

    def kernel_fwd_bwd():
        a, b = x.detach().requires_grad_(), w.detach().requires_grad_()
        gather_gemm(a, b, row_idx, rel_ptr, precision=precision, backend=backend).sum().backward()

    def loop_fwd_bwd():
        a, b = xp.detach().requires_grad_(), wp.detach().requires_grad_()
        torch.cat(
            [a[row_idx[bounds[r] : bounds[r + 1]]] @ b[r] for r in range(num_rel)]
        ).float().sum().backward()

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        with torch.no_grad():
            t_k = timeit(lambda: gather_gemm(x, w, row_idx, rel_ptr, precision=precision, backend=backend))
            t_l = timeit(loop)
        t_kb, t_lb = timeit(kernel_fwd_bwd), timeit(loop_fwd_bwd)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    print(f"gemm dim {dim:4d} {precision}: kernel {1e3 * t_k:8.3f} ms ({flops / t_k / 1e12:6.2f} TFLOP/s) "
          f"loop {1e3 * t_l:8.3f} ms ({flops / t_l / 1e12:6.2f}) | fwd+bwd kernel {1e3 * t_kb:8.3f} ms "
          f"loop {1e3 * t_lb:8.3f} ms", flush=True)  # fmt: skip
    return {"dim": dim, "precision": precision, "rows": m, "relations": num_rel,
            "kernel_ms": 1e3 * t_k, "loop_ms": 1e3 * t_l, "kernel_TFLOPs": flops / t_k / 1e12,
            "loop_TFLOPs": flops / t_l / 1e12, "speedup": t_l / t_k,
            "kernel_fwd_bwd_ms": 1e3 * t_kb, "loop_fwd_bwd_ms": 1e3 * t_lb,
            "fwd_bwd_TFLOPs": 3 * flops / t_kb / 1e12, "speedup_fwd_bwd": t_lb / t_kb}  # fmt: skip


def bench_gemm(args, device, backend, timeit):
    gen = torch.Generator().manual_seed(1)
    num_rel, m = args.relations, args.edges
    sizes = 1.0 / torch.arange(1, num_rel + 1, dtype=torch.float64)  # Zipf relation sizes
    counts = torch.floor(sizes / sizes.sum() * m).long()
    counts[0] += m - counts.sum()
    rel_ptr = torch.zeros(num_rel + 1, dtype=torch.int64)
    rel_ptr[1:] = torch.cumsum(counts, 0)
    row_idx = torch.randint(0, args.nodes, (m,), generator=gen).to(device)
    bounds = rel_ptr.tolist()
    rel_ptr = rel_ptr.to(device)
    rows = []
    for dim in args.gemm_dims:
        x = torch.randn(args.nodes, dim, generator=gen).to(device)
        w = (torch.randn(num_rel, dim, dim, generator=gen) / math.sqrt(dim)).to(device)
        for precision in ("fp32", "tf32", "bf16"):
            rows.append(_bench_gemm_precision(x, w, row_idx, rel_ptr, bounds, precision, backend, timeit))
    # The reference twin is checked once at the end so a wrong kernel cannot produce a figure silently.
    got = gather_gemm(x, w, row_idx, rel_ptr, backend=backend)
    torch.testing.assert_close(got, gather_gemm_ref(x, w, row_idx, rel_ptr), rtol=1e-4, atol=1e-4)
    return rows


def plot(result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    edges = result["edge"]
    a.bar([r["spec"] for r in edges], [100 * r["fraction_of_copy"] for r in edges], color="tab:blue")
    a.set_ylabel("forward bandwidth, % of measured copy")
    a.set_title(f"fused edge kernel ({result['config']['edges']:,} edges)")
    gem = result["gemm"]
    labels = [f"{r['dim']}\n{r['precision']}" for r in gem]
    xs = range(len(gem))
    b.bar([i - 0.2 for i in xs], [r["kernel_TFLOPs"] for r in gem], 0.4, label="dsx gather-GEMM")
    b.bar([i + 0.2 for i in xs], [r["loop_TFLOPs"] for r in gem], 0.4, label="per-relation torch loop")
    b.set_xticks(list(xs), labels)
    b.set_ylabel("TFLOP/s")
    b.set_title(f"typed linear, {result['config']['relations']} relations")
    b.legend()
    fig.suptitle(result["device"])
    save_png(fig, path.parent, path.stem)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--quick", action="store_true", help="tiny sizes on CPU under the Triton interpreter")
    p.add_argument("--nodes", type=int, default=1_000_000)
    p.add_argument("--edges", type=int, default=8_000_000)
    p.add_argument("--relations", type=int, default=32)
    p.add_argument("--dim", type=int, default=64, help="H*D of the edge messages")
    p.add_argument("--heads", type=int, default=4, help="heads of the RGAT/HGT specs")
    p.add_argument("--gemm-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    if args.quick:
        args.nodes, args.edges, args.relations, args.dim, args.repeats = 40, 200, 5, 16, 1
        args.gemm_dims = [16]
    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    backend = "triton" if cuda else "interpret"
    timeit = _timer(device, args.repeats)
    name = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
    ceiling = copy_ceiling_gbps(device, (1 << 30) if cuda else (1 << 22), timeit)
    peak = next((v for k, v in PEAK_GBPS.items() if k in name), None) if cuda else None
    print(f"{name}: device copy {ceiling:.0f} GB/s; data-sheet peak {peak} GB/s", flush=True)
    result = {
        "benchmark": "bench_rgnn_kernels", "device": name, "backend": backend,
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "triton": __import__("triton").__version__},
        "config": vars(args), "copy_GBps": ceiling, "peak_GBps": peak,
    }  # fmt: skip
    result["edge"] = bench_edges(args, device, backend, timeit, ceiling, peak)
    result["gemm"] = bench_gemm(args, device, backend, timeit)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_rgnn_kernels.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "bench_rgnn_kernels.png")
    print(f"wrote {out / 'bench_rgnn_kernels.json'} and .png")
    return result


if __name__ == "__main__":
    main()
