"""Whether DeepSpeed's ``async_io`` op (libaio) can be used here, and if not, why in words a user can act on.

DeepSpeed's own ``AsyncIOBuilder.is_compatible`` passes where the libaio runtime library is installed but not
its development files, and the build then fails at link time (``cannot find -laio``) deep inside a job's
start. The op is usable when it is prebuilt into DeepSpeed, or when the linker resolves ``-laio`` and
DeepSpeed's own probe agrees. A build in torch's extension cache does not count alone: DeepSpeed's JIT load
runs that probe before it looks in the cache, so a cached op whose libaio-dev was removed does not load.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

from dsx.ops.cache import is_cached, is_prebuilt

__all__ = ["async_io_status"]

AIO_MISSING = "libaio-dev is not installed (apt-get install libaio-dev)"


def _linker_finds(lib: str) -> bool:
    """Whether the C compiler resolves ``-l<lib>``: the unversioned ``lib<lib>.so`` of the -dev package (the
    runtime library alone, ``libaio.so.1``, loads but cannot be linked against)."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return False
    try:
        out = subprocess.run(
            [cc, f"-print-file-name=lib{lib}.so"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return False
    return os.path.isabs(out) and os.path.exists(out)  # not found: the compiler echoes the bare name


@functools.cache
def async_io_status() -> tuple[bool, str]:
    """(usable, reason): the reason says how it is available, or what to install."""
    if is_prebuilt("async_io"):
        return True, "DeepSpeed aio_handle (libaio; built into DeepSpeed)"
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError as exc:
        return False, f"DeepSpeed's async_io op builder is not importable: {exc}"
    # a cached build needs the probe to pass as much as a new one does (the module docstring says why)
    cached = is_cached("async_io")
    also = (
        " (the build in torch's extension cache loads only with it: DeepSpeed checks first)" if cached else ""
    )
    if not _linker_finds("aio"):
        return False, AIO_MISSING + also
    try:
        ok = bool(AsyncIOBuilder().is_compatible(verbose=False))
    except Exception as exc:  # the probe itself failed: not usable, and say so
        return False, f"DeepSpeed's async_io compatibility probe failed: {exc}"
    if not ok:
        return False, f"DeepSpeed's AsyncIOBuilder reports it incompatible here ({AIO_MISSING}?){also}"
    return (
        True,
        "DeepSpeed aio_handle (libaio; built)"
        if cached  # (not prebuilt, and past the probe: cache.is_built's rule)
        else "DeepSpeed aio_handle (libaio; JIT-built on first use)",
    )
