"""DeepSpeed glue of the ``"dsx"."unified"`` section: what :func:`dsx.initialize` does when it is enabled.

The section itself reaches :func:`dsx.direct.unified`, :class:`~dsx.direct.UnifiedTensor` and the loaders
through the process defaults the engine installs (:mod:`dsx.defaults`); here the gather op is built at
start-up, so that a missing compiler or a CUDA mismatch fails before training rather than at the first
batch, and the section is logged.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from dsx.config import UnifiedConfig
from dsx.direct.unified import load_gather_op

__all__ = ["UnifiedFeature", "attach"]

logger = logging.getLogger("dsx")


class UnifiedFeature:
    """The handle :func:`attach` returns (``engine.dsx.features["unified"]``).

    It holds nothing to release: unified tensors and loaders are closed by their owners, and the engine
    restores the process defaults it installed."""

    def __init__(self, section: UnifiedConfig) -> None:
        self.section = section

    def close(self) -> None:
        pass


def attach(engine: Any, runtime: Any) -> UnifiedFeature:
    """Feature hook for ``dsx.initialize``: ``runtime`` is the engine's :class:`~dsx.engine.DsxRuntime`."""
    section: UnifiedConfig = runtime.config.unified
    if section.backend == "cuda" and torch.cuda.is_available():
        load_gather_op()  # raises with the build log if the kernel cannot be built
    logger.info("dsx unified: %s", section.model_dump())
    return UnifiedFeature(section)
