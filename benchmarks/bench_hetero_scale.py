"""Mini-batch RGCN / RGAT / HGT as users launch it: ``examples/rgnn/train_sampled.py`` under ``deepspeed``, on
1 and 2 GPUs, or on a graph whose paper features exceed GPU memory.

Every run is a fresh ``deepspeed --num_gpus N`` job of the example (ogbn-mag-shaped graph, features in host
memory as one pinned copy per node that the node's ranks share, fused layers); its ``--log-json`` summary gives
the epoch time (the fastest of ``--epochs``: the first compiles kernels), the validation accuracy and the
training's peak GPU memory. ``--gpus 1,2 --repeats 3`` runs the GPU counts interleaved within each repeat, so
that drifts of the machine touch all of them, and reports each count's median epoch with its spread and the
epoch-rate ratio of every count over one GPU. Arguments after ``--`` go to the example::

    python benchmarks/bench_hetero_scale.py --gpus 1,2 --repeats 3 -- --model rgcn --scale 1 --epochs 2
    # another model beside it, in a command of its own: it replaces only that model's part of the section
    python benchmarks/bench_hetero_scale.py --gpus 1,2 --repeats 3 --merge -- --model rgat --scale 1 \\
        --epochs 2
    # paper features beyond GPU memory (one H100: 59.6M papers x 768 bf16 = 91.6 GB), the graph built on the GPU:
    python benchmarks/bench_hetero_scale.py --section large --gpus 1 --repeats 1 -- --model rgcn \\
        --scale 81 --features 768 --feature-dtype bf16 --graph-layout csr --split 0.01,0.001,0.001 --epochs 2

``<out>/bench_hetero_scale.json`` holds a section per setting (``--section``: ``scale``, the default, and
``large``), and each section a part per model (the example's ``--model``) under ``models``, each with the config
and the environment it ran with: models may run in separate commands, even on separate machines, so a ratio
only ever compares the GPU counts of one model. ``--merge`` keeps the section's other models and replaces this
model's; without it the section holds this run's model alone. Other sections are always kept;
``bench_hetero_scale.png`` draws every section, a panel each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    add_common_args,
    environment,
    read_sections,
    save_sections_png,
    section_name,
    write_section,
)

from dsx.runtime.process import deepspeed_launcher, free_port

ROOT = Path(__file__).resolve().parents[1]
NAME = "bench_hetero_scale"  # the result file, <out>/NAME.json and .png
EXAMPLE = ROOT / "examples" / "rgnn" / "train_sampled.py"


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_common_args(p)
    p.add_argument("--section", default="scale", type=section_name,
                   help=f"the section of <out>/{NAME}.json this run writes (the others are kept)")  # fmt: skip
    p.add_argument("--gpus", default="1,2", help="comma-separated rank counts per job")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every rank count")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a job may take")
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the section's other models, replace this one's",
    )
    return p.parse_args(argv), extra


def example_model(extra: list[str]) -> str:
    """The example's ``--model`` among the arguments after ``--`` (the key of the run's section): parsed as
    the example parses it, the last one given, else the example's default."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", default="rgcn")  # examples/rgnn/train_sampled.py's default
    return p.parse_known_args(extra)[0].model


def _earlier(out: str, section: str, merge: bool) -> dict[str, dict[str, Any]]:
    """With ``merge``, the models of ``section`` in ``<out>/NAME.json`` (none when there is none); read before
    any job runs, merging or not, so that a file whose sections cannot be kept stops the run before its minutes
    on the GPUs."""
    res = read_sections(out, NAME).get(section)
    if res is None or not merge:
        return {}
    models = res.get("models")
    if not isinstance(models, dict) or not all(isinstance(s, dict) and "runs" in s for s in models.values()):
        raise SystemExit(
            f"--merge: cannot merge into section {section!r} of {Path(out) / NAME}.json: it holds no part with "
            "'runs' per model. Run without --merge to replace the section"
        )
    return models


