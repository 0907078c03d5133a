"""Process defaults: the config section each dsx feature reads, and the scheduler its transfers run on.

This is the one way a feature gets its settings. Inside a DeepSpeed engine built by :func:`dsx.initialize`,
the ``"dsx"`` sections the config enables and the engine's scheduler are installed here for the engine's
lifetime (``engine.dsx.close()`` removes them again; engines may close in any order). Without an engine — a relational layer in a plain
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
_base = DsxConfig()  # the process's own defaults: what set() changes
_engines: list[_Layer] = []  # engines' installs, oldest first: the newest that has a section wins
_own_scheduler: Scheduler | None = None


class _Layer:
    """What one engine installed: its sections (the enabled ones, and its scheduler's) and its scheduler."""

    def __init__(self, sections: dict[str, Any], sched: Scheduler) -> None:
        self.sections, self.sched = sections, sched


class Restore:
    """Undoes one :func:`set` or :func:`install`: on ``restore()`` or at the end of a ``with`` block.

    A :func:`set` token puts back the keys it changed that still hold what it set; an :func:`install` token
    removes that engine's layer, wherever it is among the engines installed since. Either may be undone in
    any order. Restoring twice does nothing."""

    def __init__(self, undo: Any) -> None:
        self._undo, self._done = undo, False

    def restore(self) -> None:
        with _lock:
            if not self._done:
                self._done = True
                self._undo()

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
        for layer in reversed(_engines):
            if section in layer.sections:
                return layer.sections[section]
        return getattr(_base, section)


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
    global _base
    with _lock:
        raw = _base.model_dump(exclude_unset=True)
        for name, (keys, replace) in updates.items():
            _check_section(name)
            raw[name] = keys if replace else {**raw.get(name, {}), **keys}
        new = parse_dsx_config(raw)
        # per key, (value before, value set): undo puts back only the keys still holding what this call
        # set, so that calls undone in any order leave what later calls set alone
        changed = {
            name: {
                k: (getattr(getattr(_base, name), k), getattr(getattr(new, name), k))
                for k in type(getattr(new, name)).model_fields
                if getattr(getattr(_base, name), k) != getattr(getattr(new, name), k)
            }
            for name in updates
        }
        _base = new

        def undo() -> None:
            global _base
            for name, keys in changed.items():
                section = getattr(_base, name)
                back = {k: old for k, (old, set_) in keys.items() if getattr(section, k) == set_}
                _base = _base.model_copy(update={name: section.model_copy(update=back)})

        return Restore(undo)


def reset() -> None:
    """Back to the built-in defaults (every section as ``DsxConfig()`` has it), no engine installed, and the
    process scheduler."""
    global _base
    with _lock:
        _base = DsxConfig()
        _engines.clear()


def install(config: DsxConfig, sched: Scheduler) -> Restore:
    """Make ``config``'s enabled sections, its scheduler section (which ``sched`` runs with, enabled or not) and
    ``sched`` the defaults while the engine lives (what :func:`dsx.initialize` does); later installs take
    precedence. The returned :class:`Restore` removes this install, whatever was installed since."""
    sections = {name: getattr(config, name) for name in SECTIONS if getattr(config, name).enabled}
    sections["scheduler"] = sched.config
    layer = _Layer(sections, sched)
    with _lock:
        _engines.append(layer)

    def undo() -> None:
        if layer in _engines:
            _engines.remove(layer)

    return Restore(undo)


def scheduler() -> Scheduler:
    """The scheduler that dsx's background work runs on: the attached engine's, else one for the process
    (created on first use from the ``"scheduler"`` defaults of that moment)."""
    global _own_scheduler
    with _lock:
        if _engines:
            return _engines[-1].sched
        if _own_scheduler is None or _own_scheduler.closed:
            _own_scheduler = Scheduler(_base.scheduler)
        return _own_scheduler
