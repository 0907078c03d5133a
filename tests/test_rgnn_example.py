"""The rgnn example trains (accuracy rises), the kernels and interpreter backends agree; data and bench smoke."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsx import defaults
from dsx.data.hetero import PRESETS, synthetic_hetero

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _restore_process_defaults():
    """The example leaves its engine attached, and with it the engine's sections as the process defaults;
    the tests after these start from the defaults of before."""
    # set() with no change: the block's end puts back the defaults (and scheduler) current now
    with defaults.set("rgnn"):
        yield


def _example():
    spec = importlib.util.spec_from_file_location("train_rgnn", ROOT / "examples" / "rgnn" / "train_rgnn.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_synthetic_hetero_statistics():
    g = synthetic_hetero("biokg", scale=0.01, num_features=8)
    assert g.num_relations == 51 and g.type_ptr.numel() == 6
    assert g.edge_index.shape[1] == int(PRESETS["biokg"].num_edges * 0.01)
    counts = torch.bincount(g.edge_type, minlength=51)
    assert counts.min() > 0 and counts[0] > 10 * counts[-1]  # Zipf sizes, none empty
    src_t, dst_t = g.node_type[g.edge_index[0]], g.node_type[g.edge_index[1]]
    assert torch.equal(src_t, g.rel_src_type[g.edge_type]) and torch.equal(dst_t, g.rel_dst_type[g.edge_type])
    deg = torch.bincount(g.edge_index[1], minlength=g.num_nodes).float()
    assert deg.max() > 5 * deg.mean()  # skewed degrees
    x_dict, ei_dict = g.to_hetero()
    assert sum(v.shape[1] for v in ei_dict.values()) == g.edge_index.shape[1]
    for (s, _, d), ei in ei_dict.items():
        assert ei.min() >= 0 and ei[0].max() < x_dict[s].shape[0] and ei[1].max() < x_dict[d].shape[0]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["rgcn", "rgat", "hgt"])
def test_example_trains_and_backends_agree(model, tmp_path):
    ex = _example()
    common = ["--model", model, "--scale", "0.08", "--epochs", "12", "--no-progress", "--hidden", "16"]
    runs = {}
    for backend in ("kernels", "interpreter"):
        runs[backend] = ex.main(
            [*common, "--backend", backend, "--log-json", str(tmp_path / f"{backend}.json")]
        )
    k, i = runs["kernels"], runs["interpreter"]
    # the layers follow the engine's section
    assert (k["backend"], i["backend"]) == ("kernels", "interpreter")
    assert json.loads((tmp_path / "kernels.json").read_text())["losses"] == k["losses"]
    assert k["losses"][-1] < 0.9 * k["losses"][0]
    assert max(k["test_acc"][-3:]) > k["test_acc"][0]
    torch.testing.assert_close(torch.tensor(k["losses"]), torch.tensor(i["losses"]), rtol=2e-3, atol=2e-3)


@pytest.mark.slow
def test_bench_quick_smoke(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_rgnn.py"), "--quick", "--out", str(tmp_path)],
                   check=True, cwd=ROOT, timeout=300)  # fmt: skip
    res = json.loads((tmp_path / "bench_rgnn.json").read_text())
    impls = {c["impl"] for c in res["cases"]}
    assert {"dsx:rgcn", "pyg:RGCNConv", "pyg:FastRGCNConv", "dsx:rgat", "pyg:RGATConv", "dsx:hgt"} <= impls
    assert res["ablation"] and res["prep"] and (tmp_path / "bench_rgnn.png").stat().st_size > 0


@pytest.mark.slow
def test_example_reads_pyg_heterodata(tmp_path):
    from torch_geometric.data import HeteroData

    g = synthetic_hetero("biokg", scale=0.01, num_features=8)
    x_dict, ei_dict = g.to_hetero()
    data, ptr = HeteroData(), g.type_ptr.tolist()
    for i, (t, x) in enumerate(x_dict.items()):
        data[t].x, data[t].y = x, g.y[ptr[i] : ptr[i + 1]]
    for key, ei in ei_dict.items():
        data[key].edge_index = ei
    torch.save(data, tmp_path / "graph.pt")
    res = _example().main(["--dataset", str(tmp_path / "graph.pt"), "--model", "rgat", "--epochs", "6",
                           "--no-progress", "--backend", "kernels"])  # fmt: skip
    assert res["nodes"] == g.num_nodes and res["relations"] == g.num_relations
    assert res["losses"][-1] < res["losses"][0]
