"""Pin host memory in place with ``cudaHostRegister`` (no copy), once per address range.

``Tensor.pin_memory()`` copies into a new pinned buffer (twice the memory for a large feature table);
registration pins the pages where they are. It is slow (the kernel walks every page), so it is done once
per range and reference counted: registering a range twice is not an error here, and only the owner of the
registration unregisters. A range registered by somebody else ("already registered", error 712) is
used as it is and never unregistered by dsx.
"""

from __future__ import annotations

import ctypes
import logging
import resource
import threading
from typing import Any

import torch

__all__ = [
    "PinningError",
    "is_registered",
    "memlock_message",
    "register",
    "unregister",
    "unregister_at_finalization",
]

logger = logging.getLogger("dsx")

_PORTABLE, _MAPPED = 1, 2  # cudaHostRegisterPortable | cudaHostRegisterMapped: every device may read it
_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
_NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered
_OUT_OF_MEMORY = 2  # cudaErrorMemoryAllocation

_lock = threading.Lock()
_ranges: dict[int, list[int]] = {}  # ptr -> [nbytes, refcount, owned]


class PinningError(RuntimeError):
    """``cudaHostRegister`` refused the range (locked-memory limit, or memory it cannot pin)."""


def _fmt_limit(v: int) -> str:
    return "unlimited" if v == resource.RLIM_INFINITY else f"{v} bytes ({v / (1 << 20):.1f} MiB)"


def memlock_message(nbytes: int, cuda_error: str, limits: tuple[int, int] | None = None) -> str:
    """Error text for a refused registration, with the process's real RLIMIT_MEMLOCK values."""
    soft, hard = limits if limits is not None else resource.getrlimit(resource.RLIMIT_MEMLOCK)
    lines = [
        f"cudaHostRegister could not pin {nbytes} bytes ({nbytes / (1 << 30):.2f} GiB) in place: {cuda_error}.",
        f"The locked-memory limit (RLIMIT_MEMLOCK, `ulimit -l`) of this process is soft {_fmt_limit(soft)}, "
        f"hard {_fmt_limit(hard)}.",
    ]
    if soft != resource.RLIM_INFINITY and nbytes > soft:
        # NVIDIA's driver pins past the limit; a kernel or driver that applies it refuses this size
        lines.append("The tensor is larger than the limit, which some drivers apply to pinning.")
    lines.append(
        "Fix: raise the limit before starting the job (`ulimit -l unlimited`; docker run --ulimit memlock=-1; "
        "in /etc/security/limits.conf `* - memlock unlimited`; SLURM --propagate=MEMLOCK), or free host memory."
    )
    return " ".join(lines)


class _Cudart:
    """libcudart through ctypes (the library torch already loaded), falling back to torch's bindings."""

    def __init__(self) -> None:
        torch.cuda.init()
        self.lib = None
        try:
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if "libcudart" in line and "/" in line}
            for path in sorted(paths):
                self.lib = ctypes.CDLL(path)
                break
        except OSError:
            self.lib = None
        if self.lib is not None:
            self.lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            self.lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
            self.lib.cudaGetErrorString.restype = ctypes.c_char_p
            self.lib.cudaHostGetDevicePointer.argtypes = [
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.c_void_p,
                ctypes.c_uint,
            ]

    def register(self, ptr: int, nbytes: int, flags: int) -> int:
        if self.lib is not None:
            return int(self.lib.cudaHostRegister(ptr, nbytes, flags))
        return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, flags))

    def unregister(self, ptr: int) -> int:
        if self.lib is not None:
            return int(self.lib.cudaHostUnregister(ptr))
        return int(torch.cuda.cudart().cudaHostUnregister(ptr))

    def covers(self, ptr: int, nbytes: int) -> bool:
        """Whether CUDA maps the first and the last byte of the range (None-able without ctypes: assume so)."""
        if self.lib is None:
            return True
        out = ctypes.c_void_p()
        ok = all(
            self.lib.cudaHostGetDevicePointer(ctypes.byref(out), p, 0) == 0 for p in (ptr, ptr + nbytes - 1)
        )
        if not ok:
            self.clear_error()
        return ok

    def clear_error(self) -> None:
        # A failed runtime call also sets the thread's "last error"; clear it, or torch's next kernel-launch
        # check would report our handled error as its own.
        if self.lib is not None:
            self.lib.cudaGetLastError()

    def error_string(self, code: int) -> str:
        if self.lib is not None:
            return f"{self.lib.cudaGetErrorString(code).decode()} (cudaError {code})"
        return f"cudaError {code}"


