"""Mini-batch node classification with RGCN / RGAT / HGT on an ogbn-mag-shaped graph through ``dsx.initialize``.

Typed neighbours are sampled on the GPU (``dsx.direct.DistributedHeteroNeighborLoader``), paper features stay
in host memory as one shared unified tensor per node (or are copied to each GPU), and the fused relational
layers (``dsx.rgnn``) run on every batch's typed subgraph. Data parallel on 1..N GPUs (or CPU ranks, gloo)::

    deepspeed --num_gpus 2 examples/rgnn/train_sampled.py --model rgat --scale 1
    python examples/rgnn/train_sampled.py --model hgt                    # one process, a small graph
    ... --layers pyg     # the same model on torch_geometric's layers (PyG's RGCNConv / RGATConv / HGTConv)
    # paper features beyond an H100's memory (768-dim bf16, 91.6 GB in host memory), the graph (3.4B edges)
    # built on the GPU as CSRs, 1 % of the papers labelled as in MAG240M:
    deepspeed --num_gpus 1 examples/rgnn/train_sampled.py --scale 81 --features 768 --feature-dtype bf16 \
        --graph-layout csr --split 0.01,0.001,0.001 --epochs 2

The graph is ``dsx.data.mag.synthetic_mag`` (``--scale 1``: ogbn-mag's node and edge counts; paper labels
that its typed neighbourhood predicts better than its own features). ``--dataset FILE`` takes a
``torch.save``'d ``HeteroData`` with ``x`` and ``y`` (and optionally ``train_mask`` / ``val_mask``) on the
``--target`` node type instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import deepspeed
import torch

import dsx
import dsx.direct
import dsx.rgnn
from dsx.cli import run_entry_point
from dsx.config import load_deepspeed_config
from dsx.data.mag import synthetic_mag
from dsx.direct import DistributedHeteroNeighborLoader
from dsx.models.hetero_gnn import MODELS, HeteroClassifier

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: the start-up the examples share
from _launch import add_loop_args, fit, init_distributed, param_digest

__all__ = ["main", "parse_args"]

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="this rank's GPU on its machine (set by the launcher)")  # fmt: skip
    p.add_argument("--model", choices=MODELS, default="rgcn", help="relational layer")
    p.add_argument("--layers", choices=["dsx", "pyg"], default="dsx",
                   help="dsx: fused dsx.rgnn layers; pyg: torch_geometric.nn's, same parameters")  # fmt: skip
    p.add_argument("--scale", type=float, default=0.005, help="graph size relative to ogbn-mag")
    p.add_argument("--classes", type=int, default=349, help="paper classes of the generated graph")
    p.add_argument("--features", type=int, default=128, help="paper feature width of the generated graph")
    p.add_argument("--feature-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="paper feature dtype of the generated graph (bf16: 768-dim as MAG240M's)")  # fmt: skip
    p.add_argument("--split", default="0.8,0.1,0.1",
                   help="train,val,test fractions of the generated graph's papers (MAG240M labels about 1%%)")  # fmt: skip
    p.add_argument("--graph-layout", choices=["coo", "csr"], default="coo",
                   help="generated graph: coo (edge lists in host memory) or csr (built on this rank's GPU, "
                        "4 bytes an edge: for graphs whose edge lists would not fit in host memory)")  # fmt: skip
    p.add_argument("--loader-probe", type=int, default=0, metavar="N",
                   help="before training, time N batches of the loader alone (sampling and feature gathers) and "
                        "record the last one's size: what share of a step the data takes")  # fmt: skip
    p.add_argument("--dataset", default=None, help="a torch.save'd torch_geometric HeteroData instead")
    p.add_argument("--target", default="paper", help="the node type whose labels are learned")
    p.add_argument("--hidden", type=int, default=64, help="hidden size")
    p.add_argument("--heads", type=int, default=2, help="attention heads (rgat, hgt)")
    p.add_argument(
        "--prepare-graph",
        choices=["step", "loader"],
        default="step",
        help="dsx layers: prepare each batch's graph in the step or in the loader (dsx.rgnn.PrepareGraph)",
    )
    p.add_argument("--fanouts", default="25,20", help="neighbours sampled per hop and edge type")
    add_loop_args(p)
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args(argv)
    if args.deepspeed_config is None:
        args.deepspeed_config = str(ROOT / "configs" / "rgnn_sampled.json")
    return args


def _load(args: argparse.Namespace) -> Any:
    if not args.dataset:
        split = tuple(float(f) for f in args.split.split(","))
        on_gpu = args.graph_layout == "csr" and torch.cuda.is_available()
        return synthetic_mag(
            args.scale, paper_features=args.features, num_classes=args.classes, seed=args.seed, split=split,
            feature_dtype=torch.bfloat16 if args.feature_dtype == "bf16" else torch.float32,
            layout=args.graph_layout, device=torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu",
        )  # fmt: skip
    data = torch.load(args.dataset, weights_only=False)
    store = data[args.target]
    if getattr(store, "x", None) is None or getattr(store, "y", None) is None:
        raise SystemExit(f"--dataset: node type {args.target!r} needs x and y (see --target)")
    if getattr(store, "train_mask", None) is None:
        split = torch.rand(store.num_nodes, generator=torch.Generator().manual_seed(args.seed))
        store.train_mask, store.val_mask = split < 0.8, split >= 0.8
    elif getattr(store, "val_mask", None) is None:
        store.val_mask = ~store.train_mask
    return data


def _num_edges(store: Any) -> int:
    ei = getattr(store, "edge_index", None)
    return int(ei.size(1)) if ei is not None else int(store.col.numel())


def _probe_loader(loader: Any, n: int) -> dict[str, Any]:
    """ms a batch of ``loader`` alone over ``n`` batches after the first (at most the epoch's), and the last
    batch's size: the rate of the loader's thread, which makes one batch at a time. It draws from the loader's
    sampler: a run with the probe trains on other batches than one without."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    n = min(n, len(loader) - 1)
    if n < 1:
        return {"error": f"the loader has {len(loader)} batch(es) an epoch: nothing to time after the first"}
    it = iter(loader)
    b = next(it)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        b = next(it)
    sync()
    ms = 1e3 * (time.perf_counter() - t0) / n
    x_bytes = sum(v.numel() * v.element_size() for v in b.x_dict.values())
    return {"batches": n, "ms_per_batch": ms, "nodes": {t: int(b[t].num_nodes) for t in b.node_types},
            "edges": int(sum(b[e].edge_index.size(1) for e in b.edge_types)), "feature_mb": x_bytes / 1e6}  # fmt: skip


def _graph_gpu_gb(data: Any) -> float:
    """GB of the graph's arrays already on a GPU (the CSRs of ``--graph-layout csr``)."""
    arrays = [v for s in data.edge_stores for v in s.values() if isinstance(v, torch.Tensor) and v.is_cuda]
    return sum(a.numel() * a.element_size() for a in arrays) / 1e9


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    config = load_deepspeed_config(args.deepspeed_config)
    if not torch.cuda.is_available() and "rgnn" in config.get("dsx", {}):
        config["dsx"]["rgnn"]["precision"] = "fp32"  # CPU: the layers' PyTorch twins compute in fp32
    rank, world = init_distributed(args.local_rank)
    data = _load(args)
    fanouts = [int(k) for k in args.fanouts.split(",")]
    target = args.target
    classes = int(data[target].y.max()) + 1
    in_channels = {t: data[t].x.size(-1) for t in data.node_types if getattr(data[t], "x", None) is not None}
    torch.manual_seed(args.seed)

    def build(layers: str) -> HeteroClassifier:
        return HeteroClassifier(args.model, data.metadata(), in_channels, args.hidden, classes, heads=args.heads,
                                num_layers=len(fanouts), target=target, layers=layers)  # fmt: skip

    model = build("dsx")
    if args.layers == "pyg":  # PyG's layers from the same initial weights: runs differ only in the layers
        twin = build("pyg")
        twin.load_state_dict(model.state_dict(), strict=True)
        model = twin
    engine, _, _, _ = dsx.initialize(
        args=args, model=model, model_parameters=model.parameters(), config=config
    )
    bs = engine.train_micro_batch_size_per_gpu()
    shared = []
    if args.feature_placement == "host":  # one pinned copy per node, shared by the train and val loaders
        for t in in_channels:
            shared.append(dsx.direct.unified(data[t].x, name=f"mag_{t}_x"))
            data[t].x = shared[-1]
    kw = dict(device=engine.device, feature_placement=args.feature_placement, engine=engine, seed=args.seed)
    # --prepare-graph loader: each batch's graph is prepared in the loader's pipeline, beside the step before
    prep = (
        dsx.rgnn.PrepareGraph(engine.module)
        if args.layers == "dsx" and args.prepare_graph == "loader"
        else None
    )
    graph_gb = _graph_gpu_gb(data)  # generated there (--graph-layout csr); 0 for edge lists
    # the process's GPU peak so far: the graph's generation (--graph-layout csr), the model and the engine
    peak_before_training = torch.cuda.max_memory_allocated() / 1e9 if engine.device.type == "cuda" else None
    train = DistributedHeteroNeighborLoader(
        data, fanouts, (target, data[target].train_mask), bs, shuffle=True, transform=prep, **kw
    )
    val = DistributedHeteroNeighborLoader(data, fanouts, (target, data[target].val_mask), bs, **kw)
    # the peak reported is training's (graph, model, batches), apart from the generation's
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)

    def forward(b: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k = b[target].batch_size
        nodes = {t: b[t].num_nodes for t in b.node_types}
        return engine(b.x_dict, b.edge_index_dict, nodes)[:k], b[target].y[:k]

    probe = _probe_loader(train, args.loader_probe) if args.loader_probe else None
    history, losses = fit(engine, train, val, forward, args.epochs, max_batches=args.max_batches,
                          progress=rank == 0 and not args.no_progress, log=rank == 0)  # fmt: skip
    peak = torch.cuda.max_memory_allocated() / 1e9 if engine.device.type == "cuda" else None
    summary = {
        "model": args.model, "layers": args.layers, "world_size": world, "feature_placement": args.feature_placement,
        "nodes": {t: int(data[t].num_nodes) for t in data.node_types},
        "edges": {"__".join(e): _num_edges(data[e]) for e in data.edge_types}, "batches_per_epoch": len(train),
        "peak_gpu_gb_before_training": peak_before_training,
        "feature_gb": {t: data[t].x.nbytes / 1e9 for t in in_channels}, "graph_layout": args.graph_layout,
        "generated_graph_gpu_gb": graph_gb,
        "gpu_total_gb": torch.cuda.get_device_properties(engine.device).total_memory / 1e9
        if engine.device.type == "cuda" else None,
        "fanouts": fanouts, "batch_size": bs, "history": history, "first_val_acc": history[0]["val_acc"],
        "final_val_acc": history[-1]["val_acc"], "epoch_s": min(h["epoch_s"] for h in history),
        "peak_gpu_gb": peak, "loader_probe": probe, "sampling_device": str(train.sampler.device),
        "losses": [float(x) for x in losses], "param_digest": param_digest(engine.module),
    }  # fmt: skip
    if rank == 0:
        print(
            f"final val accuracy {summary['final_val_acc']:.4f}; best epoch time {summary['epoch_s']:.2f} s"
        )
        if args.log_json:
            Path(args.log_json).write_text(json.dumps(summary, indent=1))
    train.close()
    val.close()
    for ux in shared:
        ux.close()
    return summary


if __name__ == "__main__":
    run_entry_point(main)
