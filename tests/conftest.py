"""Markers: ``gpu`` / ``multigpu`` tests skip with a reason where the hardware is missing."""

from __future__ import annotations

import os

import pytest
import torch


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n = _gpus()
    for item in items:
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(
                pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs, found {n} (run on the GPU machine)")
            )
        elif "gpu" in item.keywords and n < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)"))


@pytest.fixture(autouse=True)
def _quiet_deepspeed() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
