"""I/O backends for the SSD tier: one small interface, three implementations.

Every backend reads and writes a contiguous, 4 KiB-aligned host buffer at a 4 KiB-aligned file offset and
returns a :class:`concurrent.futures.Future` that resolves to the byte count. ``kvikio`` (CuFile: GPUDirect
Storage, or its POSIX compat mode) > ``aio`` (DeepSpeed's libaio handle) > ``posix`` (``os.pwrite`` /
``os.pread`` on threads, always available); their rates on a real drive are in docs/performance.md.

The calls run on the scheduler's ``"ssd"`` thread pool (:meth:`~dsx.runtime.scheduler.Scheduler.executor`),
which every backend of the rank shares: a backend keeps track of its own calls in flight, and ``close()``
waits for them without stopping the pool.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from concurrent.futures import Future
from typing import Any

import torch

from dsx import defaults
from dsx.offload.align import ALIGN, aligned_empty
from dsx.ops.aio import async_io_status
from dsx.runtime.scheduler import FutureSet, Scheduler

__all__ = [
    "AioBackend",
    "IOBackend",
    "KvikioBackend",
    "PosixBackend",
    "auto_choice",
    "describe_backends",
    "kvikio_mode",
    "kvikio_threads",
    "select_backend",
]


def _check(buf: torch.Tensor, offset: int) -> None:
    if buf.dtype != torch.uint8 or not buf.is_contiguous() or buf.device.type != "cpu":
        raise ValueError("dsx I/O buffers must be contiguous uint8 host tensors")
    if offset % ALIGN or buf.numel() % ALIGN:
        raise ValueError(
            f"dsx I/O needs 4 KiB-aligned offset and size, got offset={offset} size={buf.numel()}"
        )


class IOBackend:
    """Reads and writes aligned host buffers against one file. Subclasses implement ``_pwrite``/``_pread``.

    The calls run on ``scheduler``'s ``"ssd"`` pool (by default :func:`dsx.defaults.scheduler`'s)."""

    name = "base"

    def __init__(self, path: str, fd: int, scheduler: Scheduler | None = None) -> None:
        self.path, self.fd = path, fd
        self._pool = (scheduler or defaults.scheduler()).executor("ssd")
        self._lock = threading.Lock()
        self._pending = FutureSet()  # this backend's calls not yet done (the pool is shared)
        self._closed = False

    def pwrite(self, buf: torch.Tensor, offset: int) -> Future[int]:
        _check(buf, offset)
        return self._submit("write", self._pwrite, buf, offset)

    def pread(self, buf: torch.Tensor, offset: int) -> Future[int]:
        _check(buf, offset)
        return self._submit("read", self._pread, buf, offset)

    def _submit(self, what: str, fn: Any, buf: torch.Tensor, offset: int) -> Future[int]:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"dsx {self.name} I/O backend of {self.path} is closed")
            return self._pending.add(self._pool.submit(self._run, what, fn, buf, offset))

    def _run(self, what: str, fn: Any, buf: torch.Tensor, offset: int) -> int:
        try:
            n = fn(buf, offset)
        except OSError as exc:
            # Name the file, offset and size so that the user can find the failing device.
            raise OSError(
                exc.errno,
                f"dsx {self.name} {what} failed: {os.strerror(exc.errno or 0)} "
                f"(path={self.path}, offset={offset}, size={buf.numel()})",
            ) from exc
        if n != buf.numel():
            raise OSError(
                errno.EIO,
                f"dsx {self.name} short {what}: {n} of {buf.numel()} bytes "
                f"(path={self.path}, offset={offset})",
            )
        return n

    def close(self) -> None:
        """Refuse new calls and wait for this backend's calls in flight (the shared pool keeps running)."""
        with self._lock:
            self._closed = True
        self._pending.wait()


