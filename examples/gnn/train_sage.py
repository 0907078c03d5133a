"""GraphSAGE node classification through ``dsx.initialize`` with the GPU neighbor loader (dsx.direct).

Data parallel with DeepSpeed on 1..N GPUs (or CPU ranks with gloo); every rank samples its own share of the
seeds each epoch; features stay in host memory (zero-copy gathers, one shared copy per node) or on the GPU::

    deepspeed --num_gpus 2 examples/gnn/train_sage.py --deepspeed_config configs/gnn_sage.json
    python examples/gnn/train_sage.py --deepspeed_config configs/gnn_sage.json     # one process
    ... --nodes 2400000 --edges 62000000 --features 128 --feature-placement host   # ogbn-products' size
    ... --dataset graph.pt          # a torch.save'd torch_geometric.data.Data (x, y, edge_index[, train_mask])
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

import dsx
import dsx.direct
from dsx.cli import run_entry_point
from dsx.config import load_deepspeed_config
from dsx.data.rmat import rmat_graph
from dsx.direct import DistributedNeighborLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: the start-up the examples share
from _launch import add_loop_args, fit, init_distributed, param_digest

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="GraphSAGE through dsx.initialize with dsx.direct.NeighborLoader",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="this rank's GPU on its machine (set by the launcher)")  # fmt: skip
    p.add_argument("--nodes", type=int, default=20_000, help="nodes of the generated R-MAT graph")
    p.add_argument("--edges", type=int, default=200_000, help="edges of the generated R-MAT graph")
    p.add_argument("--features", type=int, default=32, help="feature width of the generated graph")
    p.add_argument("--classes", type=int, default=8, help="label classes of the generated graph")
    p.add_argument("--hidden", type=int, default=128, help="GraphSAGE hidden size")
    p.add_argument("--fanouts", default="15,10,5", help="neighbours sampled per hop, comma-separated")
    p.add_argument("--dataset", default=None, help="torch.save'd torch_geometric.data.Data")
    p.add_argument("--train-fraction", type=float, default=0.0,
                   help="keep this fraction of all nodes as training seeds (and as many validation seeds); "
                        "0: the dataset's masks (rmat: 80 / 20 %%)")  # fmt: skip
    p.add_argument(
        "--no-trim",
        action="store_true",
        help="run every layer on every sampled node "
        "(default: PyG's trim_to_layer, each layer only on nodes that still reach the seeds)",
    )
    add_loop_args(p)
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args(argv)
    if args.deepspeed_config is None:
        p.error("--deepspeed_config is required (see configs/gnn_sage.json)")
    return args


def _load(args: argparse.Namespace) -> Any:
    if args.dataset:
        data = torch.load(args.dataset, weights_only=False)
        if getattr(data, "train_mask", None) is None:
            g = torch.Generator().manual_seed(args.seed)
            data.train_mask = torch.rand(data.num_nodes, generator=g) < 0.8
            data.val_mask = ~data.train_mask
        return data
    # Generated on the GPU when there is one (seconds instead of minutes); every rank builds the same graph.
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    data = rmat_graph(args.nodes, args.edges, args.features, args.classes, seed=args.seed, device=dev)
    if args.train_fraction:
        g = torch.Generator().manual_seed(args.seed + 1)
        order = torch.randperm(data.num_nodes, generator=g)
        k = max(1, int(args.train_fraction * data.num_nodes))
        data.train_mask = torch.zeros(data.num_nodes, dtype=torch.bool)
        data.val_mask = torch.zeros(data.num_nodes, dtype=torch.bool)
        data.train_mask[order[:k]] = True
        data.val_mask[order[k : 2 * k]] = True
    return data


def _memory(ux: Any) -> dict[str, Any]:
    """This process's memory (GB) from /proc: RSS, its shared-memory part, PSS and USS (private pages), and the
    node's Shmem total; with the size of the shared feature segment (0 when features are not shared)."""
    out: dict[str, Any] = {"pid": os.getpid()}
    try:
        with open("/proc/self/smaps_rollup") as f:
            kv = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.split()[-1] == "kB"}
        out |= {"rss_gb": kv["Rss"] / 1e9, "pss_gb": kv["Pss"] / 1e9,
                "uss_gb": (kv["Private_Clean"] + kv["Private_Dirty"]) / 1e9,
                "shared_gb": (kv["Shared_Clean"] + kv["Shared_Dirty"]) / 1e9}  # fmt: skip
        with open("/proc/self/status") as f:
            st = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.rstrip().endswith("kB")}
        out["rss_shmem_gb"] = st.get("RssShmem", 0) / 1e9
        with open("/proc/meminfo") as f:
            mi = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f}
        out["node_shmem_gb"] = mi["Shmem"] / 1e9
    except (OSError, KeyError, ValueError) as exc:  # not Linux: say so instead of failing the run
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["feature_table_gb"] = ux.nbytes / 1e9 if ux is not None else None
    out["feature_table_shared"] = bool(ux is not None and ux.shared)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from torch_geometric.nn import GraphSAGE

    args = parse_args(argv)
    ds_config = load_deepspeed_config(args.deepspeed_config)
    rank, _ = init_distributed(args.local_rank)
    data = _load(args)
    num_classes = int(data.y.max()) + 1
    fanouts = [int(k) for k in args.fanouts.split(",")]
    torch.manual_seed(args.seed)
    num_features = data.num_features
    model = GraphSAGE(num_features, args.hidden, len(fanouts), num_classes)
    engine, _, _, _ = dsx.initialize(
        args=args, model=model, model_parameters=model.parameters(), config=ds_config
    )
    bs = engine.train_micro_batch_size_per_gpu()
    ux = None
    if args.feature_placement == "host":  # on a CPU-only machine too: one shared copy per node
        # Pin (and share per node) once; the train and val loaders gather from the same table.
        ux = dsx.direct.unified(data.x, name="sage_features")
        data.x = ux
    kw = dict(device=engine.device, feature_placement=args.feature_placement, engine=engine, seed=args.seed)
    train = DistributedNeighborLoader(data, fanouts, bs, shuffle=True, input_nodes=data.train_mask, **kw)
    val = DistributedNeighborLoader(data, fanouts, bs, input_nodes=data.val_mask, **kw)

    def forward(b: Any) -> tuple[torch.Tensor, torch.Tensor]:
        hops = {} if args.no_trim else dict(num_sampled_nodes_per_hop=b.num_sampled_nodes,
                                             num_sampled_edges_per_hop=b.num_sampled_edges)  # fmt: skip
        return engine(b.x, b.edge_index, **hops)[: b.batch_size], b.y[: b.batch_size]

    history, losses = fit(engine, train, val, forward, args.epochs, max_batches=args.max_batches,
                          progress=rank == 0 and not args.no_progress, log=rank == 0)  # fmt: skip
    mem = _memory(ux)
    mems = [None] * dist.get_world_size()
    dist.all_gather_object(mems, mem)
    summary = {
        "final_val_acc": history[-1]["val_acc"], "first_val_acc": history[0]["val_acc"],
        "epoch_s": min(h["epoch_s"] for h in history), "world_size": dist.get_world_size(),
        "nodes": data.num_nodes, "edges": int(data.edge_index.shape[1]), "features": num_features,
        "feature_placement": args.feature_placement, "fanouts": fanouts, "batch_size": bs, "history": history,
        "train_seeds": int(data.train_mask.sum()), "trim": not args.no_trim, "memory_per_rank": mems,
        "losses": [float(x) for x in losses], "param_digest": param_digest(engine.module),
    }  # fmt: skip
    if rank == 0:
        print(
            f"final val accuracy {summary['final_val_acc']:.4f}; best epoch time {summary['epoch_s']:.2f} s"
        )
        for m in mems:
            if "rss_gb" in m:
                print(f"memory pid {m['pid']}: RSS {m['rss_gb']:.2f} GB (shared memory {m['rss_shmem_gb']:.2f}), "
                      f"USS {m['uss_gb']:.2f} GB, PSS {m['pss_gb']:.2f} GB; features {m['feature_table_gb'] or 0:.2f} GB "
                      f"shared={m['feature_table_shared']}; node Shmem {m['node_shmem_gb']:.2f} GB")  # fmt: skip
        if args.log_json:
            with open(args.log_json, "w") as f:
                json.dump(summary, f, indent=1)
    train.close()
    val.close()
    if ux is not None:
        ux.close()
    return summary


if __name__ == "__main__":
    run_entry_point(main)
