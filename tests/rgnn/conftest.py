"""Every rgnn test starts from the built-in ``"rgnn"`` defaults and leaves the process defaults as it found
them, whatever an engine or another test left installed."""

from __future__ import annotations

import pytest

from dsx import defaults
from dsx.config import RGNNConfig


@pytest.fixture(autouse=True)
def _builtin_rgnn_defaults():
    with defaults.set("rgnn", RGNNConfig()):
        yield
