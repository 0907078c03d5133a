"""The scheduler's per-step figures in DeepSpeed's monitor (TensorBoard, CSV, W&B, Comet).

Every ``log_interval`` steps the mean per step over the interval is written as ``dsx/compute_s``,
``dsx/transfer_s``, ``dsx/stall_s``, ``dsx/hook_s`` (seconds; the last is activation offload's host time in
its hooks, 0 without offload) and ``dsx/bytes_<tier>`` (bytes), at
``engine.global_samples`` like DeepSpeed's own ``Train/Samples/*`` events.
"""

from __future__ import annotations

from typing import Any

from dsx.runtime.telemetry import StepRecord

__all__ = ["MonitorSink", "interval_means"]

PREFIX = "dsx/"


def interval_means(records: list[StepRecord], tiers: set[str]) -> dict[str, float]:
    """Mean of each scalar over ``records``; a tier in ``tiers`` that moved nothing counts as 0 bytes."""
    n = len(records)
    keys = ["compute_s", "transfer_s", "stall_s", "hook_s", *(f"bytes_{t}" for t in sorted(tiers))]
    sums = dict.fromkeys(keys, 0.0)
    for r in records:
        for k, v in r.as_scalars().items():
            sums[k] += v
    return {k: v / n for k, v in sums.items()}


class MonitorSink:
    """A step sink that writes interval means to ``engine.monitor``; attach it on global rank 0 only.

    Parameters
    ----------
    engine
        The DeepSpeed engine (its ``monitor`` and ``global_samples``).
    interval
        ``scheduler.log_interval``.
    """

    def __init__(self, engine: Any, interval: int) -> None:
        self.engine, self.interval = engine, interval
        self._records: list[StepRecord] = []
        # once a tier has moved bytes its series goes on (with zeros), so every series has the same rows
        self._tiers: set[str] = set()

    def on_step(self, record: StepRecord) -> None:
        self._records.append(record)
        self._tiers.update(record.bytes_by_tier)
        if len(self._records) < self.interval:
            return
        means = interval_means(self._records, self._tiers)
        self._records.clear()
        step = self.engine.global_samples
        self.engine.monitor.write_events([(PREFIX + k, v, step) for k, v in means.items()])

    def close(self) -> None:
        """Nothing to flush: a partial interval is not written (its mean would not be comparable)."""
