"""dsx.runtime.allocator: the expandable-segments switch, and when activation offload uses it."""

from __future__ import annotations

import pytest
import torch

from dsx.config import ActivationOffloadConfig
from dsx.offload import ActivationOffload
from dsx.runtime import allocator
from dsx.runtime.scheduler import Scheduler
from tests.offload._offload_models import TinyGPT

needs_getter = pytest.mark.skipif(
    not hasattr(torch._C, "_accelerator_getAllocatorSettings"),
    reason="torch does not report allocator settings",
)


@pytest.mark.parametrize(
    "settings, on, expected",
    [
        ("", True, "expandable_segments:True"),
        ("max_split_size_mb:512", True, "max_split_size_mb:512,expandable_segments:True"),
        ("expandable_segments:True, garbage_collection_threshold:0.6", False,
         "garbage_collection_threshold:0.6,expandable_segments:False"),
    ],
)  # fmt: skip
def test_setting_string_keeps_the_other_items(settings, on, expected):
    """PyTorch resets the keys a settings string leaves out, so the switch passes the others along."""
    assert allocator._with_key(settings, on) == expected


@needs_getter
def test_switch_round_trip():
    """Setting the key returns the previous value, and setting that back restores it; the settings string
    PyTorch reports carries the change (the allocator reads it at the next segment)."""
    before = allocator.set_expandable_segments(True)
    try:
        assert allocator.expandable_segments()
        assert "expandable_segments:True" in torch._C._accelerator_getAllocatorSettings()
        assert allocator.set_expandable_segments(False) is True
        assert not allocator.expandable_segments()
    finally:
        allocator.set_expandable_segments(before)
    assert allocator.expandable_segments() == before


@pytest.mark.parametrize(
    "env, configured",
    [
        ("", False),
        ("max_split_size_mb:512", False),
        ("expandable_segments:True", True),
        ("max_split_size_mb:512, expandable_segments:False", True),
    ],
)
def test_user_configured_reads_the_environment(monkeypatch, env, configured):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", env)
    assert allocator.user_configured() is configured
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", env)
    assert allocator.user_configured() is configured


@pytest.mark.parametrize(
    "setting, budget_gb, resolved",
    [("auto", None, "off"), ("auto", 4.0, "on"), ("on", None, "on"), ("off", 4.0, "off")],
)
def test_setting_follows_the_budget(setting, budget_gb, resolved):
    cfg = ActivationOffloadConfig(enabled=True, expandable_segments=setting, memory_budget_gb=budget_gb)
    assert cfg.resolved("expandable_segments") == resolved
    with pytest.raises(ValueError, match="expandable_segments"):
        ActivationOffloadConfig(enabled=True, expandable_segments="true")


@needs_getter
def test_offload_on_cpu_leaves_the_allocator_alone(tmp_path):
    """The switch is for the CUDA allocator: a CPU model under a budget with "on" changes nothing."""
    before = torch._C._accelerator_getAllocatorSettings()
    cfg = ActivationOffloadConfig(enabled=True, tiers=["host"], host_pool_gb=0.1, memory_budget_gb=1.0,
                                  expandable_segments="on", min_tensor_bytes=0)  # fmt: skip
    sched = Scheduler()
    off = ActivationOffload(TinyGPT(), cfg, sched)
    try:
        assert torch._C._accelerator_getAllocatorSettings() == before
    finally:
        off.close()
        sched.close()
    assert torch._C._accelerator_getAllocatorSettings() == before
