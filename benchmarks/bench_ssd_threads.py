"""How a drive serves the SSD tier's file calls on more threads: kvikio's pool size against the one-request probe.

The SSD tier's kvikio backend hands each call to kvikio, which cuts it into 4 MiB tasks (``KVIKIO_TASK_SIZE``)
and runs them on its process-wide pool of ``KVIKIO_NTHREADS`` threads, one by default. Whether more threads
pay depends on the drive: one that serves deep queues faster gains, one that does not loses to the seeks
between interleaved tasks. This times, in one directory, a write then a read of ``--mb`` MiB:

- ``probe``: ``dsx report --io``'s sequential 4 MiB O_DIRECT write and read, one request at a time;
- ``kvikio`` at each ``--threads`` count: one ``CuFile.pwrite`` / ``pread`` of the whole buffer (pinned, as the
  tier's staging slots are), the pool resized before (where kvikio imports: the GPU machine; its compat mode
  decides O_DIRECT or not per direction, and the JSON records its settings);
- ``posix`` at each count: the same 4 MiB tasks on a pool of that many threads (``os.pwrite`` / ``os.preadv``),
  O_DIRECT where the filesystem takes it, as the tier's own file is opened.

Writes are timed to the end of an ``fsync``, and the file's pages are dropped before the read, so both rates
are the drive's, not the page cache's. ``--repeats`` rounds, the ways and the thread counts in alternate order;
the JSON gives each way's rates per round, and per way and count the median, range and ratio of medians to one
thread.

    python benchmarks/bench_ssd_threads.py --out benchmarks/results      # suite ssd-threads
    python benchmarks/bench_ssd_threads.py --quick --out /tmp/x          # CPU smoke test (posix and probe)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import HelpFormatter, add_common_args, environment, exit_if_any_failed, save_png, write_json

from dsx.offload.io import kvikio_mode

__all__ = ["main", "summarize"]

TASK = 4 << 20  # kvikio's default task size, and the posix way's


def _kvikio() -> Any:
    """kvikio's module where it imports and CUDA is there, else None."""
    try:
        import kvikio
        import kvikio.defaults  # (a submodule kvikio 26 does not load by itself)
        import torch

        return kvikio if torch.cuda.is_available() else None
    except Exception:
        return None


def _kvikio_settings(kvikio: Any) -> dict[str, Any] | None:
    """The kvikio settings that decide how its calls reach the drive (each left out where this kvikio lacks it)."""
    if kvikio is None:
        return None
    out = {}
    for key in ("compat_mode", "task_size", "auto_direct_io_read", "auto_direct_io_write"):
        try:
            value = kvikio.defaults.get(key)
        except Exception:
            continue
        out[key] = getattr(value, "name", None) or str(value)  # an enum by its name: AUTO, not 2
    with contextlib.suppress(Exception):
        out["compat_mode_resolved"] = kvikio_mode()
    return out


