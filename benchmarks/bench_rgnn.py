"""One relational layer, forward + backward: dsx.rgnn RGCN / RGAT / HGT against PyG in the same process.

Baselines: torch_geometric.nn RGCNConv and FastRGCNConv (for RGCN), RGATConv, HGTConv, on synthetic graphs
shaped like the issue-5 table (``dsx.data.hetero.PRESETS``), input = output dim 64 and 128. Each case:
median of ``--repeats`` timed runs (CUDA events) after one warm-up, peak memory above the inputs; an
out-of-memory failure is recorded, not fatal. Also: the ablation (dsx with compact materialization /
linear reordering / fusion off) and the graph-preparation cost (``dsx.rgnn.prepare`` uncached).

    python benchmarks/bench_rgnn.py                       # GPU: all presets, dims 64 128 (~5 min on an H100)
    python benchmarks/bench_rgnn.py --datasets aifb mutag --dims 64
    python benchmarks/bench_rgnn.py --quick               # CPU smoke run (tiny graphs)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median_seconds

import dsx.rgnn as rg
from dsx.data.hetero import PRESETS, synthetic_hetero

MODELS = {"rgcn": ["RGCNConv", "FastRGCNConv"], "rgat": ["RGATConv"], "hgt": ["HGTConv"]}
ABLATIONS = {"no_compact": {"compact_materialization": False}, "no_reorder": {"linear_reorder": False},
             "no_fusion": {"fusion": False}}  # fmt: skip


def _oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def measure(fn, device: torch.device, repeats: int) -> dict:
    """Median seconds and peak bytes (above what was allocated before) of ``fn`` (forward + backward)."""
    cuda = device.type == "cuda"
    try:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        fn()
        sec = median_seconds(fn, repeats, cuda)
        peak = (torch.cuda.max_memory_allocated() - base) if cuda else None
        return {"ms": 1e3 * sec, "peak_mb": None if peak is None else peak / 2**20}
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        if not _oom(exc):
            raise
        return {"oom": True, "error": str(exc).splitlines()[0][:200]}
    finally:
        if cuda:
            torch.cuda.empty_cache()


def build_layer(kind: str, name: str, dim: int, g, heads: int, **opts):
    import torch_geometric.nn as pygnn

    r, meta = g.num_relations, g.metadata()
    if kind == "pyg":
        cls = getattr(pygnn, name)
        if name == "HGTConv":
            return cls(dim, dim, meta, heads=heads)
        return cls(dim, dim, r, heads=heads) if name == "RGATConv" else cls(dim, dim, r)
    if name == "rgcn":
        return rg.RGCNConv(dim, dim, r, **opts)
    if name == "rgat":
        return rg.RGATConv(dim, dim, r, heads=heads, **opts)
    return rg.HGTConv(dim, dim, meta, heads=heads, **opts)


def step_fn(layer, model: str, x, g, hetero):
    def run():
        layer.zero_grad(set_to_none=True)
        if model == "hgt":
            x_dict, ei_dict = hetero
            out = layer(x_dict, ei_dict)
            loss = sum(v.float().square().mean() for v in out.values())
        else:
            loss = layer(x, g.edge_index, g.edge_type).float().square().mean()
        loss.backward()

    return run


def bench(args) -> dict:
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    results = {"cases": [], "prep": [], "ablation": []}
    for ds in args.datasets:
        g = synthetic_hetero(ds, scale=args.scale, num_features=0, labels=False, seed=0, device=device)
        p = {
            "dataset": ds,
            "nodes": g.num_nodes,
            "edges": int(g.edge_index.shape[1]),
            "relations": g.num_relations,
        }
        prep = measure(lambda g=g: rg.prepare(g.edge_index, g.edge_type, g.num_nodes, g.num_relations,
                                              cache=False), device, args.repeats)  # fmt: skip
        results["prep"].append({**p, **prep})
        print(f"[{ds}] {p} prepare {prep}", flush=True)
        for dim in args.dims:
            x = torch.randn(g.num_nodes, dim, device=device, requires_grad=True)
            hetero = g.to_hetero(x)
            for model, baselines in MODELS.items():
                variants = [("dsx", model, {})] + [("pyg", b, {}) for b in baselines]
                if dim == args.dims[0]:
                    variants += [("dsx", model, {"ablation": a, **o}) for a, o in ABLATIONS.items()
                                 if not (model != "rgat" and a == "no_reorder")]  # fmt: skip
                for kind, name, opts in variants:
                    opts = dict(opts)
                    ablation = opts.pop("ablation", None)
                    try:
                        layer = build_layer(kind, name, dim, g, args.heads, precision=args.precision, **opts) \
                            if kind == "dsx" else build_layer(kind, name, dim, g, args.heads)  # fmt: skip
                        layer = layer.to(device)
                        res = measure(step_fn(layer, model, x, g, hetero), device, args.repeats)
                    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                        if not _oom(exc):
                            raise
                        res = {"oom": True, "error": str(exc).splitlines()[0][:200]}
                    finally:
                        layer = None
                    row = {**p, "dim": dim, "model": model, "impl": f"{kind}:{name}", **res}
                    (results["ablation"] if ablation else results["cases"]).append(
                        {**row, "ablation": ablation} if ablation else row
                    )
                    print(f"  dim={dim} {model:4s} {kind}:{name:13s} {ablation or '':10s} {res}", flush=True)
            del x, hetero
        rg.clear_cache()  # the prepare cache holds the graph's index tensors; free them before the next preset
        del g
    results["summary"] = summarise(results["cases"])
    return results


def summarise(cases: list[dict]) -> dict:
    """Per model: geometric-mean speed-up over the best PyG layer where PyG runs; OOM counts; memory ratio."""
    out = {}
    for model in MODELS:
        speed, mem, oom_pyg, oom_dsx = [], [], 0, 0
        keys = {(c["dataset"], c["dim"]) for c in cases if c["model"] == model}
        for key in sorted(keys):
            rows = [c for c in cases if c["model"] == model and (c["dataset"], c["dim"]) == key]
            ours = next(c for c in rows if c["impl"].startswith("dsx"))
            pyg = [c for c in rows if c["impl"].startswith("pyg") and not c.get("oom")]
            oom_dsx += bool(ours.get("oom"))
            oom_pyg += sum(bool(c.get("oom")) for c in rows if c["impl"].startswith("pyg"))
            if pyg and not ours.get("oom"):
                best = min(pyg, key=lambda c: c["ms"])
                speed.append(best["ms"] / ours["ms"])
                if best.get("peak_mb") and ours.get("peak_mb") is not None:
                    mem.append(ours["peak_mb"] / best["peak_mb"])
        gm = math.exp(sum(map(math.log, speed)) / len(speed)) if speed else None
        out[model] = {"geomean_speedup_vs_best_pyg": gm, "cases_compared": len(speed), "dsx_oom": oom_dsx,
                      "pyg_oom": oom_pyg, "max_peak_mem_ratio": max(mem) if mem else None}  # fmt: skip
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["cases"]
    fig, axes = plt.subplots(1, len(MODELS), figsize=(6 * len(MODELS), 4.5), squeeze=False)
    for ax, model in zip(axes[0], MODELS):
        rows = [c for c in cases if c["model"] == model]
        labels = sorted({(c["dataset"], c["dim"]) for c in rows}, key=lambda k: (k[1], k[0]))
        impls = sorted({c["impl"] for c in rows})
        width = 0.8 / max(len(impls), 1)
        for i, impl in enumerate(impls):
            ys = []
            for key in labels:
                hit = [c for c in rows if c["impl"] == impl and (c["dataset"], c["dim"]) == key]
                ys.append(hit[0]["ms"] if hit and not hit[0].get("oom") else 0.0)
            ax.bar([j + i * width for j in range(len(labels))], ys, width, label=impl)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
        ax.set_xticklabels([f"{d}\n{k}" for d, k in labels], rotation=90, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("fwd+bwd ms (0 = OOM)")
        ax.set_title(model)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    ap.add_argument("--dims", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every preset's nodes and edges")
    ap.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "bf16"])
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: 1 tiny graph, dim 8, 1 repeat")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if args.quick:
        args.datasets, args.dims, args.scale, args.repeats = ["biokg"], [8], 0.002, 1
    t0 = time.time()
    results = bench(args)
    import deepspeed
    import torch_geometric

    device = (
        torch.cuda.get_device_name() if torch.cuda.is_available() and not args.quick else platform.processor()
    )
    meta = {"name": "bench_rgnn", "device": device or "cpu", "torch": torch.__version__,
            "torch_geometric": torch_geometric.__version__, "deepspeed": deepspeed.__version__,
            "python": platform.python_version(), "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
            "config": vars(args), "wall_s": time.time() - t0}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_rgnn.json").write_text(json.dumps({**meta, **results}, indent=1))
    plot(results, out / "bench_rgnn.png")
    print(json.dumps(results["summary"], indent=1))
    print(f"wrote {out / 'bench_rgnn.json'} and {out / 'bench_rgnn.png'}")


if __name__ == "__main__":
    main()
