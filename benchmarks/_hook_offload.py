"""A saved-tensor-hook activation offload written from the published description of torchtune's
``OffloadActivations`` (and TRL's copy of it): a baseline for ``bench_offload``, not part of dsx.

Inside the context every tensor autograd saves that is on the GPU and at least ``min_bytes`` large (and not a
parameter) is copied to pinned host memory on a side stream as it is saved; the GPU memory is handed back to
the allocator once that copy has run (``record_stream``), with no host synchronisation. In backward each one
is copied back on a second side stream when autograd unpacks it, and the compute stream waits for that copy
only. No prefetch, no plan and no budget: every large tensor moves, the read sits on the backward's critical
path. ``device_only=False`` moves CPU tensors too (into fresh CPU tensors), so that the hooks' bookkeeping
runs in CPU tests.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SavedTensorOffload"]


class SavedTensorOffload(torch.autograd.graph.saved_tensors_hooks):
    """``with SavedTensorOffload(): loss = model(x)``; then ``loss.backward()`` outside or inside it."""

    def __init__(self, min_bytes: int = 1 << 20, device_only: bool = True) -> None:
        self.min_bytes, self.device_only = min_bytes, device_only
        cuda = torch.cuda.is_available()
        self._d2h = torch.cuda.Stream() if cuda else None
        self._h2d = torch.cuda.Stream() if cuda else None
        self.moved_bytes = 0
        self.moved_tensors = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if (
            nbytes < self.min_bytes
            or isinstance(t, torch.nn.Parameter)
            or (self.device_only and not t.is_cuda)
            or t.layout != torch.strided
        ):
            return t
        self.moved_bytes += nbytes
        self.moved_tensors += 1
        if not t.is_cuda:
            return (t.clone(), None, t.device)
        # the tensor's strides where they are dense, else contiguous (an expanded tensor's stride-0 layout
        # cannot be copied into)
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        compute = torch.cuda.current_stream()
        self._d2h.wait_stream(compute)  # the tensor's values are written by work queued before the save
        with torch.cuda.stream(self._d2h):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        t.record_stream(self._d2h)  # the allocator reuses its memory only after the copy
        return (host, done, t.device)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        host, done, device = packed
        if done is None:
            return host
        with torch.cuda.stream(self._h2d):
            self._h2d.wait_event(done)
            out = host.to(device, non_blocking=True)
            back = torch.cuda.Event()
            back.record()
        torch.cuda.current_stream().wait_event(back)
        out.record_stream(torch.cuda.current_stream())
        return out