def _drop_pages(path: str) -> None:
    """Flush the file and drop its pages, so that the next read comes from the drive."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _kvikio_rates(kvikio: Any, buf: Any, path: str, threads: int) -> tuple[float, float]:
    kvikio.defaults.set("num_threads", threads)
    n = buf.numel()
    with open(path, "wb"):  # (created and emptied here: the modes CuFile takes differ between versions)
        pass
    f = kvikio.CuFile(path, "r+")
    try:
        t = time.perf_counter()
        done = f.pwrite(buf.numpy(), n, 0).get()
        _drop_pages(path)
        w = n / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        got = f.pread(buf.numpy(), n, 0).get()
        r = n / (time.perf_counter() - t) / 1e9
    finally:
        f.close()
    if done != n or got != n:
        raise OSError(f"kvikio wrote {done} and read {got} of {n} bytes")
    return w, r


def _posix_rates(buf: Any, path: str, threads: int) -> tuple[float, float]:
    mv, n = memoryview(buf.numpy()), buf.numel()
    tasks = range(0, n, TASK)
    try:  # (tmpfs and some overlays refuse O_DIRECT: buffered there, its pages dropped before the read)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with ThreadPoolExecutor(threads) as pool:
            t = time.perf_counter()
            done = sum(pool.map(lambda o: os.pwrite(fd, mv[o : o + TASK], o), tasks))
            _drop_pages(path)
            w = n / (time.perf_counter() - t) / 1e9
            t = time.perf_counter()
            got = sum(pool.map(lambda o: os.preadv(fd, [mv[o : o + TASK]], o), tasks))
            r = n / (time.perf_counter() - t) / 1e9
    finally:
        os.close(fd)
    if done != n or got != n:
        raise OSError(f"posix wrote {done} and read {got} of {n} bytes")
    return w, r


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per way and thread count: each direction's median and range over the rounds, and the median's ratio to
    the same way's at one thread (where that was run)."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys((r["way"], r["threads"]) for r in rows if "error" not in r):
        runs = [r for r in rows if (r["way"], r["threads"]) == key and "error" not in r]
        entry: dict[str, Any] = {"runs": len(runs)}
        for way in ("write", "read"):
            vals = [r[f"{way}_GBps"] for r in runs]
            entry[f"{way}_GBps"] = statistics.median(vals)
            entry[f"{way}_range"] = [min(vals), max(vals)]
        out[f"{key[0]}@{key[1]}"] = entry
    for name, entry in out.items():
        one = out.get(f"{name.split('@')[0]}@1")
        if one is not None:
            for way in ("write", "read"):
                entry[f"{way}_vs_one_thread"] = entry[f"{way}_GBps"] / one[f"{way}_GBps"]
    return out


def _plot(summary: dict[str, Any], title: str) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 3, 4))
    for k, (way, shift) in enumerate((("write", -0.2), ("read", 0.2))):
        med = [summary[n][f"{way}_GBps"] for n in names]
        lo = [m - summary[n][f"{way}_range"][0] for m, n in zip(med, names)]
        hi = [summary[n][f"{way}_range"][1] - m for m, n in zip(med, names)]
        xs = [i + shift for i in range(len(names))]
        ax.bar(xs, med, 0.4, yerr=[lo, hi], capsize=3, label=way, color=f"C{k}")
    ax.set_xticks(range(len(names)), [n.replace("@", "\n") + " thr" for n in names])
    ax.set_ylabel("GB/s (median, bars: range over rounds)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_common_args(p)
    p.add_argument("--dir", default=None, help="directory on the drive (default: a temporary one under /tmp)")
    p.add_argument(
        "--mb", type=int, default=None, help="MiB written and read a way (default 2048; --quick 64)"
    )
    p.add_argument(
        "--threads", type=int, nargs="+", default=[1, 2, 4, 8], help="thread counts of kvikio and posix"
    )
    p.add_argument("--repeats", type=int, default=3, help="rounds")
    p.add_argument("--name", default="bench_ssd_threads", help="result file name")
    args = p.parse_args(argv)
    mb = args.mb or (64 if args.quick else 2048)
    if mb < 4 or mb % 4 or args.repeats < 1 or any(t < 1 for t in args.threads):
        p.error("--mb must be a positive multiple of 4, --repeats and --threads positive")
    import torch

    from dsx.offload.align import aligned_empty
    from dsx.runtime.bandwidth import measure_file_bandwidth

    kvikio = _kvikio()
    ways = ["probe", *(["kvikio"] if kvikio else []), "posix"]
    buf = aligned_empty(mb << 20, torch.cuda.is_available())  # pinned on the GPU machine, as the tier's slots
    buf.random_(0, 256, generator=torch.Generator().manual_seed(0))
    before = int(kvikio.defaults.get("num_threads")) if kvikio else None
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "f")
        try:
            for rnd in range(args.repeats):
                for way in ways if rnd % 2 == 0 else ways[::-1]:
                    counts = args.threads if rnd % 2 == 0 else args.threads[::-1]
                    for threads in [1] if way == "probe" else counts:
                        row: dict[str, Any] = {"round": rnd, "way": way, "threads": threads}
                        try:
                            if way == "probe":
                                m = measure_file_bandwidth(d, mb)
                                row.update(
                                    write_GBps=m["write_GBps"], read_GBps=m["read_GBps"], mode=m["mode"]
                                )
                            elif way == "kvikio":
                                row["write_GBps"], row["read_GBps"] = _kvikio_rates(
                                    kvikio, buf, path, threads
                                )
                            else:
                                row["write_GBps"], row["read_GBps"] = _posix_rates(buf, path, threads)
                        except (
                            OSError,
                            RuntimeError,
                        ) as exc:  # a full disk (kvikio raises RuntimeError): recorded
                            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                        print(row, flush=True)
                        rows.append(row)
        finally:
            if kvikio:
                kvikio.defaults.set("num_threads", before)
    summary = summarize(rows)
    env = environment()
    result = {"config": {**vars(args), "mb": mb, "kvikio": _kvikio_settings(kvikio)}, "env": env, "rows": rows,
              "summary": summary}  # fmt: skip
    write_json(result, args.out, args.name)
    save_png(
        _plot(summary, f"{mb} MiB written then read, by way and threads ({env['device']})"),
        args.out,
        args.name,
    )
    exit_if_any_failed(rows, args.out, args.name)
    return result


if __name__ == "__main__":
    main()
