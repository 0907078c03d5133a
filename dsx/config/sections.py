"""The sections of the ``"dsx"`` config: one pydantic model each (``extra="forbid"``, bounded fields)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from dsx.config.checks import GIB, MAX_GB, check_creatable, check_dir, check_path_length, physical_memory

__all__ = ["ActivationOffloadConfig", "DsxConfig", "RGNNConfig", "SchedulerConfig", "UnifiedConfig"]


class _Section(BaseModel):
    # strict: "true" is not a bool and 1.5 is not an int; JSON gives exact types, so be exact. Python's json
    # reads Infinity and NaN: no size, time or count may be either.
    model_config = ConfigDict(
        extra="forbid", strict=True, validate_assignment=True, frozen=False, allow_inf_nan=False
    )


class ActivationOffloadConfig(_Section):
    """Activation offload (SSDTrain): saved activations leave the GPU during forward, return before backward."""

    enabled: bool = False
    tiers: list[Literal["host", "ssd"]] = Field(default_factory=lambda: ["host"], min_length=1)
    ssd_path: str | None = None
    host_pool_gb: float = Field(default=4.0, ge=0, le=MAX_GB)
    ssd_capacity_gb: float = Field(default=64.0, ge=0, le=MAX_GB)
    memory_budget_gb: float | None = Field(default=None, ge=0, le=MAX_GB)
    policy: Literal["auto", "offload_all", "recompute_all", "none"] = "auto"
    layer_classes: list[str] | None = Field(default=None, min_length=1)  # null: detect the repeated blocks
    # Megatron's selective recompute, as a per-layer choice: sub-modules (class names, e.g.
    # "DotProductAttention") that policy auto may recompute in backward instead of storing; offload_all
    # always does. They must not draw random numbers from anything but torch's default generators.
    recompute_modules: list[str] = Field(default_factory=list)
    # policy auto: steps run as the profiled one before it (the first step pays for lazy initialisation and
    # allocator growth, which would make forward look slower and writes easier to hide); the last one, from
    # two on, also times the step outside the layers without the profiled step's synchronizations
    profile_warmup_steps: int = Field(default=2, ge=0, le=1000)
    # policy auto: how the warm-up and profiling steps run. "keep" keeps everything (exact, but the
    # micro-batch must fit without dsx); "recompute" recomputes every layer and profiles the recomputation
    # (a micro-batch that fits only with dsx: those steps peak as full recompute does); "recompute+host" as
    # "recompute", with each layer's inputs moved to the host tier (those the pool has no room for to the SSD
    # tier, where tiers lists it), so that those steps peak below full recompute (a sequence full recompute
    # cannot fit; docs/offload.md, "What the profile costs in memory");
    # "auto": "recompute" when memory_budget_gb is set
    profile_mode: Literal["auto", "keep", "recompute", "recompute+host"] = "auto"
    # policies auto and offload_all: hold the host until earlier layers' moved bytes have left the device (auto:
    # where the plan's model has their writes done; offload_all: two layers back, and all of them before
    # backward), so that they are freed before later layers allocate. "auto": on under memory_budget_gb and
    # for offload_all; off for a hide-only plan, where it would trade step time for memory nobody asked for
    # (docs/offload.md, "Write barrier")
    write_barrier: Literal["auto", "on", "off"] = "auto"
    # which CUDA caching-allocator pool read buffers come from. "compute": the compute stream's, allocated where
    # the read is issued and ordered after the work queued there; one pool, so the blocks forward's moves free
    # serve backward's reads (fits tight budgets). "prefetch": the side stream's own pool; the copy starts at
    # once, however far the host runs ahead (fastest without a budget). "auto": "compute" when
    # memory_budget_gb is set, else "prefetch" (docs/offload.md, "Read buffers")
    read_pool: Literal["auto", "compute", "prefetch"] = "auto"
    # CUDA: make the caching allocator's new segments expandable while offload is attached (process-wide;
    # restored at close). Under a tight budget, large blocks and read buffers share fixed segments and
    # fragment them. "auto": "on" when memory_budget_gb is set, unless PYTORCH_CUDA_ALLOC_CONF names
    # expandable_segments; otherwise the allocator is left as it is
    expandable_segments: Literal["auto", "on", "off"] = "auto"
    io_backend: Literal["auto", "kvikio", "aio", "posix"] = "auto"
    min_tensor_bytes: int = Field(default=1 << 20, ge=0, le=1 << 50)
    # policy auto without memory_budget_gb: the host time each moved tensor costs a step (its hooks' copies,
    # events and handles, write and read), which the planner adds to a hide-only plan's step time, so that it
    # moves fewer, larger tensors where that costs less. The default is what the hooks took a tensor on an H100
    # host (docs/performance.md, "Host time of the hooks"); a run's telemetry reports its own as hook_s
    moved_tensor_host_us: float = Field(default=200.0, ge=0, le=1e6)
    # which tiers' read-backs are checked against a checksum taken on the device as the bytes left it: "auto"
    # the SSD tier (a drive or file system can corrupt bytes), true every tier, false none
    verify: bool | Literal["auto"] = "auto"
    prefetch_depth: int | None = Field(default=None, ge=1, le=64)
    # SSD wear: the drive's rated endurance in TB written (its datasheet's TBW); with it, dsx warns once when
    # the rate this node writes activations at would use it up within wear_warn_years. null: no check
    ssd_endurance_tbw: float | None = Field(default=None, gt=0, le=1e9)
    wear_warn_years: float = Field(default=3.0, gt=0, le=100)

    # the settings whose "auto" follows memory_budget_gb: (the value under a budget, the value without one)
    _AUTO_BY_BUDGET: ClassVar[dict[str, tuple[str, str]]] = {
        "profile_mode": ("recompute", "keep"),
        "write_barrier": ("on", "off"),
        "read_pool": ("compute", "prefetch"),
        "expandable_segments": ("on", "off"),
    }

    def resolved(self, key: str) -> str:
        """``key``'s value with ``"auto"`` decided for policy ``auto``: under ``memory_budget_gb`` memory is
        the point (profile under recomputation, hold the write barrier, read into the compute stream's pool,
        expandable allocator segments); without one, step time is (keep, no barrier, the prefetch stream's
        pool, the allocator as it is). (``offload_all`` holds the barrier unless it is ``"off"``.)"""
        value = getattr(self, key)
        if value != "auto":
            return value
        with_budget, without = self._AUTO_BY_BUDGET[key]
        return with_budget if self.memory_budget_gb is not None else without

    def verified_tiers(self) -> frozenset[str]:
        """The tiers ``verify`` checks: ``"auto"``: the SSD tier; ``true``: every tier; ``false``: none."""
        if self.verify == "auto":
            return frozenset({"ssd"})
        return frozenset({"host", "ssd"}) if self.verify else frozenset()

    @field_validator("tiers")
    @classmethod
    def _tiers_unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("names a tier twice: each tier may appear once")
        return v

    @field_validator("host_pool_gb")
    @classmethod
    def _host_pool_fits(cls, v: float, info: ValidationInfo) -> float:
        # the pool is pinned host memory, allocated at start-up: more than the machine has can never work
        ram = physical_memory()
        if info.data.get("enabled", False) and ram and v * GIB > ram:
            raise ValueError(
                f"GB is more than this machine's memory ({ram / GIB:.1f} GiB): the pool is pinned host memory "
                "allocated at start-up; lower host_pool_gb (and share the node's memory among its ranks)"
            )
        return v

    @field_validator("ssd_path")
    @classmethod
    def _ssd_path(cls, v: str | None, info: ValidationInfo) -> str | None:
        # a disabled section is not used: its directory need not exist on this machine
        return check_dir(v, "ssd_path") if info.data.get("enabled", False) else v

    @model_validator(mode="after")
    def _ssd_needs_path(self) -> ActivationOffloadConfig:
        if self.enabled and "ssd" in self.tiers and self.ssd_path is None:
            raise PydanticCustomError(
                "dsx_missing",
                "ssd_path is not set, and tiers contains 'ssd': give ssd_path, a directory on the SSD",
            )
        if self.enabled and self.profile_mode == "recompute+host" and "host" not in self.tiers:
            raise PydanticCustomError(
                "dsx_mismatch",
                "profile_mode 'recompute+host' moves the layers' inputs to the host tier, and tiers {tiers} has "
                "none: add 'host' to tiers, or profile with 'recompute'",
                {"tiers": self.tiers},
            )
        return self


class UnifiedConfig(_Section):
    """Unified tensors (PyTorch-Direct): zero-copy feature gathers from pinned host memory."""

    enabled: bool = False
    shared: Literal["auto", "on", "off"] = "auto"
    # A full wave over every SM oversubscribes the PCIe request queue and gathers slower than a few SMs' worth,
    # which also leaves the rest to training (docs/unified.md, "Bounded SMs"). null = every SM.
    max_gather_sms: int | None = Field(default=16, ge=1, le=1 << 16)
    sort_indices: bool = True
    prefetch_batches: int = Field(default=1, ge=0, le=16)
    shared_memory_dir: str = "/dev/shm"
    backend: Literal["auto", "cuda", "torch"] = "auto"
    # "sync": a GPU gather waits for its out-of-range flag; "deferred": checked at the next gather/check().
    check_indices: Literal["sync", "deferred"] = "sync"
    # Rows start at multiples of this many bytes, the first on a page (a padded copy of the table where they do
    # not), so that each row crosses PCIe in whole 32-byte sectors, or at 128 in whole lines (docs/unified.md,
    # "Padded rows", "Where the table starts"). 0: rows as given, pinned in place.
    row_alignment: int = 0

    @field_validator("row_alignment")
    @classmethod
    def _alignment(cls, v: int) -> int:
        if v != 0 and not (16 <= v <= 4096 and v & (v - 1) == 0):
            raise ValueError(f"row_alignment={v!r}: use 0 (rows as given) or a power of two from 16 to 4096")
        return v

    @field_validator("shared_memory_dir")
    @classmethod
    def _shm(cls, v: str, info: ValidationInfo) -> str:
        if not info.data.get("enabled", False):  # a disabled section is not used here
            return v
        out = check_dir(v, "shared_memory_dir")
        assert out is not None
        return out


class RGNNConfig(_Section):
    """Relational GNN kernels generated from the IR (Hector)."""

    enabled: bool = False
    precision: Literal["fp32", "tf32", "bf16"] = "fp32"
    compact_materialization: bool = True
    linear_reorder: bool = True
    fusion: bool = True
    backend: Literal["auto", "triton", "interpreter"] = "auto"


class SchedulerConfig(_Section):
    """The per-rank runtime: side streams, I/O workers, node bandwidth arbitration, telemetry."""

    enabled: bool = False
    # threads of each I/O pool: activation offload's copies and checks, and the SSD tier's file I/O
    io_workers: int = Field(default=4, ge=1, le=64)
    # steps between writes to DeepSpeed's monitor (means over the interval) and rewrites of the trace file
    log_interval: int = Field(default=10, ge=1, le=1 << 20)
    trace_path: str | None = None  # Chrome trace JSON; ".rank<r>" goes before the extension when ranks > 1
    trace_steps: int = Field(
        default=50, ge=1, le=1 << 16
    )  # the trace file holds (and memory keeps) the last N steps
    # size of the start-up probe of each offload tier's bandwidth (every rank of a node at once)
    bandwidth_probe_mb: int = Field(default=64, ge=1, le=1 << 16)
    # how I/O threads wait on the host for a copy on a side stream (dsx.runtime.events): "spin"
    # (cudaEventSynchronize: a busy core per waiting thread), "poll" (event queries with a short sleep: idle
    # cores, but each query takes the GIL), "auto" (spin)
    event_wait: Literal["auto", "poll", "spin"] = "auto"

    @field_validator("trace_path")
    @classmethod
    def _trace_path(cls, v: str | None, info: ValidationInfo) -> str | None:
        """A trace file name that can be created (its directory, made if missing, below a writable one),
        checked at start-up rather than when the first trace is written (after ``log_interval`` steps)."""
        if v is None:
            return None
        if not v.strip():
            raise ValueError("is empty: give trace_path a file name, or null for no trace")
        path = check_path_length(v, "trace_path")
        if path.is_dir():
            raise ValueError("is a directory: give trace_path a file name in it, e.g. trace.json")
        if info.data.get("enabled", False):  # a disabled scheduler writes no trace
            check_creatable(str(path), "trace_path")
        return str(path)


class DsxConfig(_Section):
    """The whole ``"dsx"`` section of a DeepSpeed config."""

    activation_offload: ActivationOffloadConfig = Field(default_factory=ActivationOffloadConfig)
    unified: UnifiedConfig = Field(default_factory=UnifiedConfig)
    rgnn: RGNNConfig = Field(default_factory=RGNNConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)

    @property
    def any_enabled(self) -> bool:
        return any(getattr(self, name).enabled for name in type(self).model_fields)
