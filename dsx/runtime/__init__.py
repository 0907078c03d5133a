"""The per-rank runtime: side streams, I/O workers, telemetry, the CUDA allocator switch (docs/scheduler.md)."""

from dsx.runtime.process import PeerLostError
from dsx.runtime.scheduler import Scheduler
from dsx.runtime.telemetry import StepTelemetry

__all__ = ["PeerLostError", "Scheduler", "StepTelemetry"]
