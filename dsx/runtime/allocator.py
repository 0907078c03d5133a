"""The CUDA caching allocator's expandable segments, switched while the process runs.

Under a tight activation budget, blocks of very different sizes share the allocator's fixed-size segments
(large fp32 softmax blocks beside read buffers of a few GiB). Once smaller blocks sit in a freed large segment,
the next large request finds no segment that holds it and fails with tens of GiB reserved but unallocated, in
some runs of a plan and not others (docs/offload.md, "Budget calibration and the allocator"). Expandable
segments map physical memory in 2 MiB pages on demand, so pages freed anywhere serve any request.

The setting is process-wide. PyTorch reads it at segment creation, so segments cached before the switch are
released (``empty_cache``) and later ones follow it. ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``)
that names ``expandable_segments`` is the user's choice, and ``"auto"`` callers leave it alone
(:func:`user_configured`).
"""

from __future__ import annotations

import os

import torch

__all__ = ["expandable_segments", "set_expandable_segments", "user_configured"]

_ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_KEY = "expandable_segments"


def _parse(settings: str) -> bool | None:
    """``expandable_segments``'s value in an allocator settings string; None where it is not named."""
    for item in settings.split(","):
        key, _, value = item.partition(":")
        if key.strip() == _KEY:
            return value.strip().lower() == "true"
    return None


def user_configured() -> bool:
    """Whether the environment names ``expandable_segments`` (either value): then it is the user's choice."""
    return any(_parse(os.environ.get(v, "")) is not None for v in _ENV_VARS)


def _with_key(settings: str, on: bool) -> str:
    """``settings`` with ``expandable_segments`` set to ``on`` and every other item as it was."""
    items = [i.strip() for i in settings.split(",") if i.strip() and i.partition(":")[0].strip() != _KEY]
    return ",".join([*items, f"{_KEY}:{'True' if on else 'False'}"])


def _state() -> tuple[str, bool]:
    """The settings string in force and whether new segments are expandable, from one query.

    PyTorch's settings getter where it has one; older torch (2.11) has none, and its allocator reports the
    settings in a snapshot instead (the string there is the one the process started with).
    """
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if get is not None:
        settings = str(get())
        return settings, bool(_parse(settings))
    env = ",".join(filter(None, (os.environ.get(v, "") for v in _ENV_VARS)))
    snap = torch.cuda.memory._snapshot().get("allocator_settings", {}) if torch.cuda.is_available() else {}
    settings = str(snap.get("PYTORCH_CUDA_ALLOC_CONF", env))
    return settings, bool(snap[_KEY]) if _KEY in snap else bool(_parse(settings))


def expandable_segments() -> bool:
    """Whether new CUDA allocator segments are expandable (the setting; False unless set)."""
    return _state()[1]


def set_expandable_segments(on: bool) -> bool:
    """Make new segments expandable (or not) and release the cached ones; returns the previous setting.

    The other settings in force are passed along unchanged (PyTorch resets the keys a settings string does
    not name). Without CUDA this records the setting and releases nothing.
    """
    settings, before = _state()
    value = _with_key(settings, on)
    set_ = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if set_ is not None:
        set_(value)
    else:  # older torch: the CUDA-only entry point
        torch.cuda.memory._set_allocator_settings(value)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # free cached segments of the other kind, which the allocator would otherwise fill first
        torch.cuda.empty_cache()
    return before
