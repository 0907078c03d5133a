"""Shared plumbing for ``benchmarks/bench_*.py``: the run's environment, the CLI flags, JSON and PNG output.

Every benchmark writes ``<out>/<name>.json`` (environment + config + every figure) and ``<out>/<name>.png``.
A benchmark that runs several shapes (``bench_offload.py``, ``plan_frontier.py``, ``bench_hetero_scale.py``)
keeps one file all the same: each shape is a section of it (``write_section``), written by its own command and
left alone by the others' commands, and its PNG draws every section, a panel each (``save_sections_png``).
Usage::

    from benchmarks._common import add_common_args, environment, save_png, write_json

    p = argparse.ArgumentParser(); add_common_args(p); args = p.parse_args()
    result = {"config": vars(args), "env": environment(), "figures": {...}}
    write_json(result, args.out, "bench_x"); save_png(fig, args.out, "bench_x")

Nothing here imports matplotlib, DeepSpeed or optional packages at module import time, so a benchmark's
``--help`` stays fast and a missing optional package shows as ``None`` in the environment, not an error.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata as md
import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_OUT",
    "HelpFormatter",
    "add_common_args",
    "device_name",
    "environment",
    "exit_if_any_failed",
    "host_probe_s",
    "is_peer",
    "median_runs",
    "read_sections",
    "save_png",
    "save_sections_png",
    "section_name",
    "utc_now",
    "versions",
    "write_json",
    "write_section",
]

DEFAULT_OUT = "benchmarks/results"


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with the module docstring as written (its examples, its lists) and every option's default."""


# Distributions whose versions a result should carry; absent ones are recorded as None (not installed).
_DISTS = (
    "torch",
    "deepspeed",
    "triton",
    "numpy",
    "torch-geometric",
    "megatron-core",
    "kvikio-cu13",
    "nvidia-dali-cuda130",
    "dsx",
)


def add_common_args(
    parser: argparse.ArgumentParser, default_out: str = DEFAULT_OUT
) -> argparse.ArgumentParser:
    """Add ``--out DIR`` and ``--quick`` (tiny sizes on the CPU, for the smoke test) to ``parser``."""
    # (a parser whose help shows every default already says it)
    shows = issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
    where = "" if shows else f" (default {default_out})"
    parser.add_argument("--out", default=default_out, help=f"directory for <name>.json/.png{where}")
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes that run on a CPU in seconds (smoke test)"
    )
    return parser


