"""DeepSpeed glue of the relational layers: what :func:`dsx.initialize` calls when ``"rgnn"`` is enabled.

The layers hold no engine state: :func:`dsx.initialize` installs the config's ``"rgnn"`` section as the
process default for the engine's lifetime, and every layer option left as ``None`` reads it at call time
(:mod:`dsx.rgnn.options`). Attaching therefore only reports what is live; closing the engine restores the
defaults.
"""

from __future__ import annotations

import logging
from typing import Any

from dsx.config import RGNNConfig

__all__ = ["RGNNFeature", "attach"]

logger = logging.getLogger("dsx")


class RGNNFeature:
    """The ``"rgnn"`` feature of one engine (``engine.dsx.features["rgnn"]``); ``section`` is its config."""

    def __init__(self, section: RGNNConfig) -> None:
        self.section = section

    def close(self) -> None:
        """Nothing to undo here: the engine restores the process defaults it installed."""


def attach(engine: Any, runtime: Any) -> RGNNFeature:
    """Report the ``"rgnn"`` section that the engine's relational layers follow; returns the feature."""
    section = runtime.config.rgnn
    logger.info(
        "dsx.rgnn: layers default to precision=%s backend=%s compact_materialization=%s linear_reorder=%s "
        "fusion=%s", section.precision, section.backend, section.compact_materialization,
        section.linear_reorder, section.fusion,
    )  # fmt: skip
    return RGNNFeature(section)