def _launch(n: int, extra: list[str], timeout: float, cuda: bool) -> dict[str, Any]:
    """One job of the example on ``n`` ranks: its summary, with the job's wall time and its log's tail."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    if not cuda:  # CPU ranks (gloo): the smoke test of this script
        env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="bench_hetero_scale_") as tmp:
        log_json = Path(tmp) / "summary.json"
        cmd = [*deepspeed_launcher(), "--num_gpus" if cuda else "--num_accelerators", str(n), "--master_port",
               str(free_port()), str(EXAMPLE), *extra, "--no-progress", "--log-json", str(log_json)]  # fmt: skip
        t0 = time.perf_counter()
        # a process group of its own, stopped whole on a timeout or an interruption: the launcher's ranks would
        # otherwise hold the GPUs (and their memory) through the repeats after
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", start_new_session=True)  # fmt: skip
        try:
            log, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            try:
                log, _ = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:  # a process of the job still holds its output
                return {"error": f"timed out after {timeout:.0f} s, and processes of the job outlived it",
                        "pgid": proc.pid}  # fmt: skip
            return {"error": f"timed out after {timeout:.0f} s", "log_tail": log[-3000:], "pgid": proc.pid}
        except BaseException:  # Ctrl-C, or the SIGTERM main() turns into SystemExit
            _kill_group(proc)
            raise
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not log_json.exists():
            return {"error": f"exit status {proc.returncode}", "log_tail": log[-3000:]}
        summary = json.loads(log_json.read_text())
    summary.pop("losses", None)  # the history keeps the per-epoch figures
    return {**summary, "job_s": wall}


def _kill_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM every process of the job's group (the launcher leads it); SIGKILL those left after ``grace`` s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    end = time.monotonic() + grace
    while time.monotonic() < end:
        proc.poll()  # reap the launcher: a zombie would keep the group alive
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def run(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """The jobs of every GPU count over the repeats: this model's section of the result."""
    import torch

    cuda = torch.cuda.is_available()
    counts = [int(g) for g in args.gpus.split(",")]
    if cuda and max(counts) > torch.cuda.device_count():
        raise SystemExit(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} GPU(s)")
    res: dict[str, Any] = {"config": {**vars(args), "example_args": extra}, "env": environment(), "runs": {}}
    jobs: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    for rep in range(args.repeats):
        for n in counts:
            r = _launch(n, extra, args.timeout, cuda)
            jobs[n].append(r)
            msg = r.get("error") or f"epoch {r['epoch_s']:.2f} s, val acc {r['final_val_acc']:.4f}"
            print(f"repeat {rep}: {n} rank(s): {msg}", flush=True)
            if "error" in r:
                print(r["log_tail"], flush=True)
    for n, rs in jobs.items():
        ok = [r for r in rs if "error" not in r]
        epochs = [r["epoch_s"] for r in ok]
        peaks = [r["peak_gpu_gb"] for r in ok if r.get("peak_gpu_gb") is not None]
        res["runs"][str(n)] = {
            "jobs": rs, "failed": len(rs) - len(ok),
            "epoch_s": statistics.median(epochs) if epochs else None,
            "epoch_s_min": min(epochs, default=None), "epoch_s_max": max(epochs, default=None),
            "val_acc": [r["final_val_acc"] for r in ok], "peak_gpu_gb": max(peaks, default=None),
        }  # fmt: skip
    one = res["runs"].get("1", {}).get("epoch_s")
    res["epoch_rate_over_1_rank"] = {
        n: one / r["epoch_s"] for n, r in res["runs"].items() if one and r["epoch_s"] and n != "1"
    }
    first = next((r for rs in jobs.values() for r in rs if "error" not in r), None)
    if first is not None:  # the graph and memory facts every job shares
        res["graph"] = {k: first.get(k) for k in ("nodes", "edges", "feature_gb", "graph_layout",
                                                  "generated_graph_gpu_gb", "gpu_total_gb", "fanouts", "batch_size",
                                                  "feature_placement", "model")}  # fmt: skip
        feat = sum((first.get("feature_gb") or {}).values())
        total = first.get("gpu_total_gb")
        res["features_over_gpu_memory"] = feat / total if total else None
    return res


def _graph_size(g: dict[str, Any]) -> str:
    """``1.9M nodes, 42.2M edges`` of a section's graph; empty when no job of it ran."""
    nodes, edges = sum((g.get("nodes") or {}).values()), sum((g.get("edges") or {}).values())
    if not nodes:
        return ""
    return f"{nodes / 1e6:.1f}M nodes, " + (
        f"{edges / 1e9:.2f}B edges" if edges >= 1e9 else f"{edges / 1e6:.1f}M edges"
    )


def _peak(section: dict[str, Any]) -> float | None:
    """A section's training peak of a rank over its GPU counts; None when no job of it ran."""
    ok = [r for r in section["runs"].values() if r["epoch_s"]]
    return max((r["peak_gpu_gb"] or 0) for r in ok) if ok else None


