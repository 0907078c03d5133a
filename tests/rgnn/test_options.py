"""Layer options follow the process defaults at call time; the DeepSpeed glue; no import cycle in dsx.rgnn."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import dsx
import dsx.rgnn as rg
from dsx.config import DsxConfigError, RGNNConfig
from dsx.rgnn import dispatch
from tests.rgnn.test_layers import rel_graph

PACKAGE = Path(rg.__file__).resolve().parent


def test_defaults_reach_the_layers():
    """The section's precision reaches the kernels: bf16 inputs change the result, the block's end undoes it."""
    ei, et = rel_graph()
    x = torch.randn(23, 7)
    layer = rg.RGCNConv(7, 6, 5, kernel_backend="interpret")
    exact = layer(x, ei, et)
    with dsx.defaults.set("rgnn", precision="bf16", compact_materialization=False):
        assert dsx.defaults.get("rgnn").compact_materialization is False
        assert layer.options().compact_materialization is False
        err = (layer(x, ei, et) - exact).abs().max()
        assert 1e-5 < err < 5e-2
    torch.testing.assert_close(layer(x, ei, et), exact)
    with dsx.defaults.set("rgnn", backend="interpreter"):
        assert layer._use_interpreter()
    assert not layer._use_interpreter()


def test_backend_default_changes_the_path_inside_the_block_only(monkeypatch):
    """``backend="interpreter"`` as a process default sends a layer built before the block through the
    per-edge interpreter, and only inside the block; the config's "triton" is the layer's "kernels"."""
    calls = []
    interpret = dispatch.interpret
    monkeypatch.setattr(dispatch, "interpret", lambda *a: calls.append(1) or interpret(*a))
    ei, et = rel_graph()
    x = torch.randn(23, 7)
    layer = rg.RGCNConv(7, 6, 5, kernel_backend="reference")
    fused = layer(x, ei, et)
    assert calls == [] and layer.options().backend == "auto"
    with dsx.defaults.set("rgnn", backend="interpreter"):
        assert layer.options().backend == "interpreter"
        torch.testing.assert_close(layer(x, ei, et), fused, atol=2e-5, rtol=1e-4)
        assert calls == [1]
    assert layer.options().backend == "auto"
    layer(x, ei, et)
    assert calls == [1]
    with dsx.defaults.set("rgnn", backend="triton"):
        assert layer.options().backend == "kernels" and not layer._use_interpreter()
    # A layer's own option wins over the defaults; kernel_backend is a layer option only.
    own = rg.RGCNConv(7, 6, 5, backend="kernels", precision="fp32", fusion=False)
    with dsx.defaults.set("rgnn", backend="interpreter", precision="bf16", fusion=True):
        o = own.options()
        assert (o.backend, o.precision, o.fusion, o.kernel_backend) == ("kernels", "fp32", False, None)


@pytest.mark.parametrize(
    ("changes", "key"),
    [({"precison": "bf16"}, "precison"), ({"backend": "kernels"}, "backend"), ({"kernel_backend": "x"},
     "kernel_backend")],
)  # fmt: skip
def test_bad_default_names_its_key(changes, key):
    before = dsx.defaults.get("rgnn")
    with pytest.raises(DsxConfigError, match=rf"dsx\.rgnn\.{key}\b"):
        dsx.defaults.set("rgnn", **changes)
    assert dsx.defaults.get("rgnn") == before


def test_bad_layer_backend():
    with pytest.raises(ValueError, match="backend='triton' is not one of"):
        rg.RGCNConv(4, 4, 2, backend="triton")


def test_an_engine_attaches_the_section_reports_it_and_closes(caplog):
    model = torch.nn.Linear(4, 4)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"torch_adam": True}},
              "dsx": {"rgnn": {"enabled": True, "precision": "tf32", "backend": "interpreter"}}}  # fmt: skip
    with caplog.at_level("INFO", logger="dsx"):
        engine, _, _, _ = dsx.initialize(model=model, model_parameters=model.parameters(), config=config)
    feature = engine.dsx.features["rgnn"]
    assert feature.section is engine.dsx.config.rgnn is dsx.defaults.get("rgnn")
    assert "precision=tf32 backend=interpreter" in caplog.text
    engine.dsx.close()
    assert dsx.defaults.get("rgnn") == RGNNConfig()  # the engine's section goes with it


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The dsx.rgnn modules ``path`` imports, anywhere in it (function-level imports count too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
    return {m for m in out if m in modules}


def test_no_import_cycle_in_rgnn():
    paths = {}
    for p in PACKAGE.rglob("*.py"):
        parts = p.relative_to(PACKAGE.parent.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {m: _imports(p, set(paths)) - {m} for m, p in paths.items()}
    # A package's __init__ re-exports its modules; the question is whether a module reaches back to itself.
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if n == "dsx.rgnn" or m == "dsx.rgnn":
                continue
            if state.get(n) == 1:
                raise AssertionError(f"import cycle: {' -> '.join([*stack[stack.index(n) :], n])}")
            if n not in state:
                visit(n, [*stack, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
