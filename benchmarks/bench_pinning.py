"""What pinning the activation host pool costs, and what it stalls: ``pin_memory=True`` against pinning in place.

Each way pins a buffer of each size in a fresh process (torch's pinned-memory cache would otherwise hand the
second repeat the first one's pages), on a thread of its own, while the main thread runs a bf16 matmul loop on
the GPU, as the training thread would: the JSON gives the time to pin, the longest loop iteration during it
(``worst_iter_s``) beside the loop's usual iteration (``usual_iter_s``, the median before pinning began), and
the buffer's copy rates to and from the GPU (which show it is pinned). ``--repeats`` rounds, the ways
interleaved in each. Sizes are powers of two by default, so that torch's pinned-memory cache, which rounds a
block up to one, pins no more than asked for.

Ways: ``pin_memory`` (``torch.empty(..., pin_memory=True)``: ``cudaHostAlloc`` faults the pages in on one
thread) and ``in_place`` (:class:`dsx.runtime.host_memory.PinnedBuffer`: the pages faulted in on up to 8
threads of the GPU's NUMA node, then ``cudaHostRegister``). Without a GPU the same code runs without pinning
(``pinned`` false in each row, the matmul loop on the CPU): the page filling and the plumbing, not a pinning
figure; ``--quick`` only makes the sizes small.

    python benchmarks/bench_pinning.py --out benchmarks/results      # suite pinning
    python benchmarks/bench_pinning.py --quick --out /tmp/x          # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import HelpFormatter, add_common_args, environment, exit_if_any_failed, save_png, write_json

__all__ = ["WAYS", "main"]

WAYS = ("pin_memory", "in_place")
GiB = 1 << 30


def _pin(way: str, nbytes: int, cuda: bool) -> tuple[Any, Any]:
    """The buffer, and what keeps it pinned (closed after the copies). Timed: what it imports is imported
    before (``_child``)."""
    import torch

    from dsx.runtime.host_memory import PinnedBuffer, touch_pages, unforked_empty

    if way == "pin_memory":
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        if not cuda:  # (every page written, as cudaHostAlloc maps every page)
            buf.zero_()
        return buf, None
    if cuda:
        pb = PinnedBuffer(nbytes, device=torch.device("cuda", 0))
        return pb.tensor, pb
    _, buf = unforked_empty(nbytes)
    return touch_pages(buf), None


def _child(way: str, nbytes: int) -> dict[str, Any]:
    import torch

    # imported, and the memory checked, before the timed window: the pinning alone is timed
    from dsx.runtime.host_memory import HostMemoryError, require_host_bytes

    cuda = torch.cuda.is_available()
    try:
        require_host_bytes(nbytes)
    except HostMemoryError as exc:
        return {"way": way, "gib": nbytes / GiB, "error": f"{type(exc).__name__}: {exc}"}
    dev = torch.device("cuda" if cuda else "cpu")
    n = 8192 if cuda else 256
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16 if cuda else torch.float32)

    def step() -> float:
        t = time.perf_counter()
        (a @ a).sum().item()  # .item(): the host waits for the GPU, as a training step's loss does
        return time.perf_counter() - t

    usual = statistics.median(step() for _ in range(20))
    got: dict[str, Any] = {}

    def pin() -> None:
        t = time.perf_counter()
        try:
            got["buf"], got["keep"] = _pin(way, nbytes, cuda)
        except Exception as exc:  # reported in the row, not lost with the thread
            got["error"] = f"{type(exc).__name__}: {exc}"
        got["pin_s"] = time.perf_counter() - t

    th = threading.Thread(target=pin)
    th.start()
    iters = [step()]  # at least one iteration while it pins
    while th.is_alive():
        iters.append(step())
    th.join()
    row: dict[str, Any] = {"way": way, "gib": nbytes / GiB, "pin_s": got["pin_s"], "usual_iter_s": usual}
    row.update(worst_iter_s=max(iters), iters_during=len(iters))
    if "error" in got:
        return {**row, "error": got["error"]}
    buf = got["buf"]
    row["pinned"] = bool(cuda and buf.is_pinned())
    m = min(nbytes, GiB)
    dst = torch.empty(m, dtype=torch.uint8, device=dev)
    for name, (to, frm) in (("d2h_gbps", (buf[:m], dst)), ("h2d_gbps", (dst, buf[:m]))):
        to.copy_(frm, non_blocking=True)  # once untimed: the first copy maps the range
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        to.copy_(frm, non_blocking=True)
        if cuda:
            torch.cuda.synchronize()
        row[name] = m / (time.perf_counter() - t) / 1e9
    if got["keep"] is not None:
        got["keep"].close()
    return row


def _run_child(way: str, nbytes: int, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", way, str(nbytes)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"way": way, "gib": nbytes / GiB, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return {"way": way, "gib": nbytes / GiB, "error": f"exit {p.returncode}: {' | '.join(tail)}"}
    return json.loads(lines[-1])


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per size and way: the median time to pin and longest stalled iteration, with every round's (spread)."""
    out: dict[str, Any] = {}
    for r in rows:
        if "error" in r:
            continue
        s = out.setdefault(f"{r['gib']:g}", {}).setdefault(
            r["way"], {"pin_s_runs": [], "worst_iter_s_runs": []}
        )
        s["pin_s_runs"].append(r["pin_s"])
        s["worst_iter_s_runs"].append(r["worst_iter_s"])
    for ways in out.values():
        for s in ways.values():
            s["pin_s_runs"].sort()
            s["worst_iter_s_runs"].sort()
            s["pin_s"] = statistics.median(s["pin_s_runs"])
            s["worst_iter_s"] = statistics.median(s["worst_iter_s_runs"])
        if set(WAYS) <= set(ways):
            ways["pin_memory_vs_in_place"] = ways["pin_memory"]["pin_s"] / ways["in_place"]["pin_s"]
    return out


