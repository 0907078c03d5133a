"""Node classification on a heterogeneous graph with dsx.rgnn RGCN / RGAT / HGT through ``dsx.initialize``.

Default data: ``dsx.data.hetero.synthetic_hetero`` (labels depend on typed neighbourhoods, so accuracy rises).
``--dataset FILE`` takes a torch_geometric ``HeteroData`` saved with ``torch.save`` (node types with ``x``;
labels ``y`` on at least one type; nodes without labels are ignored).

    python examples/rgnn/train_rgnn.py --model rgat                   # single process, no launcher needed
    deepspeed examples/rgnn/train_rgnn.py --model hgt --deepspeed_config configs/rgnn.json

The "rgnn" section of the config (``configs/rgnn.json``) sets the layers' precision, backend and passes;
``--backend kernels|interpreter`` overrides its backend (the interpreter is the per-edge PyTorch spec).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import dsx
import dsx.rgnn as rg
from dsx.cli import run_entry_point
from dsx.config import load_deepspeed_config
from dsx.data.hetero import PRESETS, HeteroGraph, synthetic_hetero
from dsx.runtime.process import single_process_env

ROOT = Path(__file__).resolve().parents[2]


class Net(nn.Module):
    """Two relational layers (ReLU between) and a linear classifier."""

    def __init__(self, model: str, graph: HeteroGraph, in_dim: int, hidden: int, classes: int, heads: int):
        super().__init__()
        self.model, r, meta = model, graph.num_relations, graph.metadata()
        if model == "rgcn":
            self.convs = nn.ModuleList([rg.RGCNConv(in_dim, hidden, r), rg.RGCNConv(hidden, hidden, r)])
        elif model == "rgat":
            self.convs = nn.ModuleList([rg.RGATConv(in_dim, hidden // heads, r, heads=heads),
                                        rg.RGATConv(hidden, hidden // heads, r, heads=heads)])  # fmt: skip
        else:
            self.convs = nn.ModuleList([rg.HGTConv(in_dim, hidden, meta, heads=heads),
                                        rg.HGTConv(hidden, hidden, meta, heads=heads)])  # fmt: skip
        self.head = nn.Linear(hidden, classes)

    def forward(self, x, edge_index, edge_type, type_ptr):
        if self.model == "hgt":
            names = [f"t{t}" for t in range(type_ptr.numel() - 1)]
            ptr = type_ptr.tolist()
            h = {t: x[ptr[i] : ptr[i + 1]] for i, t in enumerate(names)}
            ei = self._hetero_edges
            for i, conv in enumerate(self.convs):
                out = conv(h, ei)
                h = {t: (out[t] if t in out else h[t].new_zeros(h[t].shape[0], out[next(iter(out))].shape[1]))
                     for t in names}  # fmt: skip
                if i + 1 < len(self.convs):
                    h = {t: F.relu(v) for t, v in h.items()}
            return self.head(torch.cat([h[t] for t in names], 0))
        h = x
        for i, conv in enumerate(self.convs):
            h = conv(h, edge_index, edge_type)
            if i + 1 < len(self.convs):
                h = F.relu(h)
        return self.head(h)


def load_dataset(path: str) -> HeteroGraph:
    data = torch.load(path, weights_only=False)
    homo = data.to_homogeneous()
    n = homo.num_nodes
    y = homo.y if getattr(homo, "y", None) is not None else torch.full((n,), -1)
    counts = torch.bincount(homo.node_type, minlength=len(data.node_types))
    type_ptr = torch.zeros(counts.numel() + 1, dtype=torch.long)
    type_ptr[1:] = counts.cumsum(0)
    et = data.edge_types
    tid = {t: i for i, t in enumerate(data.node_types)}
    split = torch.rand(n, generator=torch.Generator().manual_seed(0)) < 0.7
    labelled = y >= 0
    return HeteroGraph(homo.x, y, homo.node_type, type_ptr, homo.edge_index, homo.edge_type,
                       torch.tensor([tid[e[0]] for e in et]), torch.tensor([tid[e[2]] for e in et]),
                       int(y.max()) + 1, split & labelled, ~split & labelled)  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="this rank's GPU on its machine (set by the launcher)")  # fmt: skip
    p.add_argument("--model", choices=["rgcn", "rgat", "hgt"], default="rgcn", help="relational layer")
    p.add_argument("--preset", default="aifb", choices=list(PRESETS), help="shape of the synthetic graph")
    p.add_argument("--scale", type=float, default=0.3, help="synthetic graph size relative to the preset")
    p.add_argument("--dataset", default=None, help="a torch.save'd torch_geometric HeteroData instead")
    p.add_argument("--features", type=int, default=16, help="feature width of the synthetic graph")
    p.add_argument("--hidden", type=int, default=32, help="hidden size")
    p.add_argument("--heads", type=int, default=2, help="attention heads (rgat, hgt)")
    p.add_argument("--epochs", type=int, default=40, help="full-graph training epochs")
    p.add_argument("--seed", type=int, default=0, help="graph and model seed")
    p.add_argument("--backend", choices=["kernels", "interpreter"], default=None,
                   help="override the config's rgnn.backend (None: keep it)")  # fmt: skip
    p.add_argument("--deepspeed_config", default=str(ROOT / "configs" / "rgnn.json"), help="DeepSpeed config")
    p.add_argument("--log-json", default=None, help="write the summary here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    single_process_env()
    config = load_deepspeed_config(args.deepspeed_config)
    if args.backend is not None:
        config["dsx"]["rgnn"]["backend"] = "triton" if args.backend == "kernels" else "interpreter"
    if not torch.cuda.is_available():
        config["dsx"]["rgnn"]["precision"] = "fp32"  # CPU: the PyTorch twins / interpreter are fp32 anyway
    torch.manual_seed(args.seed)
    g = load_dataset(args.dataset) if args.dataset else synthetic_hetero(
        args.preset, scale=args.scale, num_features=args.features, seed=args.seed)  # fmt: skip
    model = Net(args.model, g, g.x.shape[1], args.hidden, g.num_classes, args.heads)
    engine, _, _, _ = dsx.initialize(
        args=args, model=model, model_parameters=model.parameters(), config=config
    )
    dev = engine.device
    x, ei, et, tp, y = (t.to(dev) for t in (g.x, g.edge_index, g.edge_type, g.type_ptr, g.y))
    train, test = g.train_mask.to(dev), g.test_mask.to(dev)
    if args.model == "hgt":
        model._hetero_edges = {k: v.to(dev) for k, v in g.to_hetero()[1].items()}
    losses, accs = [], []
    bar = tqdm(range(args.epochs), desc=f"{args.model}", disable=args.no_progress, file=sys.stdout)
    t0 = time.perf_counter()
    for _ in bar:
        engine.train()
        logits = engine(x, ei, et, tp)
        loss = F.cross_entropy(logits[train], y[train])
        engine.backward(loss)
        engine.step()
        with torch.no_grad():
            acc = float((logits[test].argmax(1) == y[test]).float().mean())
        losses.append(loss.item())
        accs.append(acc)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", acc=f"{acc:.3f}")
    summary = {"model": args.model, "backend": model.convs[0].options().backend, "nodes": g.num_nodes,
               "edges": int(g.edge_index.shape[1]), "relations": g.num_relations, "epochs": args.epochs,
               "losses": losses, "test_acc": accs, "final_test_acc": accs[-1],
               "wall_s": time.perf_counter() - t0}  # fmt: skip
    print(
        f"final test accuracy {accs[-1]:.4f} (first epoch {accs[0]:.4f}), loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    )
    if args.log_json:
        Path(args.log_json).write_text(json.dumps(summary))
    return summary


if __name__ == "__main__":
    run_entry_point(main)
