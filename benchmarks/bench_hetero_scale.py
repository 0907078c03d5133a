"""Mini-batch RGCN / RGAT / HGT as users launch it: ``examples/rgnn/train_sampled.py`` under ``deepspeed``, on
1 and 2 GPUs, or on a graph whose paper features exceed GPU memory.

Every run is a fresh ``deepspeed --num_gpus N`` job of the example (ogbn-mag-shaped graph, features in host
memory as one pinned copy per node that the node's ranks share, fused layers); its ``--log-json`` summary gives
the epoch time (the fastest of ``--epochs``: the first compiles kernels), the validation accuracy and the
training's peak GPU memory. ``--gpus 1,2 --repeats 3`` runs the GPU counts interleaved within each repeat, so
that drifts of the machine touch all of them, and reports each count's median epoch with its spread and the
epoch-rate ratio of every count over one GPU. Arguments after ``--`` go to the example::

    python benchmarks/bench_hetero_scale.py --gpus 1,2 --repeats 3 -- --model rgcn --scale 1 --epochs 2
    # paper features beyond GPU memory (one H100: 59.6M papers x 768 bf16 = 91.6 GB), the graph built on the GPU:
    python benchmarks/bench_hetero_scale.py --name bench_hetero_large --gpus 1 --repeats 1 -- --model rgcn \\
        --scale 81 --features 768 --feature-dtype bf16 --graph-layout csr --split 0.01,0.001,0.001 --epochs 2
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
from _common import add_common_args, environment, save_png, write_json

from dsx.runtime.process import deepspeed_launcher, free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "rgnn" / "train_sampled.py"


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_common_args(p)
    p.add_argument("--name", default="bench_hetero_scale", help="result name (JSON and PNG)")
    p.add_argument("--gpus", default="1,2", help="comma-separated rank counts per job")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every rank count")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a job may take")
    return p.parse_args(argv), extra


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


def plot(res: dict[str, Any], out: str, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {n: r for n, r in res["runs"].items() if r["epoch_s"]}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ns = list(runs)
    med = [runs[n]["epoch_s"] for n in ns]
    lo = [m - runs[n]["epoch_s_min"] for n, m in zip(ns, med)]
    hi = [runs[n]["epoch_s_max"] - m for n, m in zip(ns, med)]
    axes[0].bar([f"{n} GPU(s)" for n in ns], med, yerr=[lo, hi], capsize=4, color="tab:blue")
    for i, n in enumerate(ns):
        rate = res["epoch_rate_over_1_rank"].get(n)
        axes[0].annotate(f"{med[i]:.2f} s" + (f", {rate:.2f}x the rate" if rate else ""), (i, med[i] + hi[i]),
                         ha="center", va="bottom", xytext=(0, 3), textcoords="offset points")  # fmt: skip
    axes[0].margins(y=0.12)
    g = res.get("graph", {})
    edges = sum((g.get("edges") or {}).values())
    axes[0].set_ylabel(f"epoch time, s (median of {res['config']['repeats']}; bars: min..max)")
    axes[0].set_title(f"{g.get('model', '')} on {sum((g.get('nodes') or {}).values()) / 1e6:.1f}M nodes, "
                      + (f"{edges / 1e9:.2f}B edges" if edges >= 1e9 else f"{edges / 1e6:.1f}M edges"))  # fmt: skip
    feat = sum((g.get("feature_gb") or {}).values())
    bars = {"paper features\n(host memory)": feat, "GPU memory": g.get("gpu_total_gb") or 0,
            "training peak\n(GPU, a rank)": max((r["peak_gpu_gb"] or 0) for r in runs.values()) if runs else 0,
            "graph built on\nthe GPU (CSRs)": g.get("generated_graph_gpu_gb") or 0}  # fmt: skip
    axes[1].bar(list(bars), list(bars.values()), color=["tab:orange", "tab:gray", "tab:blue", "tab:green"])
    for i, v in enumerate(bars.values()):
        axes[1].annotate(f"{v:.1f} GB", (i, v), ha="center", va="bottom")
    axes[1].set_ylabel("GB")
    axes[1].set_title("memory")
    save_png(fig, out, name)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, extra = parse_args(argv)
    # a SIGTERM (a suite's timeout) unwinds as SystemExit, so that the running job is stopped with its ranks
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        res = run(args, extra)
    finally:
        signal.signal(signal.SIGTERM, before)
    write_json(res, args.out, args.name)
    plot(res, args.out, args.name)
    return res


if __name__ == "__main__":
    main()
