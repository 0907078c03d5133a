"""Gather bandwidth: dsx's zero-copy kernel beside the copy ceiling, CPU gathers and a naive kernel.

One process, one pinned table (default ~4 GB), 1M random row ids (with repeats, as a sampler produces):

* ``copy_ceiling``   cudaMemcpy of a pinned buffer of the gathered size (H2D), the PCIe ceiling
* ``cpu_pageable``   CPU ``index_select`` into pageable memory, then ``.to(cuda)``
* ``cpu_pinned``     CPU ``index_select`` into pinned staging memory, then a non-blocking copy
* ``naive_kernel``   zero-copy kernel, one warp per row, ids in the order given (no sort)
* ``dsx``            ``UnifiedTensor.gather``: GPU sort + dedup + tuned zero-copy kernel (sort included)
* ``dsx_queued``     ``dsx`` queued behind other GPU work, as a loader's gather is: the clock starts when the GPU
                     reaches it, so the host's launches (the sort alone is several kernels) do not leave the
                     GPU idle inside the timed span, and the index check is deferred (``dsx`` waits for it);
                     ``copy_ceiling_queued`` is the copy timed so. A queued method's fraction of the ceiling
                     pairs it with that copy timed just before it in each repeat (the median of the per-repeat
                     ratios): the link's rate drifts within seconds, and two timings taken back to back see the
                     same rate where two medians taken apart need not
* ``dsx_unsorted``   the tuned kernel without the sort
* ``dsx_bounded``    ``dsx`` limited to ``--bounded-sms`` SMs (what it may take beside training)
* ``dsx_all_sms``    ``dsx`` with no bound (one wave over every SM; rows < 512 B still keep to 8 SMs)
* ``dsx_sms{N}``     ``dsx`` limited to N SMs (``--sweep-sms``, rows <= 512 B only; rows < 512 B never take
                     more than 8 SMs, so N > 8 is not run for them)
* ``dsx_padded``     ``dsx`` from a copy of the table with rows 32 bytes apart (``row_alignment=32``), for row
                     sizes that are not a multiple of 32; ``dsx_padded_queued`` timed as ``dsx_queued``
* ``dsx_queued_off64`` ``dsx_queued`` from the same buffer 64 bytes in (rows of 128 bytes or more): where a
                     table torch allocated often starts, half-way into a 128-byte line

The table starts on a page (``dsx.direct.host_empty``), as dsx's own tables and copies do.

A row size that is not a multiple of 32 bytes gets a ``sector_bound``: the queued fraction of the row size
rounded up to 32 (320 for 300, 1024 for 1000), scaled by the row's share of those bytes and by the distinct rows
each reads. The GPU reads host memory in whole 32-byte sectors, so a gather of such rows, padded to whole
sectors, can do no better; it is estimated from the two sizes' medians, so a single round can lie above it.

Each method is timed 5 times a round (median), in 3 rounds over every row size (median of the rounds, each
round's figures kept in the JSON). CPU baselines get their ids already on the host; GPU methods get them on
the GPU. Every output is checked against ``index_select``. ``--quick`` runs tiny sizes on the CPU (the CPU paths only) as a smoke test.

    python benchmarks/bench_gather.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import dsx
from dsx.config import UnifiedConfig
from dsx.direct import host_empty, unified

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import save_png

NAME = "bench_gather"


def _env() -> dict[str, Any]:
    import deepspeed

    info: dict[str, Any] = {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "cuda": torch.version.cuda,
        "cpu_threads": torch.get_num_threads(),
        "host": platform.node(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info |= {
            "device": p.name,
            "sms": p.multi_processor_count,
            "gpu_memory_gb": round(p.total_memory / 2**30, 1),
        }
    else:
        info["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return info


# GPU cycles of the busy kernel that ``queued`` timing puts before ``fn``: a few ms at H100 clocks, longer
# than the host takes to queue a gather's launches
_QUEUE_CYCLES = 8_000_000
_OFF = 64  # bytes into a 128-byte line: where torch's 64-byte aligned allocations often start


def _time(fn, repeats: int, cuda: bool, queued: bool = False) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up (CUDA events on a GPU).

    ``queued``: the GPU is kept busy while the host queues ``fn``'s work, and the clock starts when the GPU
    reaches it: the time of the work itself, as when it runs behind other work. A host slower than the busy
    kernel would show up in the figure (against dsx, never for it)."""
    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            times.append(_cuda_seconds(fn, queued))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cuda_seconds(fn, queued: bool) -> float:
    """One timed call of ``fn`` between CUDA events, from idle or (``queued``) behind a busy kernel."""
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if queued:
        torch.cuda._sleep(_QUEUE_CYCLES)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def _time_paired(fn, ref, repeats: int) -> tuple[float, float]:
    """Queued CUDA timing of ``fn`` with ``ref`` (the copy ceiling) timed the same way just before it in every
    repeat: (median seconds of ``fn``, median of the per-repeat ratios ``ref / fn``). The link's rate drifts by
    several percent within seconds on a shared host; a ratio of two timings taken back to back follows the drift
    where a ratio of two medians taken apart does not."""
    fn()
    ref()
    times, ratios = [], []
    for _ in range(repeats):
        pair = [_cuda_seconds(f, queued=True) for f in (ref, fn)]
        times.append(pair[1])
        ratios.append(pair[0] / pair[1])
    return statistics.median(times), statistics.median(ratios)


