"""Torch's JIT extension cache: where DeepSpeed's and dsx's ops land once built, and whether one is there for
this torch (so that loading it compiles nothing)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

__all__ = ["build_lock", "extensions_root", "is_built", "is_cached", "is_prebuilt"]


def extensions_root() -> Path:
    """Torch's JIT extension cache: ``TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions/py<v>_<cu|cpu>``.

    The same rule as ``torch.utils.cpp_extension._get_build_directory``, without creating anything.
    """
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accel = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accel = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accel = "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{py}_{accel}"


def is_prebuilt(name: str) -> bool:
    """Whether DeepSpeed was installed with this op compiled in (``DS_BUILD_*=1``): then nothing is built."""
    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        return False
    return bool(installed_ops.get(name, False))


def _built_for_this_torch(build_dir: Path) -> bool:
    """Whether the cached build was made against this torch installation.

    torch's JIT load re-runs ninja, which recompiles everything when the compile flags changed: a cache
    filled by another environment (another venv's torch include paths) is rebuilt, not loaded.
    """
    try:
        ninja = (build_dir / "build.ninja").read_text()
    except OSError:
        return True  # built without torch's JIT (no build file): nothing tells it apart, trust the .so
    import torch

    return os.path.join(os.path.dirname(torch.__file__), "include") in ninja


def is_cached(name: str) -> bool:
    """Whether the op ``name`` is prebuilt into DeepSpeed, or built for this torch in torch's cache. A cached
    DeepSpeed op loads only past its compatibility probe as well: :func:`is_built` says whether it loads."""
    if is_prebuilt(name):
        return True
    build_dir = extensions_root() / name
    return (build_dir / f"{name}.so").is_file() and _built_for_this_torch(build_dir)


def is_built(name: str, compatible: bool) -> bool:
    """Whether the DeepSpeed op ``name`` loads without compiling, given what its builder's ``is_compatible``
    said: prebuilt into DeepSpeed always; a build in the cache only past that probe, which DeepSpeed runs before
    it looks in the cache (a cached async_io whose libaio-dev was removed does not load)."""
    return is_prebuilt(name) or (compatible and is_cached(name))


def build_lock(name: str) -> tuple[Path, float] | None:
    """torch's build lock of the op ``name`` and its age in seconds, or None where there is none.

    torch's JIT load creates ``<cache>/<name>/lock`` while one process builds the op, and every other process
    that loads it polls until the file is gone. A build that died (a killed rank, a closed terminal) leaves the
    file, and every later load of the op waits on it forever: nothing in the file tells a live build from a dead
    one, so only its age and the user can.
    """
    path = extensions_root() / name / "lock"
    try:
        return path, max(0.0, time.time() - path.stat().st_mtime)
    except OSError:
        return None
