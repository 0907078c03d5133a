"""Kernel cases for the rgnn kernel tests: a generated kernel and its float64 PyTorch twin run on the same
inputs, outputs and gradients returned side by side (shared by the CPU and GPU tests)."""

from __future__ import annotations

import math

import torch

from dsx.rgnn.kernels import fused_edge, fused_edge_ref, gather_gemm, gather_gemm_ref
from tests.rgnn._rgnn_graphs import edge_graph, segments, to_device

__all__ = ["GRAD_KEYS", "assert_close", "edge_case", "gemm_case"]

GRAD_KEYS = ("src_term", "dst_term", "rel_scale", "edge_weight")


def gemm_case(backend, device, n, k, nout, num_rel, m, seed, precision="fp32", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    row_idx, rel_ptr = segments(num_rel, m, n, gen, empty=(1, num_rel - 1))
    x = torch.randn(n, k, generator=gen).to(device, dtype)
    w = (torch.randn(num_rel, k, nout, generator=gen) / math.sqrt(k)).to(device, dtype)
    row_idx, rel_ptr = row_idx.to(device), rel_ptr.to(device)
    g = torch.randn(m, nout, generator=gen).to(device, dtype)
    results = []
    for fn in (
        lambda a, b: gather_gemm(a, b, row_idx, rel_ptr, precision=precision, backend=backend),
        lambda a, b: gather_gemm_ref(a.double(), b.double(), row_idx, rel_ptr),
    ):
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(a, b)
        out.backward(g.to(out.dtype))
        results.append((out.double(), a.grad.double(), b.grad.double()))
    return results


def assert_close(got, want, rtol, atol, what):
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def edge_case(
    spec,
    backend,
    device,
    heads,
    dim,
    seed,
    num_dst=9,
    num_edges=50,
    dtype=torch.float32,
    block_e=None,
    num_src=7,
    node_dst=False,
):
    gen = torch.Generator().manual_seed(seed)
    dst_ptr, msg, rows, kw = edge_graph(
        spec, num_dst, num_src, 4, num_edges, heads, dim, gen, dtype=dtype, node_dst=node_dst
    )
    dst_ptr, msg, rows, kw = dst_ptr.to(device), msg.to(device), rows.to(device), to_device(kw, device)
    gout = torch.randn(num_dst, heads, dim, generator=gen).to(device, dtype)
    results = []
    for impl, cast in (
        (lambda *a, **k: fused_edge(*a, backend=backend, block_e=block_e, **k), None),
        (fused_edge_ref, torch.double),
    ):
        m = (msg if cast is None else msg.to(cast)).clone().requires_grad_()
        args = {}
        for key, t in kw.items():
            if key in GRAD_KEYS:
                args[key] = (t if cast is None else t.to(cast)).clone().requires_grad_()
            else:
                args[key] = t
        out = impl(spec, dst_ptr, m, rows, **args)
        out.backward(gout.to(out.dtype))
        grads = {"msg": m.grad} | {k: args[k].grad for k in GRAD_KEYS if k in args}
        results.append((out, grads))
    return dst_ptr, results