def _fill(buf: torch.Tensor, seed: int) -> None:
    """Random bytes, 8 at a time (a 4 GB table fills in seconds)."""
    g = torch.Generator().manual_seed(seed)
    words = buf[: buf.numel() // 8 * 8].view(torch.int64)
    chunk = 1 << 24
    for s in range(0, words.numel(), chunk):
        n = min(chunk, words.numel() - s)
        words[s : s + n] = torch.randint(-(2**63), 2**63 - 1, (n,), generator=g, dtype=torch.int64)
    buf[words.numel() * 8 :] = 7


def _measure(
    args: argparse.Namespace, base: torch.Tensor, rb: int, cuda: bool, dev: torch.device, ext: Any
) -> dict[str, Any]:
    """Every method for one row size."""
    table_bytes = base.numel()
    rows = (table_bytes - _OFF) // rb  # (the same ids fit the table moved _OFF bytes in)
    table = base[: rows * rb].view(rows, rb)
    n = args.num_indices
    gidx = torch.randint(0, rows, (n,), generator=torch.Generator().manual_seed(rb))
    ref_rows = table.index_select(0, gidx[:4096])
    gathered = n * rb
    uniq = int(torch.unique(gidx).numel())
    rec: dict[str, Any] = {
        "row_bytes": rb,
        "table_rows": rows,
        "indices": n,
        "bytes": gathered,
        # dsx reads each distinct row once; this fraction of the gathered bytes actually crosses PCIe.
        "unique_fraction": round(uniq / n, 4),
    }
    check: dict[str, bool] = {}
    gbs: dict[str, float] = {}
    # queued methods: the median of their per-repeat fractions of the queued copy
    paired: dict[str, float] = {}

    def record(key: str, fn, out_fn, queued: bool = False, ref: torch.Tensor = ref_rows) -> None:
        if queued:
            secs, paired[key] = _time_paired(fn, lambda: dst.copy_(src, non_blocking=True), args.repeats)
        else:
            secs = _time(fn, args.repeats, cuda)
        gbs[key] = gathered / secs / 1e9
        out_fn().zero_()  # buffers are shared between methods: make a stale result impossible to pass
        fn()
        check[key] = bool(torch.equal(out_fn()[:4096].cpu(), ref))

    # Copy ceiling: one pinned (or plain, on CPU) buffer of the gathered size.
    src = torch.empty(gathered, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(gathered, dtype=torch.uint8, device=dev)
    secs = _time(lambda: dst.copy_(src, non_blocking=True), args.repeats, cuda)
    gbs["copy_ceiling"] = gathered / secs / 1e9
    if cuda:
        secs = _time(lambda: dst.copy_(src, non_blocking=True), args.repeats, cuda, queued=True)
        gbs["copy_ceiling_queued"] = gathered / secs / 1e9

    out_pg: list[torch.Tensor] = []

    def cpu_pageable() -> None:
        out_pg[:] = [table.index_select(0, gidx).to(dev)]

    record("cpu_pageable", cpu_pageable, lambda: out_pg[0])
    if cuda:
        stage = torch.empty((n, rb), dtype=torch.uint8, pin_memory=True)
        dst2 = torch.empty((n, rb), dtype=torch.uint8, device=dev)

        def cpu_pinned() -> None:
            torch.index_select(table, 0, gidx, out=stage)
            dst2.copy_(stage, non_blocking=True)

        record("cpu_pinned", cpu_pinned, lambda: dst2)
        didx = gidx.to(dev)
        flag = torch.zeros(2, dtype=torch.int64, device=dev)
        ut_view = unified(table, shared="off")
        record("naive_kernel", lambda: ext.naive_gather(table, didx, dst2, flag, rb, rows), lambda: dst2)
        for key, cfg in (
            ("dsx", UnifiedConfig(backend="cuda")),
            ("dsx_unsorted", UnifiedConfig(backend="cuda", sort_indices=False)),
            ("dsx_bounded", UnifiedConfig(backend="cuda", max_gather_sms=args.bounded_sms)),
            ("dsx_all_sms", UnifiedConfig(backend="cuda", max_gather_sms=None)),
            *(
                (f"dsx_sms{k}", UnifiedConfig(backend="cuda", max_gather_sms=k))
                for k in args.sweep_sms
                if rb <= 512 and (k <= 8 or rb == 512)  # the kernel caps rows < 512 B at 8 SMs
            ),
        ):
            with dsx.defaults.set(
                "unified", cfg
            ):  # (ut_view has no config of its own: it follows the defaults)
                record(key, lambda: ut_view.gather(didx, out=dst2), lambda: dst2)

        def record_queued(key: str, ut: Any, ref: torch.Tensor = ref_rows) -> None:
            # with the index check deferred, as a loader's gathers run ("sync", dsx's figure, makes the host wait
            # for the check inside the timed span)
            record(
                key, lambda: ut.gather(didx, out=dst2, check="deferred"), lambda: dst2, queued=True, ref=ref
            )
            ut.check()

        with dsx.defaults.set("unified", UnifiedConfig(backend="cuda")):
            record_queued("dsx_queued", ut_view)
            if rb >= 128:
                shifted = base[_OFF : _OFF + rows * rb].view(rows, rb)
                with unified(shifted, shared="off") as ut_off:  # (other bytes: its own reference)
                    record_queued("dsx_queued_off64", ut_off, shifted.index_select(0, gidx[:4096]))
        ut_view.close()
        if rb % 32:
            # rows in whole 32-byte sectors: the same rows, read from a padded copy of the table
            pad_cfg = UnifiedConfig(backend="cuda", row_alignment=32)
            with unified(table, shared="off", config=pad_cfg) as ut_pad:
                rec["padded_row_stride"] = ut_pad.row_stride
                record("dsx_padded", lambda: ut_pad.gather(didx, out=dst2), lambda: dst2)
                record_queued("dsx_padded_queued", ut_pad)
    else:
        ut_view = unified(table, shared="off", config=UnifiedConfig(backend="torch"))
        record("dsx", lambda: ut_view.gather(gidx), lambda: ut_view.gather(gidx))
    rec["gb_per_s"] = {k: round(v, 2) for k, v in gbs.items()}
    # queued figures: against the copy timed the same way, just before, each repeat
    rec["fraction_of_ceiling"] = {
        k: round(paired[k] if k in paired else v / gbs["copy_ceiling"], 3)
        for k, v in gbs.items()
        if not k.startswith("copy_ceiling")
    }
    if "dsx" in gbs:
        rec["dsx_read_gb_per_s"] = round(gbs["dsx"] * uniq / n, 2)  # bytes read from host / time
    rec["correct"] = check
    print(f"{rb:6d} B rows: " + "  ".join(f"{k} {v:6.1f}" for k, v in gbs.items()) + "  GB/s", flush=True)
    return rec


def _combine(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row size's rounds: medians of the GB/s and of each round's fraction of its own ceiling; every round's
    figures kept (``*_rounds``); correct only if every round was."""
    out = dict(recs[0])
    for key in ("gb_per_s", "fraction_of_ceiling"):
        out[f"{key}_rounds"] = {k: [r[key][k] for r in recs] for k in recs[0][key]}
        out[key] = {k: round(statistics.median(v), 3) for k, v in out[f"{key}_rounds"].items()}
    if "dsx_read_gb_per_s" in out:
        out["dsx_read_gb_per_s"] = round(statistics.median(r["dsx_read_gb_per_s"] for r in recs), 2)
    out["correct"] = {k: all(r["correct"][k] for r in recs) for k in recs[0]["correct"]}
    return out


def _sector_bound(rec: dict[str, Any], whole: dict[str, Any] | None) -> None:
    """A row whose size is not a multiple of 32 bytes still costs whole 32-byte sectors: padded, a 300-byte row
    reads the same 10 sectors as a 320-byte row. So its queued gather can do no better than the measured gather of
    rows of the size rounded up to 32 (``whole``, the same id count), scaled by the bytes that are the row's and by
    the distinct rows each reads (duplicates are read once): ``rec["sector_bound"]``, a fraction of the ceiling,
    from the two sizes' medians (an estimate: a single round can lie above it)."""
    rb = rec["row_bytes"]
    if whole is None or whole is rec or "dsx_queued" not in whole["fraction_of_ceiling"]:
        return
    bound = (
        whole["fraction_of_ceiling"]["dsx_queued"]
        * rb
        / whole["row_bytes"]
        * whole["unique_fraction"]
        / rec["unique_fraction"]
    )
    rec["sector_bound"] = {"of_ceiling_queued": round(bound, 3), "from_row_bytes": whole["row_bytes"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = torch.cuda.is_available() and not args.quick
    dev = torch.device("cuda" if cuda else "cpu")
    table_bytes = args.table_mb << 20
    base = host_empty((table_bytes,), torch.uint8)
    _fill(base, 0)
    t0 = time.perf_counter()
    base_ut = unified(base, shared="off")  # registers the pages once; views below share the registration
    reg_s = time.perf_counter() - t0
    ext = None
    if cuda:
        from dsx.ops import load_unified_gather

        ext = load_unified_gather(verbose=False)
    # rounds over every row size in turn: a row size's figures are medians over rounds taken minutes apart, so a
    # slow spell of the host or the link moves one round of each row size, not every figure of one
    rounds = [[_measure(args, base, rb, cuda, dev, ext) for rb in args.row_bytes] for _ in range(args.rounds)]
    results = [_combine(list(recs)) for recs in zip(*rounds)]
    base_ut.close()
    by = {r["row_bytes"]: r for r in results}
    if cuda:
        for r in results:
            _sector_bound(r, by.get(-(-r["row_bytes"] // 32) * 32))
    targets = {}
    if cuda:
        r512 = by.get(512)
        targets = {
            "dsx_512B_ge_45GBps": None if r512 is None else r512["gb_per_s"]["dsx"] >= 45.0,
            "dsx_ge_0.85_ceiling_rows_ge_256B": all(
                r["fraction_of_ceiling"]["dsx"] >= 0.85 for r in results if r["row_bytes"] >= 256
            ),
            "dsx_queued_ge_0.85_ceiling_rows_ge_256B": all(
                r["fraction_of_ceiling"]["dsx_queued"] >= 0.85 for r in results if r["row_bytes"] >= 256
            ),
            # rows that are not a multiple of 32 bytes read from the padded table (row_alignment=32)
            "dsx_queued_ge_0.85_ceiling_rows_ge_256B_padded": all(
                r["fraction_of_ceiling"].get("dsx_padded_queued", r["fraction_of_ceiling"]["dsx_queued"])
                >= 0.85
                for r in results
                if r["row_bytes"] >= 256
            ),
        }
    return {
        "name": NAME,
        "env": _env(),
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"table_bytes": table_bytes},
        "register_seconds": round(reg_s, 3),
        "results": results,
        "targets": targets,
        "notes": "GB/s = gathered bytes / median time in a round, median over the rounds; fractions: median of "
        "each round's fraction of that round's ceiling; dsx includes the GPU sort of the ids; dsx_queued is dsx "
        "timed from when the GPU reaches it (its fraction: the median over repeats of copy_ceiling_queued's time, taken "
        "just before it, over its own); CPU baselines receive "
        "host ids. Output of every method checked against index_select (first 4096 rows).",
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    ax.set_prop_cycle(color=plt.cm.tab20.colors)  # (more methods than the default cycle's ten colours)
    for key in dict.fromkeys(k for r in res for k in r["gb_per_s"]):  # (padded: only some row sizes)
        style = {"copy_ceiling": "k--", "copy_ceiling_queued": "k:"}.get(key, "-o")
        pts = [(r["row_bytes"], r["gb_per_s"][key]) for r in res if key in r["gb_per_s"]]
        ax.plot(*zip(*pts), style, label=key, lw=2.5 if key in ("dsx", "dsx_queued") else 1.3)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("row size (bytes)")
    ax.set_ylabel("GB/s (gathered bytes / time)")
    ax.set_title(f"gather of {res[0]['indices']:,} random rows — {report['env']['device']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # (beside the lines, not over them)
    save_png(fig, path.parent, path.stem)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--quick", action="store_true", help="tiny sizes on the CPU (smoke test)")
    p.add_argument("--table-mb", type=int, default=4096)
    p.add_argument("--num-indices", type=int, default=1 << 20)
    p.add_argument(
        "--row-bytes", type=int, nargs="+", default=[64, 128, 256, 300, 320, 512, 1000, 1024, 2048, 4096]
    )
    p.add_argument("--repeats", type=int, default=5, help="timed calls per method (median) in a round")
    p.add_argument("--rounds", type=int, default=3, help="passes over every row size (median over them)")
    p.add_argument("--bounded-sms", type=int, default=8)
    p.add_argument(
        "--sweep-sms",
        type=int,
        nargs="*",
        default=[4],
        help="extra SM caps for rows <= 512 B (rows < 512 B: caps <= 8 only)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.table_mb, args.num_indices, args.row_bytes, args.repeats, args.rounds = 8, 4096, [64, 516], 2, 2
    report = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(report, indent=2))
    plot(report, out / f"{NAME}.png")
    print(f"wrote {out / (NAME + '.json')} and {out / (NAME + '.png')}")
    if report["targets"]:
        print("targets:", report["targets"])
    return report


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    main()
