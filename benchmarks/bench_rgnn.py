"""One relational layer, forward + backward: dsx.rgnn RGCN / RGAT / HGT against PyG in the same process.

Baselines: torch_geometric.nn RGCNConv and FastRGCNConv (for RGCN), RGATConv, HGTConv, on synthetic graphs
shaped like eight public datasets (``dsx.data.hetero.PRESETS``), input = output dim 64 and 128. Each case:
median of ``--repeats`` timed runs (CUDA events) after one warm-up (a warm-up slower than ``--slow-s`` is the
only run), host time, peak memory of a steady-state step plus what dsx keeps between steps (the prepared
graph); an out-of-memory failure is recorded, not fatal; ``--pyg-budget-s`` bounds the time spent before the
remaining PyG baselines are skipped (recorded as skipped, never counted as a win). Also: the ablation (dsx with compact materialization /
linear reordering / fusion off) and the graph-preparation cost (``dsx.rgnn.prepare`` uncached).

    python benchmarks/bench_rgnn.py                       # GPU: all 8 presets, dims 64 128 (~4 min on an H100)
    python benchmarks/bench_rgnn.py --datasets aifb mutag --dims 64
    python benchmarks/bench_rgnn.py --quick               # CPU smoke run (tiny graphs)
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median_seconds, save_png

import dsx.rgnn as rg
from dsx.data.hetero import PRESETS, synthetic_hetero

MODELS = {"rgcn": ["RGCNConv", "FastRGCNConv"], "rgat": ["RGATConv"], "hgt": ["HGTConv"]}
# The graph maps of all three layers: what the preparation cost covers.
EVERY_FIELD = ("inv_deg_rel", "rel", "dst_row_idx", "dst_rel_ptr", "edge_dst_row")
ABLATIONS = {"no_compact": {"compact_materialization": False}, "no_reorder": {"linear_reorder": False},
             "no_fusion": {"fusion": False}}  # fmt: skip


def _oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def measure(fn, device: torch.device, repeats: int, slow_s: float = 2.0, resident=None) -> dict:
    """Median fwd+bwd milliseconds, host milliseconds and peak memory of ``fn`` (one layer step).

    * ``ms``: median of ``repeats`` CUDA-event timed runs after one warm-up (compilation, graph preparation,
      allocator). A warm-up slower than ``slow_s`` is the only run (``runs: 1``): big PyG baselines take
      seconds each, and one run is enough to see that.
    * ``host_ms``: median wall time until ``fn()`` returns without waiting for the GPU: the fixed cost of
      launching the step (Python, dispatch, launches); when ``host_ms`` ~ ``ms`` the step is launch-bound.
    * ``peak_mb``: peak allocated during one steady-state step above what was live before it, plus
      ``resident()`` bytes kept between steps for this layer (dsx: the prepared graph's index maps; PyG
      layers keep none). ``base`` is read while the previous step's gradients (``x.grad``, parameter
      grads: the same shapes for dsx and PyG) are still held, so both peaks leave them out; adding them to
      both sides moves the dsx/PyG ratio towards 1 (see docs/rgnn-kernels.md).
    """
    cuda = device.type == "cuda"
    try:
        _sync(cuda)
        if cuda:
            torch.cuda.empty_cache()
        first = _wall(fn, cuda)
        if first > slow_s:  # the first call may include kernel compilation: time a second one
            first = _wall(fn, cuda)
        res = {}
        if first > slow_s:
            res.update(ms=1e3 * first, runs=1)
        else:
            res.update(ms=1e3 * median_seconds(fn, repeats, cuda), runs=repeats)
            host = []
            for _ in range(repeats):
                _sync(cuda)
                t0 = time.perf_counter()
                fn()
                host.append(time.perf_counter() - t0)
            res["host_ms"] = 1e3 * sorted(host)[len(host) // 2]
        if cuda:
            _sync(cuda)
            gc.collect()  # garbage of earlier cases freed during the step would hide part of its peak
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            _sync(cuda)
            step = (torch.cuda.max_memory_allocated() - base) / 2**20
            kept = (resident() if resident else 0) / 2**20
            res.update(peak_mb=step + kept, step_peak_mb=step, resident_mb=kept)
        return res
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        if not _oom(exc):
            raise
        return _oom_record(exc, cuda)
    finally:
        if cuda:
            torch.cuda.empty_cache()


def _wall(fn, cuda: bool) -> float:
    _sync(cuda)
    t0 = time.perf_counter()
    fn()
    _sync(cuda)
    return time.perf_counter() - t0


def _oom_record(exc: BaseException, cuda: bool) -> dict:
    """An out-of-memory result with what was allocated / reserved when it failed (tells a real need from
    memory held by something else)."""
    rec = {"oom": True, "error": " ".join(str(exc).split())[:400]}
    if cuda:
        rec.update(allocated_mb_at_oom=torch.cuda.memory_allocated() / 2**20,
                   reserved_mb_at_oom=torch.cuda.memory_reserved() / 2**20,
                   peak_mb_before_oom=torch.cuda.max_memory_allocated() / 2**20)  # fmt: skip
    return rec


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
        x.grad = None
        if model == "hgt":
            x_dict, ei_dict = hetero
            out = layer(x_dict, ei_dict)
            loss = sum(v.float().square().mean() for v in out.values())
        else:
            loss = layer(x, g.edge_index, g.edge_type).float().square().mean()
        loss.backward()

    return run


def resident_fn(layer, model: str, g):
    """Bytes the dsx layer keeps between steps: its prepared graph (the prepare cache, or for HGT the typed
    graph cache's latest entry, the one the layer just ran on)."""

    def nbytes() -> int:
        if model == "hgt":
            from dsx.rgnn.hetero import _GRAPHS

            return next(reversed(_GRAPHS.values()))[1].nbytes()
        return rg.prepare(g.edge_index, g.edge_type, g.num_nodes, g.num_relations).nbytes()

    return nbytes


def bench(args, path: Path | None = None, meta: dict | None = None) -> dict:
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    results = {"cases": [], "prep": [], "ablation": []}
    t_start = time.time()
    for ds in args.datasets:
        g = synthetic_hetero(ds, scale=args.scale, num_features=0, labels=False, seed=0, device=device)
        p = {
            "dataset": ds,
            "nodes": g.num_nodes,
            "edges": int(g.edge_index.shape[1]),
            "relations": g.num_relations,
        }
        rg.clear_cache()
        prep = measure(lambda g=g: rg.prepare(g.edge_index, g.edge_type, g.num_nodes, g.num_relations,
                                              cache=False, needs=EVERY_FIELD), device, args.repeats)  # fmt: skip
        results["prep"].append({**p, **prep})
        print(f"[{ds}] {p} prepare {prep}", flush=True)
        for dim in args.dims:
            x = torch.randn(g.num_nodes, dim, device=device, requires_grad=True)
            hetero = g.to_hetero(x)
            # Main comparisons first, the ablation (large per-edge tensors) after them.
            variants = [
                (m, k, n, {})
                for m, b in MODELS.items()
                for k, n in [("dsx", m)] + [("pyg", name) for name in b]
            ]
            if dim == args.dims[0]:
                variants += [(m, "dsx", m, {"ablation": a, **o}) for m in MODELS for a, o in ABLATIONS.items()
                             if not (m != "rgat" and a == "no_reorder")]  # fmt: skip
            for model, kind, name, opts in variants:
                opts = dict(opts)
                ablation = opts.pop("ablation", None)
                layer = None
                if kind == "pyg" and time.time() - t_start > args.pyg_budget_s:
                    res = {"skipped": f"PyG time budget of {args.pyg_budget_s:.0f} s spent before this case"}
                else:
                    try:
                        rg.clear_cache()  # each dsx variant holds (and is charged for) only its own maps
                        layer = build_layer(kind, name, dim, g, args.heads, precision=args.precision, **opts) \
                            if kind == "dsx" else build_layer(kind, name, dim, g, args.heads)  # fmt: skip
                        layer = layer.to(device)
                        resident = resident_fn(layer, model, g) if kind == "dsx" else None
                        res = measure(step_fn(layer, model, x, g, hetero), device, args.repeats, args.slow_s,
                                      resident)  # fmt: skip
                    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                        if not _oom(exc):
                            raise
                        res = _oom_record(exc, device.type == "cuda")
                    finally:
                        layer = None
                        x.grad = None
                if device.type == "cuda":  # what other cases left allocated (x, the graph, caches)
                    res["live_mb_after"] = torch.cuda.memory_allocated() / 2**20
                row = {**p, "dim": dim, "model": model, "impl": f"{kind}:{name}", **res}
                (results["ablation"] if ablation else results["cases"]).append(
                    {**row, "ablation": ablation} if ablation else row
                )
                print(
                    f"  dim={dim} {model:4s} {kind}:{name:13s} {ablation or '':10s} {_short(res)}",
                    flush=True,
                )
            del x, hetero
        rg.clear_cache()  # the prepare cache holds the graph's index tensors; free them before the next preset
        del g
        results["summary"] = summarise(results["cases"])
        if path is not None:  # after every preset: a run cut short by a time limit still leaves its figures
            path.write_text(
                json.dumps({**(meta or {}), **results, "wall_s": time.time() - t_start}, indent=1)
            )
    return results


def profile_dsx(args) -> dict:
    """Where one dsx step's fixed cost goes on the smallest preset: operator and kernel-launch counts, host
    time per operator (torch.profiler), one step per model after a warm-up. Printed and returned."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    ds, dim = args.datasets[0], args.dims[0]
    g = synthetic_hetero(ds, scale=args.scale, num_features=0, labels=False, seed=0, device=device)
    x = torch.randn(g.num_nodes, dim, device=device, requires_grad=True)
    hetero, out = g.to_hetero(x), {}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for model in MODELS:
        rg.clear_cache()
        layer = build_layer("dsx", model, dim, g, args.heads, precision=args.precision).to(device)
        fn = step_fn(layer, model, x, g, hetero)
        fn()
        _sync(device.type == "cuda")
        with profile(activities=acts) as prof:
            fn()
            _sync(device.type == "cuda")
        ev = prof.key_averages()
        ops = [e for e in ev if e.key.startswith("aten::")]
        kernels = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA]
        out[model] = {
            "dataset": ds, "dim": dim, "aten_calls": sum(e.count for e in ops),
            "cuda_kernel_launches": sum(e.count for e in kernels),
            "top_host_us": {e.key: round(e.self_cpu_time_total, 1)
                            for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:12]},
        }  # fmt: skip
        print(f"[profile {ds} dim {dim}] {model}: {out[model]}", flush=True)
    rg.clear_cache()
    return out


def _short(res: dict) -> str:
    return " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items())


def summarise(cases: list[dict]) -> dict:
    """Per model: geometric-mean speed-up over the best PyG layer where PyG runs; OOM counts; memory ratio.

    A (dataset, dim) case enters the speed-up and memory figures when dsx and at least one PyG layer ran;
    PyG layers that ran out of memory or were skipped (time budget) are counted, not compared.
    """
    out = {}
    for model in MODELS:
        speed, mem, oom_pyg, oom_dsx, skipped, worst = [], [], 0, 0, 0, None
        keys = {(c["dataset"], c["dim"]) for c in cases if c["model"] == model}
        for key in sorted(keys):
            rows = [c for c in cases if c["model"] == model and (c["dataset"], c["dim"]) == key]
            ours = next(c for c in rows if c["impl"].startswith("dsx"))
            theirs = [c for c in rows if c["impl"].startswith("pyg")]
            pyg = [c for c in theirs if "ms" in c]
            oom_dsx += bool(ours.get("oom"))
            oom_pyg += sum(bool(c.get("oom")) for c in theirs)
            skipped += sum("skipped" in c for c in theirs)
            if pyg and "ms" in ours:
                best = min(pyg, key=lambda c: c["ms"])
                speed.append(best["ms"] / ours["ms"])
                if best.get("peak_mb") and ours.get("peak_mb") is not None:
                    ratio = ours["peak_mb"] / best["peak_mb"]
                    mem.append(ratio)
                    if worst is None or ratio > worst[0]:
                        worst = (ratio, f"{key[0]} dim {key[1]} vs {best['impl']}")
        gm = math.exp(sum(map(math.log, speed)) / len(speed)) if speed else None
        out[model] = {
            "geomean_speedup_vs_best_pyg": gm, "min_speedup": min(speed) if speed else None,
            "cases_compared": len(speed), "cases": len(keys), "dsx_oom": oom_dsx, "pyg_oom": oom_pyg,
            "pyg_skipped": skipped, "max_peak_mem_ratio": max(mem) if mem else None,
            "max_peak_mem_ratio_case": worst[1] if worst else None,
            "targets": {"geomean_speedup_ge_10": gm is not None and gm >= 10, "no_dsx_oom": oom_dsx == 0,
                        "peak_mem_ratio_le_0.5": bool(mem) and max(mem) <= 0.5},
        }  # fmt: skip
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
                ys.append(hit[0]["ms"] if hit and "ms" in hit[0] else 0.0)
            ax.bar([j + i * width for j in range(len(labels))], ys, width, label=impl)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
        ax.set_xticklabels([f"{d}\n{k}" for d, k in labels], rotation=90, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("fwd+bwd ms (0 = OOM / skipped)")
        ax.set_title(model)
        ax.legend(fontsize=7)
    save_png(fig, path.parent, path.stem)


# Smallest graphs first: when a time limit cuts the run short, the JSON written so far covers most presets.
ORDER = sorted(PRESETS, key=lambda k: PRESETS[k].num_edges)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--datasets", nargs="+", default=ORDER, choices=list(PRESETS))
    ap.add_argument("--dims", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every preset's nodes and edges")
    ap.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "bf16"])
    ap.add_argument("--slow-s", type=float, default=2.0, help="a case whose warm-up takes longer runs once")
    ap.add_argument(
        "--pyg-budget-s",
        type=float,
        default=float("inf"),
        help="after this many seconds of benchmark, remaining PyG baselines are skipped (recorded)",
    )
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: 1 tiny graph, dim 8, 1 repeat")
    ap.add_argument(
        "--profile", action="store_true", help="also profile one dsx step per model (first preset)"
    )
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if args.quick:
        args.datasets, args.dims, args.scale, args.repeats = ["biokg"], [8], 0.002, 1
    import deepspeed
    import torch_geometric

    device = (
        torch.cuda.get_device_name() if torch.cuda.is_available() and not args.quick else platform.processor()
    )
    meta = {"name": "bench_rgnn", "device": device or "cpu", "torch": torch.__version__,
            "torch_geometric": torch_geometric.__version__, "deepspeed": deepspeed.__version__,
            "python": platform.python_version(), "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
            "config": {k: (None if v == float("inf") else v) for k, v in vars(args).items()},
            "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "memory_note": "peak_mb = steady-state step peak above the live set + resident_mb (dsx: the "
                           "prepared graph's index maps); graph preparation is reported under prep"}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    results = bench(args, out / "bench_rgnn.json", meta)
    results["wall_s"] = time.time() - t0
    if args.profile:
        results["profile"] = profile_dsx(args)
        (out / "bench_rgnn.json").write_text(json.dumps({**meta, **results}, indent=1))
    plot(results, out / "bench_rgnn.png")
    print(json.dumps(results["summary"], indent=1))
    print(f"wrote {out / 'bench_rgnn.json'} and {out / 'bench_rgnn.png'}")


if __name__ == "__main__":
    main()
