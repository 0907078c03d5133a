"""Test support shipped with dsx: fault injection at dsx's own seams (:mod:`dsx.testing.faults`).

Nothing here runs unless asked for: importing it patches nothing, and :func:`install_from_env` does nothing
without the ``DSX_FAULT`` environment variable.
"""

from __future__ import annotations

from dsx.testing.faults import ENV, LOG_ENV, FaultSpec, Injector, install, install_from_env

__all__ = ["ENV", "LOG_ENV", "FaultSpec", "Injector", "install", "install_from_env"]
