"""The rgnn IR: compiled programs equal the interpreter for every pass combination; gradcheck; passes."""

from __future__ import annotations

import itertools

import pytest
import torch

import dsx.rgnn as rg
from dsx.rgnn.programs import hgt_program, rgat_program, rgcn_program

N, R = 17, 4


def graph(seed=0, e=60):
    gen = torch.Generator().manual_seed(seed)
    ei = torch.stack([torch.randint(0, N, (e,), generator=gen), torch.randint(0, N - 3, (e,), generator=gen)])
    return rg.prepare(ei, torch.randint(0, R - 1, (e,), generator=gen), N, R)  # relation R-1 empty


def sage_program(k: int, m: int) -> rg.Program:
    """Relational GraphSAGE (mean over all in-neighbours of per-relation projections), as in the docs."""
    p = rg.Program(heads=1)
    h = p.typed_linear(p.node_input("x", k), p.rel_weight("W", k, m), "src")
    p.output(p.aggregate(h, reduce="mean"))
    return p


def cases(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=dtype)

    x = {"x": r(N, 5)}
    return {
        "rgcn_mean": (rgcn_program(5, 4, True), x, {"W": r(R, 5, 4)}),
        "rgcn_sum": (rgcn_program(5, 4, False), x, {"W": r(R, 5, 4)}),
        "rgat_pyg": (rgat_program(5, 3, 2, 0.2, False), x, {"W": r(R, 5, 6), "att_src": r(6, 2), "att_dst": r(6, 2)}),
        "rgat_hector": (
            rgat_program(5, 3, 2, 0.2, True), x, {"W": r(R, 5, 6), "att_src": r(R, 6, 2), "att_dst": r(R, 6, 2)},
        ),
        "hgt": (
            hgt_program(6, 2), {"k": r(N, 6), "q": r(N, 6), "v": r(N, 6)},
            {"Wk": r(R, 6, 6), "Wv": r(R, 6, 6), "scale": torch.rand(R, 2, generator=gen, dtype=dtype) + 0.5},
        ),
        "sage": (sage_program(5, 4), x, {"W": r(R, 5, 4)}),
    }  # fmt: skip


FLAGS = list(itertools.product([True, False], repeat=3))


@pytest.mark.parametrize("name", list(cases()))
@pytest.mark.parametrize("kb", ["reference", "interpret"])
def test_compiled_equals_interpreter_all_flags(name, kb):
    g = graph()
    prog, inputs, params = cases()[name]
    leaves = {**inputs, **params}
    for t in leaves.values():
        t.requires_grad_(True)
    ref = rg.interpret(prog, g, inputs, params)
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3))
    ref_grads = torch.autograd.grad((ref * cot).sum(), list(leaves.values()))
    flags = FLAGS if kb == "reference" else [(True, True, True), (False, False, True)]
    for cm, lr, fu in flags:
        fn = rg.compile(prog, compact_materialization=cm, linear_reorder=lr, fusion=fu, kernel_backend=kb)
        out = fn(g, inputs, params)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        grads = torch.autograd.grad((out * cot).sum(), list(leaves.values()))
        for key, a, b in zip(leaves, grads, ref_grads):
            torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4, msg=lambda m, k=key: f"{name} {k}: {m}")


@pytest.mark.parametrize("name", list(cases()))
def test_interpreter_gradcheck(name):
    g = graph(seed=1, e=25)
    prog, inputs, params = cases(torch.float64, seed=2)[name]
    keys = list(inputs) + list(params)
    leaves = [t.requires_grad_(True) for t in list(inputs.values()) + list(params.values())]

    def f(*ts):
        d = dict(zip(keys, ts))
        return rg.interpret(prog, g, {k: d[k] for k in inputs}, {k: d[k] for k in params})

    assert torch.autograd.gradcheck(f, leaves, atol=1e-6)


def test_passes_rewrite_the_program():
    prog = rgat_program(5, 3, 2, 0.2, False)
    ops = [v.op for v in rg.passes.linear_reorder(prog).values]
    assert "linear" not in ops and ops.count("compose") == 2  # (x W_r) k -> x (W_r k), both terms
    fused = rg.compile(prog).program
    assert fused.out.op == "fused_edge"
    spec = fused.out.attrs["spec"]
    assert (spec.score, spec.softmax, spec.leaky_relu_slope) == ("add", True, 0.2)
    assert all(v.attrs.get("compact") for v in fused.values if v.op == "typed_linear")
    assert rg.compile(prog, fusion=False).program.out.op == "aggregate"
    hgt = rg.compile(hgt_program(6, 2)).program.out.attrs["spec"]
    assert (hgt.score, hgt.rel_scale, hgt.softmax) == ("dot", True, True)
    # A chain the edge template cannot express (softmax of an unscored weight) stays unfused.
    p = rg.Program(heads=1)
    h = p.typed_linear(p.node_input("x", 3), p.rel_weight("W", 3, 2), "src")
    p.output(p.aggregate(h, p.edge_softmax(p.scale(p.edge_scalar("inv_deg"), p.rel_scalar("s")))))
    assert rg.compile(p).program.out.op == "aggregate"


def test_builder_errors():
    p = rg.Program(heads=2)
    x = p.node_input("x", 4)
    with pytest.raises(ValueError, match="expects 3"):
        p.typed_linear(x, p.rel_weight("W", 3, 4), "src")
    with pytest.raises(ValueError, match="divisible by heads=2"):
        p.typed_linear(x, p.rel_weight("W", 4, 5), "src")
    with pytest.raises(ValueError, match="no output"):
        rg.compile(p)
