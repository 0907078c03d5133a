"""``dsx report``: what this machine supports and what dsx will use.

Every probe is wrapped: a missing optional part is a row that says so, never a traceback.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import importlib
import importlib.metadata as md
import importlib.util
import io
import json
import os
import resource
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["collect", "format_table", "main", "measure_io"]

Row = tuple[str, str, str]  # (section, item, value)


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _probe(rows: list[Row], section: str, item: str, fn: Callable[[], str]) -> None:
    try:
        value = fn()
    except Exception as exc:  # a probe must never take the report down
        value = f"unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''})"
    rows.append((section, item, value))


def _torch_rows(rows: list[Row]) -> None:
    import torch

    _probe(rows, "torch", "version", lambda: torch.__version__)
    _probe(rows, "torch", "CUDA build", lambda: torch.version.cuda or "no (CPU-only build)")
    _probe(
        rows, "torch", "GPUs", lambda: str(torch.cuda.device_count()) if torch.cuda.is_available() else "0"
    )
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):

        def gpu(i: int = i) -> str:
            p = torch.cuda.get_device_properties(i)
            return f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs"

        _probe(rows, "torch", f"GPU {i}", gpu)


def _deepspeed_rows(rows: list[Row]) -> None:
    v = _version("deepspeed")
    rows.append(("deepspeed", "version", v or "not installed"))
    if v is None:
        return

    def ops() -> str:
        from deepspeed.ops.op_builder.all_ops import ALL_OPS

        from dsx.ops.cache import is_built

        want = ["async_io", "cpu_adam", "cpu_adagrad", "fused_adam", "transformer_inference", "gds"]
        out = []
        for name in want:
            builder = ALL_OPS.get(name)
            if builder is None:
                continue
            # quiet, into a real file: DeepSpeed's compile probes redirect sys.stderr's file descriptor, and a
            # stream without one fails them (async_io would read as incompatible)
            with (
                open(os.devnull, "w") as quiet,
                contextlib.redirect_stdout(quiet),
                contextlib.redirect_stderr(quiet),
            ):
                ok = builder.is_compatible(verbose=False)
            state = "built" if is_built(name, ok) else ("jit" if ok else "incompatible")
            out.append(f"{name}:{state}")
        return ", ".join(out)

    _probe(rows, "deepspeed", "ops (compatible / built)", ops)

    def locks() -> str:
        from dsx.ops.cache import build_lock, extensions_root

        root = extensions_root()
        found = (
            [(d.name, build_lock(d.name)) for d in sorted(root.iterdir()) if d.is_dir()]
            if root.is_dir()
            else []
        )
        held = [
            f"{name}: lock {lock[1] / 60:.0f} min old ({lock[0]})" for name, lock in found if lock is not None
        ]
        if not held:
            return "none"
        # torch's JIT load waits while the file exists: one left by a build that died holds every later load
        return "; ".join(held) + ": remove a lock whose op no process on this machine is building"

    _probe(rows, "deepspeed", "op build locks", locks)


def _optional_rows(rows: list[Row]) -> None:
    def triton() -> str:
        v = _version("triton")
        if v is None:
            return "not installed"
        if os.environ.get("TRITON_INTERPRET") == "1":
            return f"{v}, interpreter mode (TRITON_INTERPRET=1)"
        import torch

        return (
            f"{v}, compiled"
            if torch.cuda.is_available()
            else f"{v}, no GPU: kernels run only under TRITON_INTERPRET=1"
        )

    _probe(rows, "kernels", "triton", triton)

    def kvikio() -> str:
        if _version("kvikio-cu13") is None and _version("kvikio-cu12") is None and _version("kvikio") is None:
            return "not installed (pip install dsx[gds])"
        kv = importlib.import_module("kvikio")
        return f"{kv.__version__}, {importlib.import_module('dsx.offload.io').kvikio_mode()}"

    _probe(rows, "io", "kvikio", kvikio)
    _probe(
        rows,
        "io",
        "libaio",
        lambda: ctypes.util.find_library("aio") or "not found (apt-get install libaio-dev)",
    )
    _probe(rows, "data", "nvidia-dali", lambda: _version("nvidia-dali-cuda130") or _version("nvidia-dali-cuda120")
           or "not installed (pip install dsx[dali])")  # fmt: skip

    def pyg() -> str:
        v = _version("torch-geometric") or _version("torch_geometric")
        if v is None:
            return "not installed (pip install dsx[gnn])"
        extras = [n for n in ("pyg-lib", "torch-sparse", "torch-scatter") if _version(n)]
        return f"{v}; CPU sampling via {', '.join(extras) if extras else 'none (NeighborLoader needs pyg-lib or torch-sparse; dsx.direct.NeighborLoader does not)'}"

    _probe(rows, "gnn", "torch-geometric", pyg)
    _probe(
        rows,
        "llm",
        "megatron-core",
        lambda: _version("megatron-core") or "not installed (pip install dsx[llm])",
    )


def _memory_rows(rows: list[Row]) -> None:
    def shm() -> str:
        st = os.statvfs("/dev/shm")
        return f"{st.f_blocks * st.f_frsize / 2**30:.1f} GiB total, {st.f_bavail * st.f_frsize / 2**30:.1f} GiB free"

    def memlock() -> str:
        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        fmt = lambda v: "unlimited" if v == resource.RLIM_INFINITY else f"{v / 2**20:.0f} MiB"  # noqa: E731
        # NVIDIA's driver pins past the limit; mlock(), RDMA and some drivers are held to it
        note = (
            "" if soft == resource.RLIM_INFINITY else " (NVIDIA's driver pins past it; mlock and RDMA do not)"
        )
        return f"soft {fmt(soft)}, hard {fmt(hard)}{note}"

    _probe(rows, "memory", "/dev/shm", shm)
    _probe(rows, "memory", "locked-memory limit", memlock)


def _dsx_rows(rows: list[Row]) -> None:
    def offload_backend() -> str:
        if importlib.util.find_spec("dsx.offload.io") is None:
            return "not available in this build of dsx"
        io_mod = importlib.import_module("dsx.offload.io")
        desc = io_mod.describe_backends()
        chosen = io_mod.auto_choice(desc)
        avail = ", ".join(f"{k}:{'yes' if v['available'] else 'no'}" for k, v in desc.items())
        return f"auto -> {chosen} ({avail})"

    def gather_backend() -> str:
        import torch

        from dsx.ops import UnifiedGatherBuilder

        if not torch.cuda.is_available():
            return "torch (no GPU: index_select on host tensors)"
        with contextlib.redirect_stdout(io.StringIO()):
            ok = UnifiedGatherBuilder().is_compatible(verbose=False)
        return (
            "cuda kernel (csrc/unified_gather.cu, JIT on first use)"
            if ok
            else "torch fallback (op incompatible)"
        )

    def rgnn_backend() -> str:
        import torch

        if os.environ.get("TRITON_INTERPRET") == "1":
            return "triton interpreter"
        if torch.cuda.is_available() and _version("triton"):
            return "triton (compiled)"
        return "pure-PyTorch reference (no CUDA)"

    _probe(rows, "dsx", "activation offload I/O", offload_backend)
    _probe(rows, "dsx", "unified gather", gather_backend)
    _probe(rows, "dsx", "rgnn kernels", rgnn_backend)


def measure_io(path: str | os.PathLike[str], mb: int = 256) -> dict[str, Any]:
    """Sequential write then read bandwidth of a temporary file in ``path`` (see
    :func:`dsx.runtime.bandwidth.measure_file_bandwidth`: O_DIRECT where allowed, 4 MiB aligned blocks)."""
    from dsx.runtime.bandwidth import measure_file_bandwidth

    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"--io {str(d)!r} is not an existing directory")
    if not os.access(d, os.W_OK):
        raise PermissionError(f"--io {str(d)!r} is not writable")
    return measure_file_bandwidth(d, mb)


def collect(io_path: str | None = None, io_mb: int = 256) -> dict[str, Any]:
    rows: list[Row] = []
    _probe(rows, "system", "dsx", lambda: _version("dsx") or "not installed (running from a checkout)")
    _probe(rows, "system", "cpu cores", lambda: str(os.cpu_count()))
    _probe(rows, "system", "disk free (.)", lambda: f"{shutil.disk_usage('.').free / 2**30:.0f} GiB")
    _torch_rows(rows)
    _deepspeed_rows(rows)
    _optional_rows(rows)
    _memory_rows(rows)
    _dsx_rows(rows)
    out: dict[str, Any] = {"rows": [{"section": s, "item": i, "value": v} for s, i, v in rows]}
    if io_path is not None:
        out["io"] = measure_io(io_path, io_mb)
    return out


def format_table(report: dict[str, Any]) -> str:
    rows = [(r["section"], r["item"], r["value"]) for r in report["rows"]]
    if "io" in report:
        io_ = report["io"]
        rows.append(("io", f"bandwidth {io_['path']}", f"write {io_['write_GBps']:.2f} GB/s, read "
                     f"{io_['read_GBps']:.2f} GB/s ({io_['mode']}, {io_['bytes'] >> 20} MiB)"))  # fmt: skip
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{'section':<{w0}}  {'item':<{w1}}  value", f"{'-' * w0}  {'-' * w1}  {'-' * 40}"]
    lines += [f"{s:<{w0}}  {i:<{w1}}  {v}" for s, i, v in rows]
    return "\n".join(lines)


def main(args: Any) -> int:
    try:
        report = collect(args.io, args.io_mb)
    except (OSError, ValueError) as exc:
        print(f"dsx report: error: {exc}")
        return 2
    print(json.dumps(report, indent=1) if args.json else format_table(report))
    return 0
