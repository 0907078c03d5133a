"""Markers: ``gpu`` / ``multigpu`` / ``async_io`` tests skip with a reason where the hardware or system part
is missing."""

from __future__ import annotations

import os

import pytest
import torch


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n = _gpus()
    if any(item.get_closest_marker("async_io") for item in items):
        from tests.harness import async_io_available

        aio_ok, aio_why = async_io_available()
        for item in items:
            if item.get_closest_marker("async_io") and not aio_ok:
                item.add_marker(pytest.mark.skip(reason=aio_why))
    for item in items:
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(
                pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs, found {n} (run on the GPU machine)")
            )
        elif "gpu" in item.keywords and n < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)"))


@pytest.fixture(scope="session", autouse=True)
def _single_rank_process() -> None:
    """In-process engines run as rank 0 of 1 (DeepSpeed would otherwise try MPI discovery).

    Launched ranks never inherit these: tests/harness.py removes them from the children's environment.
    """
    from tests.harness import free_port

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
