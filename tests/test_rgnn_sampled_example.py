"""The ogbn-mag-shaped graph has the schema, counts and structure it claims; the mini-batch example learns,
and on PyG's layers from the same initial weights it takes the same steps; bad datasets are named."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from dsx import defaults
from dsx.data.mag import MAG_EDGES, MAG_NODES, synthetic_mag
from dsx.direct.sampler import check_csr
from tests.harness import REPO, load_example


@pytest.fixture(autouse=True)
def _restore_process_defaults():
    """The example leaves its engine's sections as the process defaults (installed while the engine lives,
    which is until it is collected); later tests start from the built-in ones."""
    yield
    defaults.reset()


def test_synthetic_mag_has_the_schema_counts_and_structure() -> None:
    scale, classes = 0.004, 40
    d = synthetic_mag(scale, paper_features=16, num_classes=classes, seed=3)
    assert {t: d[t].num_nodes for t in d.node_types} == {
        t: max(int(c * scale), 2 * classes) for t, c in MAG_NODES.items()
    }
    assert len(d.edge_types) == 2 * len(MAG_EDGES)
    y = d["paper"].y
    for (s, name, t), count in MAG_EDGES.items():
        ei = d[s, name, t].edge_index
        assert ei.size(1) == int(count * scale)
        assert torch.equal(d[t, f"rev_{name}", s].edge_index, ei.flip(0))
        assert ei.min() >= 0 and ei[0].max() < d[s].num_nodes and ei[1].max() < d[t].num_nodes
        deg = torch.bincount(ei[1], minlength=d[t].num_nodes).float()
        assert deg.max() > 5 * deg.mean(), (name, deg.max(), deg.mean())  # hubs
    cites = d["paper", "cites", "paper"].edge_index
    same = float((y[cites[0]] == y[cites[1]]).float().mean())
    assert 0.75 < same < 0.9  # homophily 0.8, plus chance
    writes = d["author", "writes", "paper"].edge_index
    assert float((writes[0] % classes == y[writes[1]]).float().mean()) > 0.75  # authors keep to their venue
    masks = d["paper"].train_mask.int() + d["paper"].val_mask.int() + d["paper"].test_mask.int()
    assert bool((masks == 1).all())
    assert d["paper"].x.shape == (d["paper"].num_nodes, 16)
    assert torch.equal(
        synthetic_mag(scale, paper_features=16, num_classes=classes, seed=3)["paper"].x, d["paper"].x
    )
    with pytest.raises(ValueError, match="homophily"):
        synthetic_mag(0.001, homophily=1.5)


def test_the_default_graph_stays_the_same() -> None:
    """Benchmarks compare runs across versions of this generator: its default draw sequence (homophily, noise,
    the edge-list layout, the CPU) is pinned by a digest of every edge list and the paper fields at a small
    scale. A change of torch's CPU random numbers would trip it too."""
    d = synthetic_mag(0.003, paper_features=8, num_classes=20, seed=1)
    h = hashlib.sha256()
    for et in d.edge_types:
        h.update(d[et].edge_index.numpy().tobytes())
    for key in ("x", "y", "train_mask", "val_mask", "test_mask"):
        h.update(d["paper"][key].numpy().tobytes())
    assert h.hexdigest() == "46a0649e5394d3c2880475f2089df17ba11c6471861696b2dd25e11102368514"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_csr_layout_holds_the_same_edges_as_the_edge_lists(device) -> None:
    """``layout="csr"`` on the CPU draws the same numbers as ``"coo"``: the same edge multiset per type, each
    reverse type the transpose; on a GPU, another draw of the same shape. Splits follow ``split``."""
    kw = dict(paper_features=8, num_classes=20, seed=1, split=(0.1, 0.05, 0.0))
    coo, csr = synthetic_mag(0.003, **kw), synthetic_mag(0.003, layout="csr", device=device, **kw)
    for et in coo.edge_types:
        rowptr, col = csr[et].rowptr, csr[et].col
        assert "edge_index" not in csr[et] and col.dtype == torch.int32 and rowptr.device.type == device
        dst = torch.repeat_interleave(torch.arange(rowptr.numel() - 1, device=device), rowptr.diff())
        pairs = torch.stack([col.long(), dst]).cpu()
        assert pairs.size(1) == coo[et].edge_index.size(1)
        check_csr(rowptr, col, csr[et[2]].num_nodes, csr[et[0]].num_nodes, str(et))
        if device == "cpu":
            key = lambda e: torch.sort(e[0] * 10**7 + e[1]).values  # noqa: E731
            assert torch.equal(key(pairs), key(coo[et].edge_index)), et
        if et[1].startswith("rev_"):
            fwd = (et[2], et[1][4:], et[0])
            f_dst = torch.repeat_interleave(torch.arange(csr[fwd].rowptr.numel() - 1, device=device),
                                            csr[fwd].rowptr.diff())  # fmt: skip
            a = torch.sort(f_dst * 10**7 + csr[fwd].col.long()).values
            assert torch.equal(a, torch.sort(col.long() * 10**7 + dst).values), (
                f"{et} is not {fwd}'s transpose"
            )
    store = csr["paper"]
    assert store.x.device.type == "cpu" and store.test_mask.sum() == 0
    assert 0.07 < store.train_mask.float().mean() < 0.13 and not bool(
        (store.train_mask & store.val_mask).any()
    )
    with pytest.raises(ValueError, match="split"):
        synthetic_mag(0.001, split=(0.9, 0.2, 0.0))
    with pytest.raises(ValueError, match="layout"):
        synthetic_mag(0.001, layout="csc")


