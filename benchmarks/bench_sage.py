"""End-to-end 3-layer GraphSAGE epoch time: PyG NeighborLoader (CPU sampling) vs dsx.direct loaders.

(a) PyG NeighborLoader, CPU sampling (torch-sparse / pyg-lib), features in host memory, num_workers 0/4/8;
(b) dsx loader, GPU sampling, features in host memory (unified tensor when dsx.direct.unified exists);
(c) dsx loader, graph and features in GPU memory. Each times a fixed number of batches after warm-up and
extrapolates epoch time = per-batch time x batches per epoch (stated in the JSON as "extrapolated").

    python benchmarks/bench_sage.py                 # 2.4M nodes / 62M edges / 128 features (ogbn-products size)
    python benchmarks/bench_sage.py --quick         # tiny CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "gnn"))
from train_sage import SAGE

from dsx.data.rmat import rmat_graph
from dsx.direct import NeighborLoader


def _train(model, opt, loader, device, batches: int, warmup: int = 3) -> float:
    it = iter(loader)
    t0 = None
    for i in range(warmup + batches):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        b = next(it)
        x, y, ei = b.x.to(device, non_blocking=True).float(), b.y.to(device), b.edge_index.to(device)
        out = model(x, ei, b.num_sampled_nodes, b.num_sampled_edges)
        loss = F.cross_entropy(out[: b.batch_size], y[: b.batch_size])
        opt.zero_grad()
        loss.backward()
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / batches


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--nodes", type=int, default=2_400_000)
    p.add_argument("--edges", type=int, default=62_000_000)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--workers", default="0,4,8")
    a = p.parse_args()
    if a.quick:
        a.nodes, a.edges, a.features, a.batch_size, a.batches, a.workers = 5000, 50000, 16, 128, 3, "0"
    device = torch.device("cuda" if torch.cuda.is_available() and not a.quick else "cpu")
    t = time.perf_counter()
    data = rmat_graph(a.nodes, a.edges, a.features, 47, seed=0)
    gen_s = time.perf_counter() - t
    fan = [15, 10, 5]
    n_batches_epoch = -(-a.nodes // a.batch_size)
    res: dict = {"config": vars(a), "graph_gen_s": gen_s, "batches_per_epoch": n_batches_epoch, "runs": {}}
    res["note"] = "epoch_s is extrapolated: per-batch time over `batches` timed batches x batches_per_epoch"

    def run(name: str, loader) -> None:
        torch.manual_seed(0)
        model = SAGE(a.features, 256, 47).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        per = _train(model, opt, loader, device, a.batches)
        res["runs"][name] = {"per_batch_s": per, "epoch_s": per * n_batches_epoch}
        print(f"{name}: {per * 1e3:.1f} ms/batch, epoch ~{per * n_batches_epoch:.1f} s", flush=True)

    try:
        from torch_geometric.loader import NeighborLoader as PygLoader

        for w in [int(x) for x in a.workers.split(",")]:
            ld = PygLoader(data, num_neighbors=fan, batch_size=a.batch_size, shuffle=True, num_workers=w)
            try:
                run(f"pyg_cpu_w{w}", ld)
            except ImportError as e:  # no torch-sparse / pyg-lib: PyG cannot sample
                res["runs"][f"pyg_cpu_w{w}"] = {"error": str(e)[:300]}
                break
    except ImportError as e:
        res["runs"]["pyg_cpu"] = {"error": str(e)[:300]}
    host = data.clone()
    if device.type == "cuda":
        import dsx.direct as dd

        if hasattr(dd, "unified"):
            host.x = dd.unified(host.x)
    run(
        "dsx_host_features",
        NeighborLoader(host, fan, batch_size=a.batch_size, shuffle=True, device=device, seed=0),
    )
    gpu = data.clone()
    gpu.x, gpu.y = gpu.x.to(device), gpu.y.to(device)
    run("dsx_gpu_all", NeighborLoader(gpu, fan, batch_size=a.batch_size, shuffle=True, device=device, seed=0))
    pyg = [r["epoch_s"] for k, r in res["runs"].items() if k.startswith("pyg") and "epoch_s" in r]
    b, c = res["runs"]["dsx_host_features"]["epoch_s"], res["runs"]["dsx_gpu_all"]["epoch_s"]
    res["speedup_vs_best_pyg"] = (min(pyg) / b) if pyg else None
    res["host_over_gpu"] = b / c
    res["device"] = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    res["versions"] = {"torch": torch.__version__, "python": platform.python_version()}
    for mod in ("torch_geometric", "deepspeed"):
        try:
            res["versions"][mod] = __import__(mod).__version__
        except ImportError:
            pass
    res["date_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_sage.json"), "w") as f:
        json.dump(res, f, indent=2)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k, r in res["runs"].items() if "epoch_s" in r]
    plt.figure(figsize=(7, 3.5))
    plt.barh(names, [res["runs"][k]["epoch_s"] for k in names])
    plt.xlabel("epoch time, s (extrapolated)")
    plt.title(f"GraphSAGE [15,10,5], batch {a.batch_size}, {a.nodes} nodes / {a.edges} edges")
    plt.tight_layout()
    plt.savefig(os.path.join(a.out, "bench_sage.png"))


if __name__ == "__main__":
    main()
