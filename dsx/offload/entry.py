"""What the mover keeps of one moved storage, and the error a corrupt read-back raises."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Entry", "OffloadIntegrityError"]


class OffloadIntegrityError(RuntimeError):
    """Data read back from a tier differ from what was written (``verify``: on for the SSD tier by default)."""


@dataclass(eq=False)
class Entry:
    """One moved storage."""

    layer: int
    nbytes: int
    tier: str  # where it will live once written: "host" or "ssd"
    name: str
    refs: int = 0
    # the device bytes, alive until the device→host copy is seen to end (by an I/O thread, or poll_writes())
    src: torch.Tensor | None = None
    host: tuple[int, torch.Tensor] | None = None  # (arena offset, aligned slot)
    ssd_off: int | None = None
    # the checksum of the device bytes as written (a host tensor, valid once the copy out has run): set when
    # the entry's tier is verified (config ``verify``); its read-back is checked against it
    checksum: torch.Tensor | None = None
    written: Future[Any] | None = None  # an I/O thread's write (None for an inline one)
    fetched: Future[Any] | None = None
    consumed: bool = False  # a consumer waited for the read (its stream is ordered after the copy)
    released: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    # set once the device bytes are given back (the copy to the host was seen to end, or an I/O thread's
    # failed); an SSD entry is set before its file write, which needs only the host slot
    off_device: threading.Event = field(default_factory=threading.Event)
    copied: Any = None  # CUDA: the event after the device-to-host copy on the offload stream
    # written without an I/O thread (CUDA, host tier): poll_writes() also finishes the write
    inline: bool = False
    # released after a read was issued (CUDA): the slots go back once that read's copy has run (poll_writes)
    frees_after_read: bool = False