@pytest.mark.slow
def test_the_example_learns_and_pygs_layers_take_the_same_steps(tmp_path) -> None:
    ex = load_example("examples/rgnn/train_sampled.py")
    # fp32 also on a GPU (the config's tf32 would part from PyG's fp32 layers by more than rounding)
    config = json.loads((REPO / "configs" / "rgnn_sampled.json").read_text())
    config["dsx"]["rgnn"]["precision"] = "fp32"
    (tmp_path / "fp32.json").write_text(json.dumps(config))
    common = ["--model", "rgcn", "--scale", "0.003", "--classes", "40", "--epochs", "3", "--no-progress",
              "--deepspeed_config", str(tmp_path / "fp32.json")]  # fmt: skip
    ours = ex.main([*common, "--log-json", str(tmp_path / "dsx.json")])
    theirs = ex.main([*common, "--layers", "pyg"])
    assert ours["final_val_acc"] > ours["first_val_acc"] + 0.1, ours["history"]
    assert ours["losses"][-1] < ours["losses"][0] - 0.5, ours["losses"]
    # same batches, same initial weights: PyG's layers on the homogeneous view take the same steps
    torch.testing.assert_close(
        torch.tensor(theirs["losses"]), torch.tensor(ours["losses"]), rtol=1e-3, atol=1e-4
    )
    assert abs(theirs["final_val_acc"] - ours["final_val_acc"]) < 0.01
    assert (tmp_path / "dsx.json").exists()


@pytest.mark.parametrize("model", ["rgat", "hgt"])
def test_attention_models_train_on_batches(model) -> None:
    ex = load_example("examples/rgnn/train_sampled.py")
    where = ["--prepare-graph", "loader"] if model == "hgt" else []  # the graph prepared in the loader, once
    out = ex.main(
        ["--model", model, "--scale", "0.002", "--classes", "20", "--epochs", "2", "--no-progress", *where]
    )
    assert all(torch.isfinite(torch.tensor(out["losses"])))
    assert out["losses"][-1] < out["losses"][0], out["losses"]


def test_a_dataset_without_labels_is_named(tmp_path) -> None:
    d = synthetic_mag(0.001, num_classes=8, paper_features=4)
    del d["paper"].y
    torch.save(d, tmp_path / "g.pt")
    ex = load_example("examples/rgnn/train_sampled.py")
    with pytest.raises(SystemExit, match="node type 'paper' needs x and y"):
        ex.main(["--dataset", str(tmp_path / "g.pt"), "--no-progress"])
