"""End-to-end GraphSAGE mini-batch training: PyG NeighborLoader (CPU sampling) vs dsx.direct (GPU sampling).

One process, one graph, one model: 3-layer GraphSAGE, fanouts [15, 10, 5], batch 1024, a synthetic R-MAT
graph of ogbn-products' size (2.4M nodes, 62M edges, 128-dim fp32 features in host memory), seeds = the
``--train-nodes`` training nodes (ogbn-products has 196,615). Configurations:

(a) ``pyg_cpu_w{N}``: ``torch_geometric.loader.NeighborLoader`` (torch-sparse / pyg-lib CPU sampling, CPU
    features, ``num_workers`` N), batches copied to the GPU;
(b) ``dsx_unified``: ``dsx.direct.NeighborLoader`` with the CSR on the GPU and features in host memory
    (zero-copy gathers, pipelined);
(c) ``dsx_gpu``: the same loader with the features in GPU memory.

Every configuration trains (forward, backward, Adam step) for ``--batches`` batches after ``--warmup``;
the epoch time is extrapolated from the measured batch time (stated as such in the JSON).
``--feature-table-gb N`` adds a run whose fp32 feature table (N GB, host memory) is larger than the GPU.
``--models trim,full``: PyG's hierarchical trimming (``trim_to_layer``; the headline figures) and the plain
model, each over the same loaders.

    python benchmarks/bench_sage.py                       # H100: about 4 minutes incl. graph generation
    python benchmarks/bench_sage.py --feature-table-gb 90 # adds the beyond-GPU-memory run
    python benchmarks/bench_sage.py --quick               # CPU smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import save_png

from dsx.data.rmat import rmat_graph
from dsx.direct import NeighborLoader


def _env() -> dict[str, Any]:
    info: dict[str, Any] = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                            "python": platform.python_version(), "torch": torch.__version__}  # fmt: skip
    for mod in ("deepspeed", "torch_geometric", "torch_sparse", "pyg_lib"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            info[mod] = None
    info["device"] = (
        torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    )
    return info


def _train_loop(
    batches: Any, model: torch.nn.Module, opt: Any, dev: torch.device, warmup: int, n: int, trim: bool = True
) -> dict:
    """Mean wall time per batch of ``next(loader)`` + forward + backward + Adam step + ``synchronize``: what
    the loader still costs after its overlap with training (sampling, gather, copies) is inside the figure.

    ``trim``: PyG's hierarchical trimming (``num_sampled_nodes_per_hop``): layer ``l`` runs only on the nodes
    and edges that still reach the seeds; the same model and loss either way."""
    it = iter(batches)
    times = []
    seeds = 0
    for i in range(warmup + n):
        t0 = time.perf_counter()
        try:
            b = next(it)
        except StopIteration:
            break
        if trim and getattr(b, "num_sampled_nodes", None) is None:
            raise RuntimeError("batches carry no num_sampled_nodes (PyG needs pyg-lib for that): cannot trim")
        x, ei, y = b.x.to(dev, non_blocking=True), b.edge_index.to(dev, non_blocking=True), b.y.to(dev)
        # Read the per-hop counts only when trimming: PyG's batches (torch-sparse sampling) do not have them.
        hops = {}
        if trim:
            hops = dict(
                num_sampled_nodes_per_hop=b.num_sampled_nodes, num_sampled_edges_per_hop=b.num_sampled_edges
            )
        out = model(x.float(), ei, **hops)[: b.batch_size]
        loss = F.cross_entropy(out, y[: b.batch_size])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            seeds += b.batch_size
    del it
    if not times:
        raise RuntimeError("no batches were timed: raise --train-nodes or lower --warmup/--batches")
    ms = 1e3 * sum(times) / len(times)
    return {"batch_ms": ms, "batches_timed": len(times), "final_loss": float(loss)}


def _model(f: int, classes: int, dev: torch.device) -> tuple[torch.nn.Module, Any]:
    from torch_geometric.nn import GraphSAGE

    torch.manual_seed(0)
    m = GraphSAGE(f, 256, 3, classes).to(dev)
    return m, torch.optim.Adam(m.parameters(), lr=3e-3)


def run(args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen_dev = dev if dev.type == "cuda" else torch.device("cpu")
    t0 = time.perf_counter()
    data = rmat_graph(args.nodes, args.edges, args.features, args.classes, seed=0, device=gen_dev)
    gen_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    train_idx = torch.randperm(args.nodes, generator=g)[: args.train_nodes]
    n_batches_epoch = math.ceil(train_idx.numel() / args.batch_size)
    fan = [15, 10, 5]
    res: dict[str, Any] = {"config": vars(args), "env": _env(), "graph_generation_s": gen_s,
                           "batches_per_epoch": n_batches_epoch,
                           "note": "epoch_s = batch_ms x batches_per_epoch (extrapolated from the timed batches)",
                           "runs": {}}  # fmt: skip

    # Model variants: "trim" (PyG's trim_to_layer, the headline) and "full" (every layer on every sampled
    # node); a variant's runs carry the suffix "" or "_full".
    variants = [(v, "" if v == "trim" else f"_{v}") for v in args.models]

    # (a) PyG, CPU sampling; run first, before any host memory is registered with CUDA (workers fork). One
    # PyG sampler (its CSC conversion takes seconds) serves every worker count.
    pyg_sampler = None
    for w in args.pyg_workers:
        name = f"pyg_cpu_w{w}"
        try:
            from torch_geometric.loader import NeighborLoader as PygLoader
            from torch_geometric.sampler import NeighborSampler as PygSampler

            if pyg_sampler is None:
                t1 = time.perf_counter()
                pyg_sampler = PygSampler(data, num_neighbors=fan, share_memory=max(args.pyg_workers) > 0)
                res["pyg_sampler_setup_s"] = time.perf_counter() - t1
            loader = PygLoader(data, num_neighbors=fan, batch_size=args.batch_size, shuffle=True,
                               input_nodes=train_idx, num_workers=w, persistent_workers=w > 0,
                               neighbor_sampler=pyg_sampler)  # fmt: skip
            for v, suffix in variants:
                try:  # per variant: PyG with torch-sparse gives no per-hop counts, so it cannot trim
                    m, opt = _model(args.features, args.classes, dev)
                    r = _train_loop(loader, m, opt, dev, args.warmup, args.pyg_batches, trim=v == "trim")
                except Exception as exc:
                    r = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                res["runs"][name + suffix] = r
                print(name + suffix, r, flush=True)
        except Exception as exc:  # PyG from PyPI cannot sample without pyg-lib / torch-sparse: record why
            res["runs"][name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            print(name, res["runs"][name], flush=True)
        loader = None  # stops persistent workers before the next run

    for name, placement in (("dsx_gpu", "gpu"), ("dsx_unified", "host")):
        t1 = time.perf_counter()
        loader = NeighborLoader(data, fan, batch_size=args.batch_size, shuffle=True, input_nodes=train_idx,
                                device=dev, feature_placement=placement, prefetch=2,
                                csr_placement="gpu" if dev.type == "cuda" else "auto")  # fmt: skip
        setup = time.perf_counter() - t1
        for v, suffix in variants:
            m, opt = _model(args.features, args.classes, dev)
            r = _train_loop(loader, m, opt, dev, args.warmup, args.batches, trim=v == "trim")
            r["setup_s"] = setup
            res["runs"][name + suffix] = r
            print(name + suffix, r, flush=True)
        loader.close()
        loader = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    for r in res["runs"].values():
        if "batch_ms" in r:
            r["epoch_s"] = r["batch_ms"] * n_batches_epoch / 1e3
    res["targets"] = {}
    for v, suffix in variants:
        pyg = {k: r["epoch_s"] for k, r in res["runs"].items()
               if k.startswith("pyg") and k.endswith(suffix) and (suffix or "_" not in k[len("pyg_cpu_") :]) and "epoch_s" in r}  # fmt: skip
        u, gpu = res["runs"]["dsx_unified" + suffix]["epoch_s"], res["runs"]["dsx_gpu" + suffix]["epoch_s"]
        best = min(pyg, key=pyg.get) if pyg else None
        res[f"summary{suffix}"] = {
            "model": v,
            "best_pyg": best,
            "best_pyg_batch_ms": res["runs"][best]["batch_ms"] if best else None,
            "speedup_unified_vs_best_pyg": pyg[best] / u if pyg else None,
            "speedup_gpu_vs_best_pyg": pyg[best] / gpu if pyg else None,
            "unified_over_gpu": u / gpu,
        }
        res["targets"][v] = {
            "speedup_vs_pyg >= 3": (pyg[best] / u >= 3) if pyg else None,
            "unified_over_gpu <= 1.3": u / gpu <= 1.3,
        }
    # The headline: the same model on both sides, trimmed where PyG could trim, else the full model.
    head = next((res[f"summary{x}"] for _, x in variants if res[f"summary{x}"]["best_pyg"]), None)
    if head is not None:
        res["headline_model"] = head["model"]
        res["speedup_unified_vs_best_pyg"] = head["speedup_unified_vs_best_pyg"]
        res["unified_over_gpu"] = head["unified_over_gpu"]

    if args.feature_table_gb:
        _write(res, Path(args.out))  # keep the main figures even if the big run dies (host memory, memlock)
        del data, loader, pyg_sampler
        import gc

        gc.collect()
        try:
            res["beyond_gpu_memory"] = _beyond(args, dev)
        except Exception as exc:
            res["beyond_gpu_memory"] = {"error": f"{type(exc).__name__}: {exc}"[:800]}
        print("beyond_gpu_memory", res["beyond_gpu_memory"], flush=True)
    return res


def _host_mem() -> dict[str, float]:
    """Host memory now (GB): MemTotal / MemAvailable from /proc/meminfo, and this process's peak RSS."""
    import resource

    info: dict[str, float] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, v = line.split(":", 1)
            if k in ("MemTotal", "MemAvailable"):
                info[k] = int(v.split()[0]) * 1024 / 1e9
    except OSError:
        pass
    info["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return info


def _beyond(args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    """A fp32 feature table of ``--feature-table-gb`` GB in host memory (more than the GPU holds) trains.

    The table is filled on the CPU in one parallel pass (``index_select`` of a few thousand label-dependent
    prototype rows: class centroid + noise), which is also the first touch of its pages, then pinned in place
    by the loader (``dsx.unified``; no copy) and gathered zero-copy.
    """
    nodes = args.big_nodes
    mem0 = _host_mem()
    gpu_bytes = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None
    want_gb = args.feature_table_gb
    if "MemAvailable" in mem0 and want_gb > mem0["MemAvailable"] - 12:
        # Keep 12 GB of host memory for the graph, the process and the OS; still more than the GPU holds?
        want_gb = mem0["MemAvailable"] - 12
        if gpu_bytes and want_gb * 1e9 <= gpu_bytes:
            raise MemoryError(
                f"only {mem0['MemAvailable']:.1f} GB of host memory is available: a feature table larger than "
                f"the GPU's {gpu_bytes / 1e9:.1f} GB (plus 12 GB to spare) does not fit"
            )
    f = max(8, int(want_gb * 1e9 / (nodes * 4)) // 8 * 8)
    t0 = time.perf_counter()
    data = rmat_graph(
        nodes, args.big_edges, 1, args.classes, seed=1, device=dev if dev.type == "cuda" else "cpu"
    )
    graph_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(2)
    variants = 64
    cent = torch.randn(args.classes, 1, f, generator=g)
    protos = (cent + 2.0 * torch.randn(args.classes, variants, f, generator=g)).reshape(-1, f)
    x = torch.empty(nodes, f, dtype=torch.float32)  # host memory, not touched yet
    chunk = max(1, (1 << 30) // (4 * f))
    for lo in range(0, nodes, chunk):
        hi = min(nodes, lo + chunk)
        pid = data.y[lo:hi] * variants + torch.randint(0, variants, (hi - lo,), generator=g)
        torch.index_select(protos, 0, pid, out=x[lo:hi])
    data.x = x
    fill_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(nodes, generator=g)[: args.batch_size * (args.warmup + args.big_batches)]
    t0 = time.perf_counter()
    loader = NeighborLoader(data, [15, 10, 5], batch_size=args.batch_size, input_nodes=idx, device=dev,
                            feature_placement="host", prefetch=2)  # fmt: skip
    setup_s = time.perf_counter() - t0
    m, opt = _model(f, args.classes, dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    r = _train_loop(loader, m, opt, dev, args.warmup, args.big_batches)
    loader.close()
    table_bytes = x.numel() * 4
    r.update(feature_table_gb=table_bytes / 1e9, gpu_memory_gb=gpu_bytes / 1e9 if gpu_bytes else None,
             table_exceeds_gpu_memory=bool(gpu_bytes and table_bytes > gpu_bytes), nodes=nodes,
             edges=args.big_edges, features=f, dtype="float32", graph_generation_s=graph_s, fill_s=fill_s,
             loader_setup_s_incl_pinning=setup_s, host_memory_before_gb=mem0, host_memory_after_gb=_host_mem(),
             peak_gpu_gb=torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None)  # fmt: skip
    return r


def _write(res: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{res['config']['name']}.json").write_text(json.dumps(res, indent=1, default=str))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k, r in res["runs"].items() if "epoch_s" in r]
    vals = [res["runs"][k]["epoch_s"] for k in names]
    fig, ax = plt.subplots(figsize=(7, 1.5 + 0.35 * len(names)))
    ax.barh(names, vals, color=["#999" if k.startswith("pyg") else "#2a7" for k in names])
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.1f} s", va="center")
    c = res["config"]
    ax.set_xlabel("epoch time, s (extrapolated from timed batches)")
    ax.set_title(f"3-layer SAGE, fanouts [15,10,5], batch {c['batch_size']}: {c['nodes']:,} nodes, "
                 f"{c['edges']:,} edges\n{res['env']['device']}", fontsize=9)  # fmt: skip
    save_png(fig, out, res["config"]["name"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--name", default="bench_sage", help="JSON/PNG file name (without extension)")
    p.add_argument("--nodes", type=int, default=2_400_000)
    p.add_argument("--edges", type=int, default=62_000_000)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--classes", type=int, default=47)
    p.add_argument("--train-nodes", type=int, default=196_615)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--batches", type=int, default=100, help="timed batches for the dsx loaders")
    p.add_argument("--pyg-batches", type=int, default=40, help="timed batches for each PyG run")
    p.add_argument("--pyg-workers", type=lambda s: [int(v) for v in s.split(",")], default=[4, 8, 12])
    p.add_argument(
        "--models",
        type=lambda s: s.split(","),
        default=["trim", "full"],
        help="model variants: trim (PyG trim_to_layer; the headline), full (every layer on every node)",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--feature-table-gb", type=float, default=0.0)
    p.add_argument("--big-nodes", type=int, default=20_000_000)
    p.add_argument("--big-edges", type=int, default=100_000_000)
    p.add_argument("--big-batches", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny sizes on the CPU (smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.nodes, args.edges, args.features, args.classes = 3000, 30000, 16, 4
        args.train_nodes, args.batch_size, args.batches, args.pyg_batches, args.warmup = 600, 128, 3, 2, 1
        args.pyg_workers = [0]
        if args.feature_table_gb:
            args.big_nodes, args.big_edges, args.big_batches = 2000, 20000, 2
    res = run(args)
    _write(res, Path(args.out))
    print(json.dumps({k: v for k, v in res.items() if k != "env"}, indent=1, default=str))
    return res


if __name__ == "__main__":
    main()
