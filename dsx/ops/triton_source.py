"""Write Triton kernel source (generated, or a fixed kernel kept as text) to a cache file, import it, and keep the
module per key in memory.

Triton compiles a ``@triton.jit`` function from its source file (``inspect.getsource``), so generated code must
live in a real file. The file name is a hash of the source, the Triton version and the mode, so a changed
emitter or Triton upgrade never reuses a stale file.

Interpreter mode: Triton 3.x decides at *decoration* time whether ``@triton.jit`` builds a compiled or an
interpreted function (``triton.knobs.runtime.interpret`` reads ``TRITON_INTERPRET``). The loader sets the
variable while it imports an interpreted module and restores it afterwards, so compiled and interpreted
copies of the same kernel can coexist in one process, whatever the environment said when Triton was first
imported. Generated code avoids the Triton standard-library helpers that are themselves ``@jit`` functions
(``tl.sum``, ``tl.max``, ``tl.zeros``, ``tl.cdiv``): those were decorated when Triton was imported and cannot
be called from an interpreted kernel if the interpreter was off then.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

__all__ = ["cache_dir", "load_source"]

_MODULES: dict[str, ModuleType] = {}
_LOCK = threading.Lock()


def cache_dir() -> Path:
    """``$DSX_KERNEL_CACHE``, else ``~/.cache/dsx/kernels``, else a per-process temporary directory."""
    env = os.environ.get("DSX_KERNEL_CACHE")
    candidates = [Path(env)] if env else []
    candidates.append(Path.home() / ".cache" / "dsx" / "kernels")
    for path in candidates:
        try:
            path.mkdir(parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    return Path(tempfile.mkdtemp(prefix="dsx-kernels-"))


def _triton_version() -> str:
    import triton

    return triton.__version__


def load_source(name: str, source: str, *, interpret: bool) -> ModuleType:
    """Import ``source`` as a module (compiled or interpreted kernels) and return it, cached by content."""
    mode = "interp" if interpret else "jit"
    digest = hashlib.sha256(f"{_triton_version()}\n{mode}\n{source}".encode()).hexdigest()[:20]
    key = f"{name}_{mode}_{digest}"
    with _LOCK:
        mod = _MODULES.get(key)
        if mod is not None:
            return mod
        path = cache_dir() / f"{key}.py"
        if not path.exists() or path.read_text() != source:
            # Write to a private name then rename: concurrent processes never see a half-written file.
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(source)
            os.replace(tmp, path)
        modname = f"dsx_generated_{key}"
        spec = importlib.util.spec_from_file_location(modname, path)
        mod = importlib.util.module_from_spec(spec)
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
        try:
            sys.modules[modname] = mod
            spec.loader.exec_module(mod)
        except BaseException:
            sys.modules.pop(modname, None)
            raise
        finally:
            if old is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old
        _MODULES[key] = mod
        return mod
