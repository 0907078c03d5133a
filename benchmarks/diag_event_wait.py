"""What host threads waiting for side-stream work cost the thread that queues the GPU's work.

dsx's I/O threads wait on the host for every activation copy (``dsx.runtime.events``). This runs, on one GPU,
the situation of a forward with writes in flight: a side stream busy for ~0.25 s with ``--points`` events (``torch.cuda._sleep`` chunks), ``--waiters`` threads waiting for them in order (like the I/O pool),
and the main thread meanwhile queueing ``--launches`` small kernels and then running a fixed pure-Python loop.
Per ``event_wait`` mode (and ``none``: no waiters; ``spin_chained``: each waiter sleeps until the point before
its own was seen, as dsx's writes do, so that one thread spins at a time), interleaved over ``--trials``:

* ``launch_us``: the main thread's host time per kernel launch;
* ``python_loop_s``: the fixed loop's time (the host CPU as the main thread sees it);
* ``cpu_util``: process CPU seconds per wall second over the trial (busy cores);
* ``wake_late_ms``: per point, how much later the waiter returned than under ``spin`` (median over points).

Writes ``<out>/diag_event_wait.json`` and a PNG. Needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import HelpFormatter, add_common_args, environment, host_probe_s, save_png, write_json

from dsx.runtime.events import EventWaiter

MODES = ("none", "spin", "spin_chained", "poll")


def _cycles_per_ms() -> float:
    s = torch.cuda.Stream()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(s):
        a.record()
        torch.cuda._sleep(50_000_000)
        b.record()
    b.synchronize()
    return 50_000_000 / a.elapsed_time(b)


def trial(mode: str, args: argparse.Namespace, cyc_ms: float) -> dict[str, Any]:
    side = torch.cuda.Stream()
    waiter = EventWaiter("poll" if mode == "poll" else "spin")
    chained = mode == "spin_chained"  # each waiter first sleeps until the point before its own was seen
    points, t0 = [], time.perf_counter()
    with torch.cuda.stream(side):
        for _ in range(args.points):
            torch.cuda._sleep(int(cyc_ms * args.chunk_ms))
            points.append(torch.cuda.Event())
            points[-1].record(side)
    woke: list[float] = [0.0] * len(points)
    seen = [threading.Event() for _ in points]

    def wait_for(idx: list[int]) -> None:
        for k in idx:
            if chained and k > 0:
                seen[k - 1].wait()
            waiter.wait(points[k])
            seen[k].set()
            woke[k] = time.perf_counter() - t0

    threads = []
    if mode != "none":
        for j in range(args.waiters):
            th = threading.Thread(target=wait_for, args=(list(range(j, len(points), args.waiters)),))
            th.start()
            threads.append(th)
    x = torch.zeros(16, device="cuda")
    cpu0, w0 = time.process_time(), time.perf_counter()
    t1 = time.perf_counter()
    for _ in range(args.launches):
        x.add_(1.0)
    launch_us = (time.perf_counter() - t1) / args.launches * 1e6
    loop = host_probe_s(200_000)
    for th in threads:
        th.join()
    torch.cuda.synchronize()
    cpu = (time.process_time() - cpu0) / (time.perf_counter() - w0)
    assert float(x[0]) == args.launches  # the kernels ran
    return {"launch_us": launch_us, "python_loop_s": loop, "cpu_util": cpu, "woke_s": woke}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_common_args(p)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--waiters", type=int, default=4)
    p.add_argument("--points", type=int, default=48)
    p.add_argument("--chunk-ms", type=float, default=5.0)
    p.add_argument("--launches", type=int, default=20_000)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("diag_event_wait needs a CUDA GPU")
    modes = list(MODES)
    cyc_ms = _cycles_per_ms()
    trial("spin", args, cyc_ms)  # warm-up
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for _ in range(args.trials):
        for m in modes:
            runs[m].append(trial(m, args, cyc_ms))
    spin_woke = [statistics.median(r["woke_s"][k] for r in runs["spin"]) for k in range(args.points)]
    figures = {}
    for m in modes:
        rs = runs[m]
        fig = {
            "launch_us": statistics.median(r["launch_us"] for r in rs),
            "python_loop_s": statistics.median(r["python_loop_s"] for r in rs),
            "cpu_util": statistics.median(r["cpu_util"] for r in rs),
            "launch_us_trials": [r["launch_us"] for r in rs],
        }
        if m != "none":
            late = [statistics.median(r["woke_s"][k] for r in rs) - spin_woke[k] for k in range(args.points)]
            fig["wake_late_ms"] = statistics.median(late) * 1e3
            fig["wake_late_max_ms"] = max(late) * 1e3
        figures[m] = fig
        print(m, {k: v for k, v in fig.items() if k != "launch_us_trials"}, flush=True)
    result = {"name": "diag_event_wait", "env": environment(), "config": vars(args), "figures": figures}
    write_json(result, args.out, "diag_event_wait")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, label in zip(axes, ("launch_us", "python_loop_s", "cpu_util"),
                              ("host µs per kernel launch", "Python loop (s)", "busy cores")):  # fmt: skip
        ax.bar(modes, [figures[m][key] for m in modes])
        ax.set_title(label)
    fig.suptitle(f"{args.waiters} threads waiting on a busy side stream ({environment().get('device')})")
    fig.tight_layout()
    save_png(fig, args.out, "diag_event_wait")
    return result


if __name__ == "__main__":
    main()