class PosixBackend(IOBackend):
    """``os.pwrite``/``os.pread`` on the pool's threads (the GIL is released during the system call)."""

    name = "posix"
    # The read system call, as an attribute: dsx.testing.faults replaces it to hand this loop short counts.
    _preadv = staticmethod(os.preadv)

    def _pwrite(self, buf: torch.Tensor, offset: int) -> int:
        mv, done = memoryview(buf.numpy()), 0
        while done < len(mv):
            done += os.pwrite(self.fd, mv[done:], offset + done)
        return done

    def _pread(self, buf: torch.Tensor, offset: int) -> int:
        mv, done = memoryview(buf.numpy()), 0
        while done < len(mv):
            n = self._preadv(self.fd, [mv[done:]], offset + done)
            if n == 0:
                raise OSError(errno.EIO, "unexpected end of file")
            done += n
        return done


class AioBackend(IOBackend):
    """DeepSpeed's ``aio_handle`` (libaio); one handle per thread because a handle's ``wait`` is global."""

    name = "aio"

    def __init__(self, path: str, fd: int, scheduler: Scheduler | None = None) -> None:
        super().__init__(path, fd, scheduler)
        from deepspeed.ops.op_builder import AsyncIOBuilder

        self._op = AsyncIOBuilder().load(verbose=False)
        self._local = threading.local()
        self._first_write_alone()

    def _first_write_alone(self) -> None:
        """One 4 KiB write to a scratch file from this thread, before any I/O thread writes.

        DeepSpeed 0.19's ``sync_pwrite`` logs its SSD-endurance warning inside a ``std::call_once`` while
        holding the GIL; a second thread entering ``sync_pwrite`` during that first call waits on the once
        flag with the GIL held, and the first can never log: both hang (seen in CI with two I/O threads).
        Once the flag is set, the warning is skipped and the threads never meet there.
        """
        block = aligned_empty(ALIGN).zero_()  # O_DIRECT: buffer, offset and length 4 KiB-aligned
        scratch = f"{self.path}.aio-warmup"
        try:
            self._handle().sync_pwrite(block, scratch, 0)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(scratch)

    def _handle(self) -> Any:
        h = getattr(self._local, "h", None)
        if h is None:
            # block 1 MiB, queue depth 32, single_submit off, overlap_events on, 1 intra-op thread
            h = self._local.h = self._op.aio_handle(1 << 20, 32, False, True, 1)
        return h

    def _pwrite(self, buf: torch.Tensor, offset: int) -> int:
        h = self._handle()
        rc = h.sync_pwrite(buf, self.path, offset)  # this thread is the asynchrony; the call is synchronous
        if rc < 0:
            raise OSError(errno.EIO, "aio write failed")
        return buf.numel()

    def _pread(self, buf: torch.Tensor, offset: int) -> int:
        size = os.fstat(self.fd).st_size  # DeepSpeed asserts (the process aborts) on a read past the end
        if offset + buf.numel() > size:
            raise OSError(errno.EIO, f"unexpected end of file ({size} bytes)")
        h = self._handle()
        rc = h.sync_pread(buf, self.path, offset)
        if rc < 0:
            raise OSError(errno.EIO, "aio read failed")
        return buf.numel()


class KvikioBackend(IOBackend):
    """kvikio ``CuFile``: GDS when the driver supports it, else its POSIX compat mode.

    ``raw_*_async`` blocks the calling thread in compat mode, so this uses ``pread``/``pwrite`` futures
    and waits on them from our I/O threads. kvikio serves them on its own process-wide pool, of
    ``KVIKIO_NTHREADS`` threads (one by default), which dsx leaves as it is: whether more threads pay depends on
    the drive (``benchmarks/bench_ssd_threads.py`` measures it; docs/performance.md has its figures).
    """

    name = "kvikio"

    def __init__(self, path: str, fd: int, scheduler: Scheduler | None = None) -> None:
        super().__init__(path, fd, scheduler)
        import kvikio

        self._f = kvikio.CuFile(path, "r+")

    def _pwrite(self, buf: torch.Tensor, offset: int) -> int:
        return int(self._f.pwrite(buf.numpy(), buf.numel(), offset).get())

    def _pread(self, buf: torch.Tensor, offset: int) -> int:
        return int(self._f.pread(buf.numpy(), buf.numel(), offset).get())

    def close(self) -> None:
        super().close()
        self._f.close()


