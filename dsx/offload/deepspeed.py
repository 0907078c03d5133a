"""Activation offload inside a DeepSpeed engine: what :func:`dsx.initialize` attaches.

The engine wraps ``engine.step`` once for every feature (:mod:`dsx.engine`); this feature enters its
:meth:`_Feature.around_step` around each step and calls :meth:`_Feature.after_step` after each optimizer step.
When the SSD tier shares a drive with ZeRO's ``nvme_path``, DeepSpeed swaps optimizer state on that drive in
``engine.step()``: activation writes wait for it then (the scheduler's ``"ssd"`` gate).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from dsx.config import ActivationOffloadConfig, DsxConfigError
from dsx.offload import checkpointing
from dsx.offload.controller import ActivationOffload
from dsx.offload.io import describe_backends

__all__ = ["attach", "check_model"]

logger = logging.getLogger("dsx.offload")


def check_model(model: torch.nn.Module, section: ActivationOffloadConfig) -> None:
    """What would fail once DeepSpeed has started, checked before it does (``dsx.initialize`` calls this): the
    layers and sub-modules the section names, and an ``io_backend`` named explicitly that this machine lacks."""
    checkpointing.check_model(model, section)
    backend = section.io_backend
    if "ssd" in section.tiers and section.policy != "none" and backend != "auto":
        info = describe_backends().get(backend, {"available": True})
        if not info["available"]:
            raise DsxConfigError(
                f'invalid dsx config:\n  dsx.activation_offload.io_backend: "{backend}" is not available here '
                f'({info["reason"]}); use "auto" (the best available) or "posix"'
            )


def _st_dev(path: str) -> int:
    """st_dev of ``path`` or of its nearest existing parent (DeepSpeed creates nvme_path lazily)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return os.stat(path).st_dev


def _nvme_path(engine: Any) -> str | None:
    """ZeRO's NVMe offload directory (optimizer state, else parameters), or None."""
    cfg = getattr(engine, "_config", None)
    zc = getattr(cfg, "zero_config", None)
    for key in ("offload_optimizer", "offload_param"):
        sub = getattr(zc, key, None)
        path = getattr(sub, "nvme_path", None) if sub is not None else None
        if path:
            return str(path)
    return None


class _Feature:
    """What :func:`attach` returns: the engine's handle on one :class:`ActivationOffload`. It wraps
    ``engine.backward`` so that an out-of-memory error raised in a layer's backward during policy auto's
    profiling steps says what to do, as one raised in a layer's forward or recomputation does
    (:meth:`ActivationOffload.profile_oom_note`); ``close()`` takes the wrapper off."""

    def __init__(self, offload: ActivationOffload, engine: Any) -> None:
        self.offload, self._engine, self._inner = offload, engine, engine.backward
        self._own = "backward" not in vars(engine)  # the class's method, not an instance's wrapper

        def backward(*args: Any, **kwargs: Any) -> Any:
            try:
                return self._inner(*args, **kwargs)
            except torch.OutOfMemoryError as exc:
                checkpointing.add_note_once(exc, offload.profile_oom_note())
                raise

        engine.backward = self._wrapper = backward

    @contextlib.contextmanager
    def around_step(self) -> Iterator[None]:
        """Around ``engine.step()``: DeepSpeed swaps optimizer state on a shared drive there, so activation
        writes wait."""
        if self.offload.shared_ssd:
            with self.offload.sched.paused("ssd"):
                yield
        else:
            yield

    def after_step(self) -> None:
        self.offload.after_step()

    def close(self) -> None:
        if vars(self._engine).get("backward") is self._wrapper:  # (one installed over it since stays)
            if self._own:
                del self._engine.backward
            else:
                self._engine.backward = self._inner
        self.offload.close()


def attach(engine: Any, runtime: Any) -> _Feature:
    """Install activation offload on ``engine.module`` (the ``runtime``'s ``activation_offload`` section, its
    scheduler); the handle's ``close()`` removes hooks and files."""
    section = runtime.config.activation_offload
    offload = ActivationOffload(engine.module, section, runtime.scheduler, device=torch.device(engine.device))
    try:
        nvme = _nvme_path(engine)
        if nvme and offload.ssd is not None and _st_dev(nvme) == _st_dev(section.ssd_path):
            offload.shared_ssd = True
            logger.info(
                "dsx activation offload: %s shares a device with ZeRO's nvme_path %s: activation writes pause "
                "during engine.step()",
                section.ssd_path,
                nvme,
            )
    except BaseException:
        offload.close()
        raise
    return _Feature(offload, engine)
