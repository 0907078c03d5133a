"""Which backend runs dsx's Triton kernels (relational GNN layers, the sampler's draws): compiled Triton, the
Triton interpreter, or the PyTorch reference."""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["BACKENDS", "resolve_backend", "triton_available"]

BACKENDS = ("triton", "interpret", "reference")


@functools.cache
def triton_available() -> bool:
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:  # an ImportError, or a broken install raising anything else at import
        return False
    return True


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """Pick the backend for tensors on ``device``.

    ``None`` means automatic: ``"triton"`` for CUDA tensors when Triton imports, ``"interpret"`` when the
    environment sets ``TRITON_INTERPRET=1`` (CPU tensors), else ``"reference"``.
    """
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
        if backend == "triton" and device.type != "cuda":
            raise ValueError(
                f"backend='triton' needs CUDA tensors, got device {device}; use backend='interpret' "
                "(Triton interpreter on CPU) or 'reference'"
            )
        if backend in ("triton", "interpret") and not triton_available():
            raise RuntimeError(
                f"backend={backend!r} needs Triton, which does not import here; use 'reference'"
            )
        if backend == "interpret" and device.type != "cpu":
            raise ValueError(f"backend='interpret' runs on CPU tensors, got device {device}")
        return backend
    if device.type == "cuda" and triton_available():
        return "triton"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1" and triton_available():
        return "interpret"
    return "reference"
