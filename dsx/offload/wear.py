"""SSD wear: how long the drive's rated endurance lasts at the rate a run writes activations.

Activation offload to SSD writes every moved byte once a step, which adds up: gigabytes a step per rank for a
large model (docs/offload.md). A drive's datasheet rates its endurance in TB written (TBW);
at a node's write rate ``r`` bytes/s it lasts ``TBW·10¹² / r`` seconds. dsx warns once when that is under
``wear_warn_years``. The node's rate is this rank's rate times the ranks of the node: every rank of a node
runs the same config, so with the same ``ssd_path`` they write to the same drive at about the same rate.
"""

from __future__ import annotations

import logging
import os
import time

__all__ = ["WearWatch", "years_of_endurance"]

logger = logging.getLogger("dsx.offload")

SECONDS_PER_YEAR = 365.25 * 24 * 3600


def years_of_endurance(endurance_tbw: float, node_bytes_per_s: float) -> float:
    """Years until ``endurance_tbw`` TB have been written at ``node_bytes_per_s`` (inf at no writes)."""
    if node_bytes_per_s <= 0:
        return float("inf")
    return endurance_tbw * 1e12 / node_bytes_per_s / SECONDS_PER_YEAR


class WearWatch:
    """Checked at each optimizer-step end with the bytes this rank has written to its SSD file so far.

    The rate is measured from the first step end with bytes written to the latest, over at least
    ``min_steps`` steps (the first steps profile and plan; their writes are not the run's rate).

    Parameters
    ----------
    path
        The drive's directory (``ssd_path``), named in the warning.
    endurance_tbw
        The drive's rated endurance, TB written (``ssd_endurance_tbw``).
    horizon_years
        Warn when the endurance lasts fewer years than this (``wear_warn_years``).
    ranks_on_drive
        Ranks writing to this drive at this rank's rate (default: ``LOCAL_WORLD_SIZE``, else 1).
    """

    def __init__(
        self,
        path: str,
        endurance_tbw: float,
        horizon_years: float,
        ranks_on_drive: int | None = None,
        min_steps: int = 10,
    ) -> None:
        self.path, self.endurance_tbw, self.horizon_years = path, endurance_tbw, horizon_years
        self.ranks = ranks_on_drive or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        self.min_steps = min_steps
        self._first: tuple[float, int] | None = None  # (time, bytes) at the first step end with writes
        self._steps = 0
        self.warned = False
        self.years: float | None = None  # the latest estimate

    def step(self, bytes_written: int, now: float | None = None) -> float | None:
        """Record a step end; the years of endurance left at the measured rate, once there is one."""
        now = time.monotonic() if now is None else now
        if self._first is None:
            if bytes_written > 0:
                self._first = (now, bytes_written)
            return None
        self._steps += 1
        t0, b0 = self._first
        if self._steps < self.min_steps or now <= t0:
            return None
        rate = (bytes_written - b0) / (now - t0) * self.ranks
        self.years = years_of_endurance(self.endurance_tbw, rate)
        if self.years < self.horizon_years and not self.warned:
            self.warned = True
            logger.warning(
                "dsx activation offload: SSD wear: this node writes activations to %s at %.2f GB/s (%d rank(s) "
                "at this rank's rate), %.0f TB a day; a drive rated for %g TBW lasts %.2f years at that rate, "
                "under wear_warn_years=%g. Keep more on the host tier (host_pool_gb, tiers) or set a "
                "memory_budget_gb that moves less.",
                self.path,
                rate / 1e9,
                self.ranks,
                rate * 86400 / 1e12,
                self.endurance_tbw,
                self.years,
                self.horizon_years,
            )
        return self.years