def _plot(summary: dict[str, Any], title: str) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(summary)
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.2
    for i, way in enumerate(WAYS):
        for j, (key, hatch, label) in enumerate(
            (("pin_s", None, "time to pin"), ("worst_iter_s", "//", "longest matmul iteration meanwhile"))
        ):
            xs = [k + (2 * i + j - 1.5) * w for k in range(len(sizes))]
            ys = [summary[s].get(way, {}).get(key, 0.0) for s in sizes]
            ax.bar(xs, ys, w, color=f"C{i}", hatch=hatch, edgecolor="black", label=f"{way}: {label}")
    ax.set_xticks(range(len(sizes)), [f"{s} GiB" for s in sizes])
    ax.set_ylabel("seconds (median of rounds)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return fig


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_common_args(p)
    p.add_argument(
        "--sizes-gib", type=float, nargs="+", help="buffer sizes; none given: 4 32 (--quick: 1/16 1/8)"
    )
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    p.add_argument("--timeout", type=float, default=180, help="seconds a child may take")
    p.add_argument("--name", default="bench_pinning", help="result file name")
    p.add_argument("--child", nargs=2, metavar=("WAY", "BYTES"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        way, nbytes = args.child
        print(json.dumps(_child(way, int(nbytes))), flush=True)
        return {}
    sizes = args.sizes_gib or ([1 / 16, 1 / 8] if args.quick else [4, 32])
    if args.repeats < 1 or any(s <= 0 for s in sizes):
        p.error("--repeats and --sizes-gib must be positive")
    rows = []
    for rnd in range(args.repeats):
        for gib in sizes:
            for way in WAYS if rnd % 2 == 0 else WAYS[::-1]:  # each way goes first in alternate rounds
                row = {**_run_child(way, int(gib * GiB), args.timeout), "round": rnd}
                print(json.dumps(row), flush=True)
                rows.append(row)
    summary = summarize(rows)
    env = environment()
    result = {"config": vars(args), "env": env, "rows": rows, "summary": summary}
    write_json(result, args.out, args.name)
    pinned = any(r.get("pinned") for r in rows)
    what = (
        "pinning a host buffer while the GPU computes"
        if pinned
        else "filling a host buffer, unpinned (no GPU)"
    )
    save_png(_plot(summary, f"{what} ({env['device']})"), args.out, args.name)
    exit_if_any_failed(rows, args.out, args.name)
    return result


if __name__ == "__main__":
    main()
