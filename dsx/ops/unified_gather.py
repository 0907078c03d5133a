"""DeepSpeed ``OpBuilder`` for the zero-copy gather kernel (``csrc/unified_gather.{cu,cpp}``).

JIT: the first GPU gather calls :func:`load_unified_gather`, which compiles the extension with ninja through
DeepSpeed's builder (nvcc flags, ``TORCH_CUDA_ARCH_LIST`` or the local GPU's capability) into torch's
extension cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``); later processes load the
cached build in well under a second. Ahead of time: ``python -m dsx.ops build`` (or :func:`build_ops`) does
the same compile before the job starts, e.g. once per node in a job prologue, so that no rank compiles on
the critical path. ``UnifiedGatherBuilder().builder()`` returns a ``CUDAExtension`` for a setup.py.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from deepspeed.ops.op_builder.builder import CUDAOpBuilder

from dsx.ops.cache import is_cached
from dsx.ops.notice import announce, op_build

__all__ = ["UnifiedGatherBuilder", "build_ops", "csrc_dir", "load_unified_gather"]


def csrc_dir() -> Path:
    """The kernel sources: ``csrc/`` at the repository root (editable install) or inside the package."""
    here = Path(__file__).resolve()
    for cand in (here.parents[1] / "csrc", here.parents[2] / "csrc"):
        if (cand / "unified_gather.cu").is_file():
            return cand
    raise FileNotFoundError(
        f"dsx kernel sources not found next to {here.parents[1]} (expected csrc/unified_gather.cu); "
        "reinstall dsx from a source checkout"
    )


class UnifiedGatherBuilder(CUDAOpBuilder):
    """Builds ``dsx_unified_gather``: sorted, deduplicated zero-copy row gather from pinned host memory."""

    BUILD_VAR = "DSX_BUILD_UNIFIED_GATHER"
    NAME = "dsx_unified_gather"

    def __init__(self) -> None:
        super().__init__(name=self.NAME)

    def absolute_name(self) -> str:
        return f"dsx.ops.{self.NAME}"

    def sources(self) -> list[str]:
        # Absolute paths: DeepSpeed resolves relative ones against its own package directory.
        d = csrc_dir()
        return [str(d / "unified_gather.cu"), str(d / "unified_gather.cpp")]

    def include_paths(self) -> list[str]:
        return [str(csrc_dir())]

    def is_compatible(self, verbose: bool = False) -> bool:
        reasons = []
        if torch.version.cuda is None:
            reasons.append(f"this torch ({torch.__version__}) is built without CUDA")
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        if shutil.which("nvcc") is None and not (home and Path(home, "bin", "nvcc").is_file()):
            reasons.append("nvcc not found (install the CUDA toolkit or set CUDA_HOME)")
        if reasons:
            self.error_log = "; ".join(reasons)
            if verbose:
                self.warning(f"{self.NAME} is not compatible: {self.error_log}")
            return False
        return super().is_compatible(verbose)

    def nvcc_args(self) -> list[str]:
        return [*super().nvcc_args(), "-lineinfo"]


_loaded: Any = None
_failure: BaseException | None = None


def load_unified_gather(verbose: bool = False) -> Any:
    """The compiled extension (JIT-built on first use; a failed build is remembered, not retried per call)."""
    global _loaded, _failure
    if _loaded is not None:
        return _loaded
    if _failure is not None:
        raise RuntimeError(f"dsx unified gather kernel unavailable: {_failure}") from _failure
    try:
        builder = UnifiedGatherBuilder()
        if builder.is_compatible(verbose=False) and not is_cached(builder.NAME):
            announce([op_build(builder.NAME, "dsx unified-tensor gathers")])
        _loaded = builder.load(verbose=verbose)
    except BaseException as exc:
        _failure = exc
        raise RuntimeError(f"dsx unified gather kernel unavailable: {exc}") from exc
    return _loaded


def build_ops(verbose: bool = True) -> list[str]:
    """Compile every dsx op now (ahead of time) into torch's extension cache; return their names."""
    load_unified_gather(verbose=verbose)
    return [UnifiedGatherBuilder.NAME]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] != ["build"]:
        print("usage: python -m dsx.ops build   # compile dsx's CUDA ops into the torch extension cache")
        return 2
    built = build_ops(verbose=True)
    print(f"built: {', '.join(built)}")
    return 0