def utc_now() -> str:
    """ISO-8601 UTC timestamp to the second, e.g. ``2026-11-22T10:45:00+00:00``."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def versions() -> dict[str, str | None]:
    """Installed versions of the packages a result depends on (``None`` = not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in _DISTS:
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def host_probe_s(iterations: int = 300_000) -> float:
    """Seconds a fixed pure-Python loop takes (best of 3): the host CPU's speed as this thread sees it, to tell
    a slow host (the GPU starved of work) from a slow GPU."""
    import time

    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        acc = 0
        for i in range(iterations):
            acc += i & 7
        best = min(best, time.perf_counter() - t0)
    return best


def device_name() -> str:
    """Name of CUDA device 0 (e.g. ``NVIDIA H100 80GB HBM3``), else ``cpu (<processor>)``."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"cpu ({platform.processor() or platform.machine()})"


def environment() -> dict[str, Any]:
    """Everything a figure needs to be read correctly: device, versions, date, host, threads."""
    env: dict[str, Any] = {
        "date_utc": utc_now(),
        "host": platform.node(),
        "device": device_name(),
        "cpu_count": os.cpu_count(),
        "versions": versions(),
    }
    try:
        import torch

        env["torch_cuda"] = torch.version.cuda
        env["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env["gpu"] = {
                "count": torch.cuda.device_count(),
                "memory_gib": round(p.total_memory / 2**30, 1),
                "capability": f"{p.major}.{p.minor}",
                "sms": p.multi_processor_count,
            }
    except ImportError:
        env["torch_cuda"] = None
    return env


def _jsonable(x: Any) -> Any:
    # Tensors/NumPy scalars become Python numbers; NaN/inf become None so that the file is strict JSON.
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Path):
        return str(x)
    return x


def _write_strict(data: dict[str, Any], out: str | os.PathLike[str], name: str) -> Path:
    # Strict JSON, written beside the file and moved over it: a run killed mid-write (a suite's timeout) leaves
    # the file as it was, not cut short (a file of sections holds other runs' results too).
    path = Path(out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(_jsonable(data), indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def write_json(result: dict[str, Any], out: str | os.PathLike[str], name: str) -> Path:
    """Write ``result`` to ``<out>/<name>.json`` (strict JSON; adds ``env`` if missing); return the path."""
    data = dict(result)
    data.setdefault("env", environment())
    return _write_strict(data, out, name)


_KEEP_OUT = (
    "a run that writes there stops before it writes anything: move the file away, or give another --out"
)


def section_name(text: str) -> str:
    """``text`` as a section's name: letters, digits, ``_`` and ``-`` (an argparse ``type``, so that a wrong
    name stops a run before its work, not when it writes)."""
    if not text or not text.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"a section name is letters, digits, '_' and '-', not {text!r}")
    return text


def read_sections(
    out: str | os.PathLike[str], name: str, what_to_do: str = _KEEP_OUT
) -> dict[str, dict[str, Any]]:
    """The sections of ``<out>/<name>.json`` by name, in the file's order; none when the file does not exist.

    A file that is not JSON, or holds no ``sections`` (a result of another layout), stops the run, naming the
    file and ``what_to_do``: a benchmark calls this before its work, so that such a file is never
    overwritten."""
    path = Path(out) / f"{name}.json"
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        sections = data.get("sections") if isinstance(data, dict) else None
        if not isinstance(sections, dict) or not all(isinstance(s, dict) for s in sections.values()):
            raise ValueError("no 'sections' of results at its top")
    except (OSError, ValueError) as e:  # (ValueError: JSONDecodeError and UnicodeDecodeError too)
        raise SystemExit(f"{path} is not a file of benchmark result sections ({e}); {what_to_do}") from None
    return sections


def write_section(
    result: dict[str, Any], out: str | os.PathLike[str], name: str, section: str
) -> tuple[Path, dict[str, dict[str, Any]]]:
    """Write ``result`` as section ``section`` of ``<out>/<name>.json`` (strict JSON; adds ``env`` to the
    section if missing: sections may come from different machines, so the file has none of its own), keeping
    the file's other sections as they are and where they are (a new section goes last). Returns the path and
    every section, to draw them."""
    sections = read_sections(out, name)
    data = dict(result)
    data.setdefault("env", environment())
    sections[section_name(section)] = data
    path = _write_strict({"name": name, "sections": sections}, out, name)
    return path, json.loads(path.read_text())["sections"]


def save_sections_png(
    sections: dict[str, dict[str, Any]],
    draw: Any,
    out: str | os.PathLike[str],
    name: str,
    size: tuple[float, float] = (13.0, 5.0),
    dpi: int = 110,
) -> Path:
    """One PNG of every section, a panel each from the top in the file's order: ``draw(panel, section,
    result)`` draws one section into ``panel`` (a matplotlib SubFigure: ``panel.subplots()``,
    ``panel.suptitle()``); ``size`` is one panel's width and height in inches."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(out) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = plt.figure(figsize=(size[0], size[1] * max(len(sections), 1)), layout="constrained")
    panels = fig.subfigures(max(len(sections), 1), 1, squeeze=False).ravel()
    for panel, (section, result) in zip(panels, sections.items()):
        draw(panel, section, result)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def exit_if_any_failed(rows: list[dict[str, Any]], out: str | os.PathLike[str], name: str) -> None:
    """Exit non-zero, naming the JSON, when a row carries an ``error``: the results are written first, so a
    failed run's rows can be read, and the suite's log shows it failed."""
    failed = sum("error" in r for r in rows)
    if failed:
        sys.exit(f"{failed} run(s) failed: see 'rows' in {out}/{name}.json")


def save_png(fig: Any, out: str | os.PathLike[str], name: str, dpi: int = 120) -> Path:
    """Save a matplotlib figure to ``<out>/<name>.png`` with the Agg backend (no display) and close it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(out) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def median_seconds(fn: Any, repeats: int, cuda: bool) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls: CUDA events on the GPU, perf_counter on the CPU.

    Call ``fn()`` once before (warm-up: compilation, allocator) — this helper does not.
    """
    import statistics
    import time

    import torch

    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_runs(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per config, its run of median step time (``--repeats`` runs each config several times; the lower middle
    one of an even count: a run that happened, not an average), with every run's step time beside it
    (``step_s_runs``, sorted: the spread)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["config"], []).append(r)
    out = {}
    for name, runs in by.items():
        runs = sorted(runs, key=lambda r: r["step_s"])
        out[name] = {**runs[(len(runs) - 1) // 2], "step_s_runs": [r["step_s"] for r in runs]}
    return out


def is_peer(config: str) -> bool:
    """Whether an activation-offload config is a peer dsx is compared against: not dsx's own, and not
    ``none_copies`` (a diagnostic that moves bytes without freeing any)."""
    return not config.startswith(("dsx", "none_copies"))