_rt: _Cudart | None = None


def _runtime() -> _Cudart:
    global _rt
    if _rt is None:
        _rt = _Cudart()
    return _rt


def register(ptr: int, nbytes: int) -> None:
    """Pin ``[ptr, ptr + nbytes)`` portable and mapped (every device may read it); reference counted."""
    with _lock:
        if ptr in _ranges:
            _ranges[ptr][1] += 1
            return
        rt = _runtime()
        err = rt.register(ptr, nbytes, _PORTABLE | _MAPPED)
        owned = 1
        if err == _ALREADY_REGISTERED:
            rt.clear_error()
            owned = 0  # pinned by someone else (e.g. pin_memory()): usable, but not ours to unpin
            if not rt.covers(ptr, nbytes):
                # CUDA pins whole pages: a small tensor sharing a page with memory registered elsewhere
                # overlaps it without being covered by it; a kernel reading it would fault.
                raise PinningError(
                    f"cannot pin {nbytes} bytes at {ptr:#x}: the range overlaps host memory registered "
                    "elsewhere (CUDA pins whole 4 KiB pages) but is not covered by it. Give dsx.unified a "
                    "tensor with its own pages (e.g. one allocated on its own; large tensors always are), or "
                    "close the other registration first."
                )
        elif err != 0:
            rt.clear_error()
            msg = rt.error_string(err)
            if err == _OUT_OF_MEMORY or "memory" in msg.lower():
                raise PinningError(memlock_message(nbytes, msg))
            hint = ""
            if "invalid argument" in msg.lower():
                # CUDA refuses pages of a file on a disk or overlay filesystem (not a tmpfs) with this error.
                hint = (
                    ". If this memory maps a file (a shared segment), the file must live on a tmpfs such as "
                    "/dev/shm: CUDA cannot pin pages of a disk-backed file (set dsx.unified.shared_memory_dir)"
                )
            raise PinningError(f"cudaHostRegister failed for {nbytes} bytes at {ptr:#x}: {msg}{hint}")
        _ranges[ptr] = [nbytes, 1, owned]


def unregister(ptr: int) -> None:
    """Drop one reference; unpin when the last owner lets go (exactly once per registration)."""
    with _lock:
        entry = _ranges.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _ranges[ptr]
        if entry[2]:
            rt = _runtime()
            err = rt.unregister(ptr)
            if err not in (0, _NOT_REGISTERED):
                rt.clear_error()
                raise PinningError(f"cudaHostUnregister failed at {ptr:#x}: {rt.error_string(err)}")
            if err:
                rt.clear_error()


def is_registered(ptr: int) -> bool:
    with _lock:
        return ptr in _ranges


def unregister_at_finalization(ptr: int | None, keep: Any) -> None:
    """:func:`unregister` as a ``weakref.finalize`` callback of the object that registered ``ptr`` (close,
    garbage collection, interpreter exit; the callback must not reference that object). ``keep`` (the tensor
    over the pages) is held until the pages are unregistered, so that they are never unmapped while
    registered. It raises nothing: at exit the CUDA runtime may already be unloading."""
    if ptr is not None:
        try:
            unregister(ptr)
        except Exception as exc:
            logger.debug("dsx: unregistering pinned host memory at finalization failed: %s", exc)
    del keep
