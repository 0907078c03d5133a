"""The per-rank runtime: side streams, I/O workers, telemetry (see docs/architecture.md)."""

from dsx.runtime.scheduler import Scheduler
from dsx.runtime.telemetry import StepTelemetry

__all__ = ["Scheduler", "StepTelemetry"]
