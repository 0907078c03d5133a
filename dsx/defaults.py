"""Process defaults: the config section each dsx feature reads, and the scheduler its transfers run on.

This is the one way a feature gets its settings. Inside a DeepSpeed engine built by :func:`dsx.initialize`,
the ``"dsx"`` sections the config enables and the engine's scheduler are installed here for the engine's
lifetime (``engine.dsx.close()`` restores what was before). Without an engine — a relational layer in a plain
training loop, :func:`dsx.unified` in a notebook, a loader in a test — they come from the process defaults,
which :func:`set` changes for the process or, used as a context manager, for a ``with`` block::

    import dsx

    dsx.defaults.get("rgnn").precision            # 'fp32'
    dsx.defaults.set("rgnn", precision="bf16")     # from now on, in this process
    with dsx.defaults.set("unified", max_gather_sms=32):
        ...                                        # only inside the block

Values are validated as the config file's are: an unknown section, key or value raises
:class:`~dsx.config.DsxConfigError` naming ``dsx.<section>.<key>``, the value and what is allowed.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from dsx.config import DsxConfig, DsxConfigError, parse_dsx_config
from dsx.runtime.scheduler import Scheduler

__all__ = ["SECTIONS", "Restore", "get", "install", "reset", "scheduler", "set"]

SECTIONS = tuple(DsxConfig.model_fields)

_lock = threading.RLock()
_config = DsxConfig()
_scheduler: Scheduler | None = None  # the engine's while one is attached, else the process's own
_own_scheduler: Scheduler | None = None


class Restore:
    """Puts back the defaults (and scheduler) that were current when it was made: on ``restore()`` or at the
    end of a ``with`` block. Returned by :func:`set` and :func:`install`."""

    def __init__(self, config: DsxConfig, sched: Scheduler | None) -> None:
        self._config, self._sched, self._done = config, sched, False

    def restore(self) -> None:
        global _config, _scheduler
        with _lock:
            if not self._done:
                _config, _scheduler, self._done = self._config, self._sched, True

    def __enter__(self) -> Restore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def _check_section(name: str) -> None:
    if name not in SECTIONS:
        raise DsxConfigError(f"invalid dsx config:\n  dsx.{name}: unknown section; the sections are: "
                             f"{', '.join(SECTIONS)}")  # fmt: skip


def get(section: str) -> Any:
    """The current default of ``section`` (``"activation_offload"``, ``"unified"``, ``"rgnn"``, ``"scheduler"``):
    a validated config model; treat it as read-only and change it with :func:`set`."""
    _check_section(section)
    with _lock:
        return getattr(_config, section)


def set(
    section: str | Mapping[str, Any], value: BaseModel | Mapping[str, Any] | None = None, **changes: Any
) -> Restore:
    """Change process defaults; returns a :class:`Restore` (a context manager that undoes the change).

    ``set("rgnn", precision="bf16")`` changes keys of one section, ``set("rgnn", RGNNConfig(...))`` or
    ``set("rgnn", {...})`` replaces it, ``set({"rgnn": {...}, "unified": {...}})`` changes keys of several.
    """
    if isinstance(section, Mapping):
        if value is not None or changes:
            raise TypeError("dsx.defaults.set({...}) takes the sections' changes in the mapping only")
        updates = {name: (dict(v), False) for name, v in section.items()}
    else:
        if value is not None and changes:
            raise TypeError("dsx.defaults.set: give a whole section or key=value changes, not both")
        if isinstance(value, BaseModel):
            value = value.model_dump(exclude_unset=True)
        updates = {section: (dict(value), True) if value is not None else (changes, False)}
    global _config
    with _lock:
        raw = _config.model_dump(exclude_unset=True)
        for name, (keys, replace) in updates.items():
            _check_section(name)
            raw[name] = keys if replace else {**raw.get(name, {}), **keys}
        new = parse_dsx_config(raw)
        token = Restore(_config, _scheduler)
        _config = new
        return token


def reset() -> None:
    """Back to the built-in defaults (every section as ``DsxConfig()`` has it) and the process scheduler."""
    global _config, _scheduler
    with _lock:
        _config, _scheduler = DsxConfig(), None


def install(config: DsxConfig, sched: Scheduler) -> Restore:
    """Make ``config``'s enabled sections and ``sched`` the process defaults (what :func:`dsx.initialize`
    does for an engine's lifetime); the returned :class:`Restore` undoes it."""
    global _config, _scheduler
    with _lock:
        token = Restore(_config, _scheduler)
        enabled = {name: getattr(config, name) for name in SECTIONS if getattr(config, name).enabled}
        _config = _config.model_copy(update=enabled)
        _scheduler = sched
        return token


def scheduler() -> Scheduler:
    """The scheduler that dsx's background work runs on: the attached engine's, else one for the process
    (created on first use from the ``"scheduler"`` defaults of that moment)."""
    global _own_scheduler
    with _lock:
        if _scheduler is not None:
            return _scheduler
        if _own_scheduler is None:
            _own_scheduler = Scheduler(_config.scheduler)
        return _own_scheduler