def kvikio_mode() -> str:
    """kvikio's ``compat_mode`` setting and what it resolves to here, e.g. ``"compat_mode=AUTO -> POSIX compat
    mode"`` (kvikio must import). kvikio >= 25.04 reads the setting (ON / OFF / AUTO) through ``defaults.get``
    and says what AUTO chose through ``is_compat_mode_preferred()``; before, ``defaults.compat_mode()`` gave
    the setting alone (a bool, later the enum)."""
    import kvikio.defaults as d

    if not hasattr(d, "is_compat_mode_preferred"):
        setting = d.compat_mode()
        return f"compat_mode={getattr(setting, 'name', setting)}"
    live = "POSIX compat mode" if d.is_compat_mode_preferred() else "GPUDirect Storage"
    return f"compat_mode={d.get('compat_mode').name} -> {live}"


def kvikio_threads() -> int:
    """The number of threads of kvikio's process-wide pool (kvikio must import)."""
    import kvikio.defaults

    return int(kvikio.defaults.get("num_threads"))


_BACKENDS = {"posix": PosixBackend, "aio": AioBackend, "kvikio": KvikioBackend}


def describe_backends() -> dict[str, dict[str, Any]]:
    """``{name: {"available": bool, "reason": str}}`` for ``dsx report``; checks only, never builds an op."""
    out: dict[str, dict[str, Any]] = {"posix": {"available": True, "reason": "os.pwrite/os.pread threads"}}
    try:
        import kvikio
        import kvikio.defaults  # a submodule: not loaded by ``import kvikio`` in 26.x

        ok = torch.cuda.is_available()
        # what kvikio says of itself; a kvikio that cannot say is still usable
        try:
            mode = f", {kvikio_mode()}"
        except Exception as exc:
            mode = f", compat mode unknown ({type(exc).__name__})"
        try:
            threads = f", a pool of {kvikio_threads()} thread(s) (KVIKIO_NTHREADS)"
        except Exception:  # (a kvikio without defaults.get)
            threads = ""
        out["kvikio"] = {
            "available": ok,
            "reason": f"kvikio {kvikio.__version__}{mode}{threads}"
            if ok
            else "kvikio imports but CUDA is unavailable",
        }
    except Exception as exc:
        out["kvikio"] = {"available": False, "reason": f"import kvikio failed: {exc}"}
    ok, reason = async_io_status()
    out["aio"] = {"available": ok, "reason": reason}
    return out


def auto_choice(backends: dict[str, dict[str, Any]] | None = None) -> str:
    """The backend ``io_backend: auto`` tries first, from :func:`describe_backends` (no file is opened)."""
    backends = backends or describe_backends()
    order = (["kvikio"] if torch.cuda.is_available() else []) + ["aio", "posix"]
    return next(n for n in order if backends.get(n, {}).get("available"))


def select_backend(name: str, path: str, fd: int, scheduler: Scheduler | None = None) -> IOBackend:
    """Open ``name`` (or the best available for ``"auto"``) on an open file; explicit names fail loudly. Its
    calls run on ``scheduler``'s ``"ssd"`` pool (by default :func:`dsx.defaults.scheduler`'s)."""
    if name != "auto":
        try:
            return _BACKENDS[name](path, fd, scheduler)
        except Exception as exc:
            reason = describe_backends().get(name, {}).get("reason", "")
            hint = {"kvikio": "pip install dsx[gds] (kvikio for your CUDA), ", "aio": "install libaio-dev, "}
            raise RuntimeError(
                f"dsx activation offload: io_backend={name!r} is not available here ({type(exc).__name__}: "
                f"{exc}; {reason}): {hint.get(name, '')}or set io_backend to 'auto' (the best available) or "
                "'posix'"
            ) from exc
    # aio only where dsx's probe says the op loads or builds: DeepSpeed would otherwise try to compile it and
    # fail at link time, minutes into the start, before falling back
    order = (
        (["kvikio"] if torch.cuda.is_available() else [])
        + (["aio"] if async_io_status()[0] else [])
        + ["posix"]
    )
    for cand in order:
        try:
            return _BACKENDS[cand](path, fd, scheduler)
        except Exception:
            continue
    raise AssertionError("unreachable: posix backend always opens")
