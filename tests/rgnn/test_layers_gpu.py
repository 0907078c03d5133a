"""GPU: dsx.rgnn layers on compiled Triton kernels against PyG on the same CUDA tensors (fp32 / tf32 / bf16)."""

from __future__ import annotations

import pytest
import torch
import torch_geometric.nn as pygnn

import dsx.rgnn as rg
from dsx.data.hetero import synthetic_hetero

# (precision, relative tolerance on outputs and gradients, measured against the largest magnitude)
PRECISIONS = [("fp32", 1e-4), ("tf32", 2e-2), ("bf16", 6e-2)]


def _graph():
    return synthetic_hetero("biokg", scale=0.02, num_features=0, labels=False, seed=3, device="cuda")


def _compare(ours, theirs, run, inputs, rtol):
    ours.load_state_dict(theirs.state_dict(), strict=True)
    res = []
    for mod in (theirs, ours):
        xs = [t.detach().clone().requires_grad_(True) for t in inputs]
        out = run(mod, xs)
        (out * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
        res.append([out] + [t.grad for t in xs] + [p.grad for _, p in sorted(mod.named_parameters())])
    for want, got in zip(*res):
        if want is None:
            continue
        scale = want.abs().max().item() + 1e-12
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * scale)


@pytest.mark.gpu
@pytest.mark.parametrize("precision,rtol", PRECISIONS)
@pytest.mark.parametrize("aggr", ["mean", "sum"])
def test_rgcn_cuda(precision, rtol, aggr):
    g = _graph()
    theirs = pygnn.RGCNConv(64, 64, g.num_relations, aggr=aggr).cuda()
    ours = rg.RGCNConv(64, 64, g.num_relations, aggr=aggr, precision=precision, backend="kernels").cuda()
    x = torch.randn(g.num_nodes, 64, device="cuda")
    _compare(ours, theirs, lambda m, xs: m(xs[0], g.edge_index, g.edge_type), [x], rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("precision,rtol", PRECISIONS)
@pytest.mark.parametrize("heads", [1, 4])
def test_rgat_cuda(precision, rtol, heads):
    g = _graph()
    theirs = pygnn.RGATConv(32, 16, g.num_relations, heads=heads).cuda()
    ours = rg.RGATConv(32, 16, g.num_relations, heads=heads, precision=precision).cuda()
    x = torch.randn(g.num_nodes, 32, device="cuda")
    _compare(ours, theirs, lambda m, xs: m(xs[0], g.edge_index, g.edge_type), [x], rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("precision,rtol", PRECISIONS)
def test_hgt_cuda(precision, rtol):
    g = _graph()
    x = torch.randn(g.num_nodes, 32, device="cuda")
    x_dict, ei = g.to_hetero(x)
    names = list(x_dict)
    theirs = pygnn.HGTConv(32, 32, g.metadata(), heads=4).cuda()
    ours = rg.HGTConv(32, 32, g.metadata(), heads=4, precision=precision).cuda()

    def run(m, xs):
        out = m(dict(zip(names, xs)), ei)
        return torch.cat([out[t] for t in names if t in out], 0)

    _compare(ours, theirs, run, [x_dict[t].contiguous() for t in names], rtol)
