"""Summarise interleaved A/B rounds of ``bench_offload.py`` (runs written as sections
``<prefix>_<variant>_<round>`` of ``<out>/bench_offload.json``): each variant's median step against its own
round's ``none`` run.

Usage::

    python benchmarks/bench_offload.py --configs none --section ab_none_1 --out /tmp/ab   # ... every round
    python benchmarks/ab_summary.py --out /tmp/ab ab

Writes ``<out>/<name>.json`` (every run: step, ratio, bytes moved, GPU waits for reads) and a PNG of the ratios.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import HelpFormatter, add_common_args, environment, read_sections, save_png, write_json


def collect(results: Path, prefix: str, file: str = "bench_offload") -> list[dict[str, Any]]:
    """Every run of ``prefix`` among the sections of ``<results>/<file>.json``: variant, round, median step,
    ratio to the round's no-offload step."""
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    for section, data in read_sections(
        results, file, "give the --out that bench_offload.py wrote to"
    ).items():
        # (a variant is one word: a prefix that extends another, x and x_y, must not lend x its runs)
        m = re.fullmatch(rf"{re.escape(prefix)}_([A-Za-z0-9]+)_(\d+)", section)
        if m is None:
            continue
        res = data["results"][0]
        if "error" in res:
            continue
        tel = res.get("telemetry") or {}
        waits = [w.get("unpack", 0.0) for w in tel.get("gpu_wait_by_measured_step", [])]
        runs[(m.group(1), int(m.group(2)))] = {
            "stage": prefix, "variant": m.group(1), "round": int(m.group(2)), "step_s": res["step_s"],
            "device": data["env"]["device"],
            # (none_copies moves its bytes without dsx: what it copied each way a step)
            "written_gb": (tel.get("written_gb_per_measured_step") or [res.get("copied_gb_per_step")])[0],
            "gpu_wait_for_reads_s": waits, "event_wait": res.get("event_wait"),
        }  # fmt: skip
    out = []
    for (variant, rnd), run in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        base = runs.get(("none", rnd))
        if variant != "none" and base is not None:
            out.append({**run, "ratio_vs_none": base["step_s"] / run["step_s"]})
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_common_args(p)
    p.add_argument("prefixes", nargs="+", help="section-name prefixes of the A/B stages")
    p.add_argument("--file", default="bench_offload", help="the runs' result file in --out, without .json")
    p.add_argument("--name", default="ab_summary")
    p.add_argument("--target", type=float, default=0.97)
    args = p.parse_args(argv)
    rows = [r for prefix in args.prefixes for r in collect(Path(args.out), prefix, args.file)]
    if not rows:
        raise SystemExit(f"no A/B runs under {args.out} for {args.prefixes}")
    by_variant: dict[str, list[int]] = {}  # variant -> [runs at or above the target, runs]
    for r in rows:
        tally = by_variant.setdefault(r["variant"], [0, 0])
        tally[0] += r["ratio_vs_none"] >= args.target
        tally[1] += 1
    result = {"name": args.name, "env": environment(), "config": vars(args), "runs": rows,
              "at_or_above_target": sum(r["ratio_vs_none"] >= args.target for r in rows),
              "at_or_above_target_by_variant": by_variant}  # fmt: skip
    write_json(result, args.out, args.name)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    labels = [f"{r['stage'].split('_')[-1]}\n{r['variant']}" for r in rows]
    ax.scatter(range(len(rows)), [r["ratio_vs_none"] for r in rows], s=14)
    ax.axhline(args.target, color="red", lw=0.8, label=f"target {args.target:g}x")
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("no offload step / dsx step")
    ax.set_title("hide-only plan against no offload, each run against its own round")
    ax.legend()
    fig.tight_layout()
    save_png(fig, args.out, args.name)
    return result


if __name__ == "__main__":
    main()
