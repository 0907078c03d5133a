"""Fault injection at dsx's own seams: failing, short, slow and corrupting SSD I/O, a full shared-memory
directory, and a node leader killed in the middle of the shared-segment setup.

Inert unless the environment variable ``DSX_FAULT`` is set; :func:`install_from_env` reads it (the fault
harness, ``python -m tests.faults``, runs it in every launched rank through a ``sitecustomize.py`` it puts
on ``PYTHONPATH``; the deepspeed launcher passes the environment on). The format is comma-separated
``key=value`` pairs::

    DSX_FAULT=kind=io_error,op=read,nth=3,rank=1,seed=7

``kind``
    ``io_error``: the ``nth`` SSD-tier ``op`` (``read`` or ``write``; both counted together when omitted)
    raises ``OSError(EIO)``. ``short_read``: the first system call of the ``nth`` SSD-tier read asks for
    only ``keep`` bytes (rounded down to 4 KiB and less than asked; 0 reads as an end of file), so the
    backend's loop sees a short count. ``enospc``: the ``nth`` SSD-tier write raises ``OSError(ENOSPC)``.
    ``slow_io``: every SSD-tier read and write (or only ``op``) first sleeps up to ``ms`` milliseconds.
    ``corrupt``: right after the ``nth`` SSD-tier write lands, ``nbytes`` bytes of that region of the file
    are flipped through a second descriptor, as a failing drive or file system would. ``shm_enospc``: the
    ``nth`` reservation (``posix_fallocate``) of a shared-memory segment raises ENOSPC. ``sigkill_setup``:
    the node leader SIGKILLs itself the ``nth`` time it reaches point ``at`` of
    :func:`dsx.direct.shm.share_tensor` (``created``, ``filled``, ``published``, ``before_unlink``; drawn
    from ``seed`` when omitted). ``none``: nothing injected, the operations only counted (a clean run's
    counts, from which a harness draws ``nth``).
``rank``
    Only the process whose ``RANK`` is this injects (every rank when omitted); counts are per process.
``seed``
    Seeds this process's draws (sleep times, flipped positions, the kill point).

With ``DSX_FAULT_LOG`` naming a directory, each process appends what it injected, and at exit its counts,
to ``fault-<pid>.jsonl`` there: JSON lines written at once, so that a killed process's record survives.

The seams patched, when their modules are imported (nothing is imported here ahead of the program):
:class:`dsx.offload.io.PosixBackend` (``_pwrite``, ``_pread`` and its ``_preadv`` system call) and
:mod:`dsx.direct.shm` (``_fallocate``, ``_setup_point``). Never DeepSpeed's or torch's code.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import importlib.abc
import importlib.machinery
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = [
    "ENV",
    "KINDS",
    "LOG_ENV",
    "SETUP_POINTS",
    "FaultSpec",
    "Injector",
    "install",
    "install_from_env",
]

ENV = "DSX_FAULT"
LOG_ENV = "DSX_FAULT_LOG"
KINDS = ("none", "io_error", "short_read", "enospc", "slow_io", "corrupt", "shm_enospc", "sigkill_setup")
SETUP_POINTS = ("created", "filled", "published", "before_unlink")
_ALIGN = 4096  # dsx's SSD transfers are 4 KiB-aligned (dsx.offload.align); a short count keeps that
_IO_MODULE, _SHM_MODULE = "dsx.offload.io", "dsx.direct.shm"
_TAG = "injected by dsx.testing.faults"


@dataclass(frozen=True)
class FaultSpec:
    """One ``DSX_FAULT`` value (see the module's documentation for what each field means)."""

    kind: str
    op: str | None = None
    nth: int = 1
    rank: int | None = None
    seed: int = 0
    ms: float = 5.0
    keep: int = _ALIGN
    nbytes: int = 16
    at: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{ENV}: kind={self.kind!r}; allowed: {', '.join(KINDS)}")
        if self.op not in (None, "read", "write"):
            raise ValueError(f"{ENV}: op={self.op!r}; allowed: read, write")
        if self.nth < 1 or self.nbytes < 1 or self.keep < 0 or self.ms < 0:
            raise ValueError(f"{ENV}: nth and nbytes must be >= 1, keep and ms >= 0: {self}")
        if self.at is not None and self.at not in SETUP_POINTS:
            raise ValueError(f"{ENV}: at={self.at!r}; allowed: {', '.join(SETUP_POINTS)}")

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """``kind=...,key=value,...`` -> FaultSpec; a ValueError names what is wrong."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in fields:
                raise ValueError(f"{ENV}: {part!r} is not one of {', '.join(f'{k}=...' for k in fields)}")
            kind = {"nth": int, "rank": int, "seed": int, "keep": int, "nbytes": int, "ms": float}.get(
                key, str
            )
            try:
                values[key] = kind(value.strip())
            except ValueError:
                raise ValueError(f"{ENV}: {key}={value!r} is not a {kind.__name__}") from None
        if "kind" not in values:
            raise ValueError(f"{ENV}: no kind= in {text!r}")
        return cls(**values)

    def __str__(self) -> str:
        """The ``DSX_FAULT`` form: kind first, then the fields that differ from their defaults."""
        parts = [f"kind={self.kind}"]
        for f in dataclasses.fields(self)[1:]:
            value = getattr(self, f.name)
            if value != f.default:
                parts.append(f"{f.name}={value}")
        return ",".join(parts)


class Injector:
    """The installed fault of one process: its counters, its draws, its log, and the patches it applies."""

    def __init__(self, spec: FaultSpec, log_dir: str | None = None) -> None:
        self.spec = spec
        self.counts: dict[str, int] = {}
        self.injected = 0
        self._lock = threading.Lock()
        self._rng = random.Random(f"{spec.seed}/{os.environ.get('RANK', '')}")
        self._short = threading.local()  # set by the nth read, taken by its first system call
        self._log_path = os.path.join(log_dir, f"fault-{os.getpid()}.jsonl") if log_dir else None
        self.patched: list[str] = []

    # ---------------------------------------------------------------------------------- bookkeeping
    @staticmethod
    def rank() -> int | None:
        """This process's global rank (read at each use: a launcher-less run sets it after start-up)."""
        value = os.environ.get("RANK")
        return int(value) if value and value.isdigit() else None

    def _active(self) -> bool:
        return self.spec.rank is None or self.spec.rank == self.rank()

    def _count(self, op: str) -> int:
        """Count one ``op`` and return its number. An ``io_error`` without ``op`` counts reads and writes
        together (its ``nth`` is the nth SSD operation of either kind)."""
        with self._lock:
            self.counts[op] = self.counts.get(op, 0) + 1
            if op not in ("read", "write"):
                return self.counts[op]
            self.counts["io"] = self.counts.get("io", 0) + 1
            joint = self.spec.kind == "io_error" and self.spec.op is None
            return self.counts["io"] if joint else self.counts[op]

    def _hit(self, kind: str, op: str, n: int) -> bool:
        return self.spec.kind == kind and self.spec.op in (None, op) and n == self.spec.nth and self._active()

    def log(self, event: str, **fields: Any) -> None:
        """Append one JSON line (event, rank, pid, time and ``fields``) to this process's log, at once."""
        if self._log_path is None:
            return
        record = {"event": event, "spec": str(self.spec), "rank": self.rank(), "pid": os.getpid(),
                  "time": time.time(), **fields}  # fmt: skip
        line = json.dumps(record) + "\n"
        fd = os.open(self._log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def _injected(self, what: str, **fields: Any) -> None:
        with self._lock:
            self.injected += 1
        self.log("injected", what=what, **fields)

    def _at_exit(self) -> None:
        self.log("exit", counts=dict(self.counts), injected=self.injected)

    # ----------------------------------------------------------------------------- the SSD backend
    def patch_io(self, module: ModuleType) -> None:
        """Wrap :class:`PosixBackend`'s reads and writes (its I/O threads call them) and its read system call."""
        cls = module.PosixBackend
        pwrite, pread, preadv = cls._pwrite, cls._pread, cls._preadv
        inj, spec = self, self.spec

        def start(op: str, backend: Any, offset: int) -> int:
            """Count the call, sleep if slowed, fail it if its turn: the part reads and writes share."""
            n = inj._count(op)
            inj._delay(op)
            if inj._hit("io_error", op, n):
                inj._injected("io_error", op=op, nth=n, path=backend.path, offset=offset)
                raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} ({_TAG})")
            return n

        def _pwrite(backend: Any, buf: Any, offset: int) -> int:
            n = start("write", backend, offset)
            if inj._hit("enospc", "write", n):
                inj._injected("enospc", op="write", nth=n, path=backend.path, offset=offset)
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({_TAG})")
            done = pwrite(backend, buf, offset)
            if inj._hit("corrupt", "write", n):
                inj._corrupt(backend.path, offset, buf.numel(), n)
            return done

        def _pread(backend: Any, buf: Any, offset: int) -> int:
            n = start("read", backend, offset)
            if inj._hit("short_read", "read", n):
                inj._short.pending = (n, backend.path, offset)
            try:
                return pread(backend, buf, offset)
            finally:
                inj._short.pending = None

        def _preadv(fd: int, buffers: Sequence[Any], offset: int) -> int:
            pending = getattr(inj._short, "pending", None)
            if pending is None:
                return preadv(fd, buffers, offset)
            inj._short.pending = None
            view = memoryview(buffers[0])
            # fewer bytes than asked, a multiple of 4 KiB (an O_DIRECT descriptor refuses any other length)
            keep = min(spec.keep // _ALIGN * _ALIGN, max(len(view) - _ALIGN, 0))
            got = preadv(fd, [view[:keep]], offset)
            n, path, at = pending
            inj._injected("short_read", op="read", nth=n, path=path, offset=at, asked=len(view), returned=got)
            return got

        cls._pwrite, cls._pread, cls._preadv = _pwrite, _pread, staticmethod(_preadv)
        self.patched.append(module.__name__)

    def _delay(self, op: str) -> None:
        if self.spec.kind == "slow_io" and self.spec.op in (None, op) and self._active():
            with self._lock:
                pause = self._rng.uniform(0.0, self.spec.ms) / 1e3
                first = "slow" not in self.counts
                self.counts["slow"] = self.counts.get("slow", 0) + 1
            if first:  # one record (the counts at exit say how many): the log stays small
                self._injected("slow_io", op=op, pause_ms=round(pause * 1e3, 3))
            time.sleep(pause)

    def _corrupt(self, path: str, offset: int, size: int, n: int) -> None:
        """Flip ``nbytes`` bytes of the region just written, from a 4-byte-aligned start below ``size`` - 4 KiB:
        inside the tensor's own bytes whatever its padding (``size`` is its length rounded up to 4 KiB)."""
        with self._lock:
            start = self._rng.randrange(0, max(size - _ALIGN, 1)) // 4 * 4
        count = min(self.spec.nbytes, size - start)
        fd = os.open(path, os.O_RDWR)  # buffered: an O_DIRECT read of the range writes dirty pages back first
        try:
            old = os.pread(fd, count, offset + start)
            os.pwrite(fd, bytes(b ^ 0xFF for b in old), offset + start)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        self._injected("corrupt", op="write", nth=n, path=path, offset=offset + start, nbytes=count,
                       region_offset=offset, region_size=size)  # fmt: skip

    # ------------------------------------------------------------------------------- shared memory
    def patch_shm(self, module: ModuleType) -> None:
        """Wrap the segment's reservation call and the leader's setup hook in :mod:`dsx.direct.shm`."""
        fallocate = module._fallocate
        inj, spec = self, self.spec

        def _fallocate(fd: int, offset: int, length: int) -> None:
            n = inj._count("fallocate")
            if inj._hit("shm_enospc", "write", n):
                inj._injected("shm_enospc", nth=n, length=length)
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({_TAG})")
            fallocate(fd, offset, length)

        module._fallocate = _fallocate
        if spec.kind == "sigkill_setup":
            at = spec.at or random.Random(spec.seed).choice(SETUP_POINTS)

            def _setup_point(point: str) -> None:
                n = inj._count(f"setup:{point}")
                if point == at and n == spec.nth and inj._active():
                    inj._injected("sigkill_setup", point=point, nth=n)
                    os.kill(os.getpid(), signal.SIGKILL)

            module._setup_point = _setup_point
        self.patched.append(module.__name__)


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then the patch, so that the module is patched before anyone uses it."""

    def __init__(self, inner: Any, patch: Callable[[ModuleType], None]) -> None:
        self._inner, self._patch = inner, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self._inner, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches named modules when they are first imported: nothing (not torch, not dsx) is imported early."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self.patches = patches

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = self.patches.pop(fullname, None)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def install(spec: FaultSpec, log_dir: str | None = None) -> Injector:
    """Install ``spec`` in this process: patch the seams now if their modules are loaded, else when they are."""
    inj = Injector(spec, log_dir)
    patches = {_IO_MODULE: inj.patch_io, _SHM_MODULE: inj.patch_shm}
    later = {}
    for name, patch in patches.items():
        if name in sys.modules:
            patch(sys.modules[name])
        else:
            later[name] = patch
    if later:
        sys.meta_path.insert(0, _AfterImport(later))
    atexit.register(lambda: inj._at_exit() if inj.patched else None)  # (launcher processes patch nothing)
    return inj


def install_from_env(environ: Mapping[str, str] | None = None) -> Injector | None:
    """Install the fault ``DSX_FAULT`` describes (logging to ``DSX_FAULT_LOG``); None when it is unset."""
    environ = os.environ if environ is None else environ
    text = environ.get(ENV, "").strip()
    if not text:
        return None
    return install(FaultSpec.parse(text), environ.get(LOG_ENV) or None)