def draw(panel: Any, section: str, res: dict[str, Any]) -> None:
    """One section's panel. Left: per model, a bar per GPU count (median epoch, min..max) with its rate over one
    GPU. Right: the memory of the model with the largest training peak, and each model's peak beside it."""
    models: dict[str, dict[str, Any]] = res["models"]
    counts = list(dict.fromkeys(n for s in models.values() for n in s["runs"]))
    sizes = {m: _graph_size(s.get("graph") or {}) for m, s in models.items()}
    devices = {m: (s.get("env") or {}).get("device", "") for m, s in models.items()}
    # a tick names the device or the graph only where the models differ in it: sections may come from other
    # machines or other scales
    show_device = len(set(devices.values())) > 1
    ran = {v for v in sizes.values() if v}
    show_size = len(ran) > 1
    # the memory plot widens by model: a peak bar per model beside its four
    axes = panel.subplots(1, 2, width_ratios=[1, 1 + 0.25 * (len(models) - 1)])
    width = 0.8 / max(len(counts), 1)
    colors = ["tab:blue", "tab:cyan", "tab:purple", "tab:olive"]
    for k, n in enumerate(counts):
        xs = [i + (k - (len(counts) - 1) / 2) * width for i in range(len(models))]
        for x, s in zip(xs, models.values()):
            r = s["runs"].get(n)
            if r is None:
                continue
            if not r["epoch_s"]:  # every job of this count failed: the slot says so
                axes[0].annotate("failed", (x, 0), ha="center", va="bottom", fontsize=8, color="tab:red")
                continue
            med = r["epoch_s"]
            lo, hi = med - r["epoch_s_min"], r["epoch_s_max"] - med
            axes[0].bar(x, med, width, yerr=[[lo], [hi]], capsize=4, color=colors[k % len(colors)],
                        label=f"{n} GPU" + ("s" if n != "1" else ""))  # fmt: skip
            rate = s["epoch_rate_over_1_rank"].get(n)
            axes[0].annotate(f"{med:.2f} s" + (f"\n{rate:.2f}x the rate" if rate else ""), (x, med + hi),
                             ha="center", va="bottom", xytext=(0, 3), textcoords="offset points",
                             fontsize=8)  # fmt: skip
    handles = dict(zip(*reversed(axes[0].get_legend_handles_labels())))  # one entry a GPU count
    if handles:
        axes[0].legend(handles.values(), handles.keys(), loc="upper right", fontsize=8)
    axes[0].set_xticks(range(len(models)))
    axes[0].set_xlim(-0.5, len(models) - 0.5)  # a failed slot has no bar to widen the axis to it
    axes[0].set_xticklabels(
        [
            m + (f"\n{devices[m]}" if show_device else "") + (f"\n{sizes[m]}" if show_size else "")
            for m in models
        ]
    )
    axes[0].margins(y=0.18)
    repeats = sorted({(s.get("config") or {}).get("repeats") for s in models.values()} - {None})
    axes[0].set_ylabel(f"epoch time, s (median of {'/'.join(map(str, repeats))}; bars: min..max)")
    one_device = "" if show_device else next(iter(devices.values()), "")
    axes[0].set_title(f"{section}: " + ", ".join(models) + (f" on {ran.pop()}" if len(ran) == 1 else "")
                      + (f", {one_device}" if one_device else ""))  # fmt: skip
    peaks = {m: _peak(s) for m, s in models.items()}
    big = max(models, key=lambda m: -1 if peaks[m] is None else peaks[m])
    g = models[big].get("graph") or {}
    bars: dict[str, float | None] = {
        "paper features\n(host memory)": sum((g.get("feature_gb") or {}).values()),
        "GPU memory": g.get("gpu_total_gb") or 0,
    }
    for m, v in peaks.items():
        bars["training peak\n(GPU, a rank)" if len(models) == 1 else f"{m} training\npeak (GPU, a rank)"] = v
    bars["graph built on\nthe GPU (CSRs)"] = g.get("generated_graph_gpu_gb") or 0
    xs = range(len(bars))
    axes[1].bar(xs, [v or 0 for v in bars.values()],
                color=["tab:orange", "tab:gray", *["tab:blue"] * len(peaks), "tab:green"])  # fmt: skip
    for i, v in enumerate(bars.values()):
        axes[1].annotate(
            "failed" if v is None else f"{v:.1f} GB", (i, v or 0), ha="center", va="bottom", fontsize=8
        )
    axes[1].set_xticks(xs)
    axes[1].set_xticklabels(list(bars), fontsize=8 if len(bars) > 4 else None)
    axes[1].set_ylabel("GB")
    # the graph and the GPU are one section's (the largest peak's), named where another section's differ
    keys = ("feature_gb", "gpu_total_gb", "generated_graph_gpu_gb")
    differ = any([s["graph"].get(k) for k in keys] != [g.get(k) for k in keys] for s in models.values()
                 if s.get("graph"))  # fmt: skip
    axes[1].set_title("memory" + (f" (graph and GPU of {big}'s run)" if differ else ""))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, extra = parse_args(argv)
    model = example_model(extra)
    models = _earlier(args.out, args.section, args.merge)
    if models:
        print(f"--merge: keeping {', '.join(m for m in models if m != model) or 'no other model'}; "
              f"{model} {'replaced' if model in models else 'added'}", flush=True)  # fmt: skip
    # a SIGTERM (a suite's timeout) unwinds as SystemExit, so that the running job is stopped with its ranks
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        section = run(args, extra)
    finally:
        signal.signal(signal.SIGTERM, before)
    models[model] = section  # a model already there keeps its place, so the plot's order stays
    res = {"config": section["config"], "env": section["env"], "models": models}
    _, sections = write_section(res, args.out, NAME, args.section)
    save_sections_png(sections, draw, args.out, NAME, size=(14.0, 4.8))
    return res


if __name__ == "__main__":
    main()
