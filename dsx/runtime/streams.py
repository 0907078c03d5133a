"""The current CUDA stream and a switch to a side stream, cheap enough to run once per saved tensor.

``torch.cuda.current_stream(device)`` builds a new ``Stream`` object on every call, and the
``torch.cuda.stream`` context asks for the current device and the current stream again (their host time:
docs/performance.md, "Host time of the hooks"). Activation offload's hooks switch
to a side stream for each moved tensor's copy, on the thread that queues the GPU's work, where that time can
leave the GPU waiting. :func:`current_stream` keeps the last ``Stream`` object per device and hands it out
again while the raw stream it wraps is still current (one lookup of the raw handle); :class:`on_stream` is
``torch.cuda.stream`` built on it, for a stream of the current device (any other falls back to
``torch.cuda.stream``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["current_stream", "on_stream"]

# device index -> (raw cudaStream_t, the Stream object for it): which stream is current is per thread, so the
# raw handle is compared on every call; an entry only saves building the object again
_last: dict[int, tuple[int, torch.cuda.Stream]] = {}


def current_stream(device: torch.device | int | None = None) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)``, without a new object while the current stream stays the same."""
    if isinstance(device, torch.device):
        device = device.index
    idx = torch.cuda.current_device() if device is None else device
    raw = torch._C._cuda_getCurrentRawStream(idx)
    hit = _last.get(idx)
    if hit is None or hit[0] != raw:
        hit = (raw, torch.cuda.current_stream(idx))
        _last[idx] = hit
    return hit[1]


class on_stream:  # named like the torch.cuda.stream context it stands in for
    """``with on_stream(s):`` queues the block's work on ``s`` and makes the previous stream current again
    after it, like ``with torch.cuda.stream(s):``."""

    __slots__ = ("_fallback", "_prev", "stream")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self._prev: torch.cuda.Stream | None = None
        self._fallback: Any = None

    def __enter__(self) -> torch.cuda.Stream:
        if self.stream.device_index != torch.cuda.current_device():
            # (setting another device's stream also makes that device current: torch's context restores both)
            self._fallback = torch.cuda.stream(self.stream)
            self._fallback.__enter__()
            return self.stream
        self._prev = current_stream(self.stream.device_index)
        torch.cuda.set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc: object) -> None:
        if self._fallback is not None:
            fallback, self._fallback = self._fallback, None
            fallback.__exit__(*exc)
            return
        torch.cuda.set_stream(self._prev)
        self._prev = None
