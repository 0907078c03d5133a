"""Pydantic models of the ``"dsx"`` section of a DeepSpeed JSON config.

Every section is off unless it says ``"enabled": true``; a config without a ``"dsx"`` section behaves exactly
as DeepSpeed. Unknown keys, wrong types and out-of-range values fail at start-up with a
:class:`DsxConfigError` that names the key path (``dsx.activation_offload.tiers[1]``), the value given and
what is allowed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

__all__ = [
    "ActivationOffloadConfig",
    "DsxConfig",
    "DsxConfigError",
    "RGNNConfig",
    "SchedulerConfig",
    "UnifiedConfig",
    "load_deepspeed_config",
    "parse_dsx_config",
    "split_config",
]

DSX_KEY = "dsx"


class DsxConfigError(ValueError):
    """A bad key or value in the ``"dsx"`` section (or a config that cannot be read at all)."""


class _Section(BaseModel):
    # strict: "true" is not a bool and 1.5 is not an int; JSON gives exact types, so be exact. Python's json
    # reads Infinity and NaN: no size, time or count may be either.
    model_config = ConfigDict(
        extra="forbid", strict=True, validate_assignment=True, frozen=False, allow_inf_nan=False
    )


GIB = 1 << 30
# Upper bound of every size in GB: more than any machine holds, and small enough that the byte counts derived
# from it stay exact integers far from any C integer's overflow.
MAX_GB = float(1 << 20)
# Room dsx's own names take below a directory it is given (run directory, rank file, owner record).
_NAME_ROOM = 96


def _limits(path: Path) -> tuple[int, int]:
    """(longest path, longest name) the filesystem holding ``path`` (or its nearest parent) allows."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return os.pathconf(probe, "PC_PATH_MAX"), os.pathconf(probe, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 4096, 255


def _check_path_length(value: str, key: str) -> Path:
    """The path, once its length and every component's fit what the filesystem allows (the messages complete
    ``<key>: "<value>" ...``)."""
    path = Path(value).expanduser()
    size = len(os.fsencode(str(path.absolute())))
    # before any stat: a longer name or path fails every system call on Linux
    for part in path.parts:
        if len(os.fsencode(part)) > 255:
            raise ValueError(f"has a name of {len(os.fsencode(part))} bytes; names may have at most 255")
    if size + _NAME_ROOM > 4096:
        raise ValueError(
            f"is {size} bytes long; with the {_NAME_ROOM} bytes of names dsx adds below it, it must stay under "
            f"4096: point {key} at a shorter path"
        )
    path_max, name_max = _limits(path)
    if size + _NAME_ROOM > path_max:
        raise ValueError(
            f"is {size} bytes long; with the {_NAME_ROOM} bytes of names dsx adds below it, it must stay under "
            f"{path_max}: point {key} at a shorter path"
        )
    long = [p for p in path.parts if len(os.fsencode(p)) > name_max]
    if long:
        raise ValueError(
            f"has a name of {len(os.fsencode(long[0]))} bytes; this filesystem allows {name_max}"
        )
    return path


def _check_dir(value: str | None, key: str) -> str | None:
    """A directory dsx writes into must exist and be writable at start-up, not at the first step.

    The messages complete ``<key>: "<value>" ...`` (see :func:`_format_errors`)."""
    if value is None:
        return None
    if not value.strip():
        raise ValueError(f"is empty: give {key} a directory")
    path = _check_path_length(value, key)
    if not path.exists():
        raise ValueError(f"does not exist: create it, or point {key} at an existing directory")
    if not path.is_dir():
        raise ValueError(f"is not a directory: point {key} at a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(
            f"is not writable by this user (uid {os.getuid()}): change its permissions, or point {key} at a "
            "directory this user can write"
        )
    return str(path)


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
    # policy auto: steps run with everything kept before the profiled one (the first step pays for lazy
    # initialisation and allocator growth, which would make forward look slower and writes easier to hide)
    profile_warmup_steps: int = Field(default=1, ge=0, le=1000)
    # policy auto: how the warm-up and profiling steps run. "keep" keeps everything (exact, but the
    # micro-batch must fit without dsx); "recompute" recomputes every layer and profiles the recomputation
    # (a micro-batch that fits only with dsx); "auto": "recompute" when memory_budget_gb is set
    profile_mode: Literal["auto", "keep", "recompute"] = "auto"
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
        ram = _physical_memory()
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
        return _check_dir(v, "ssd_path") if info.data.get("enabled", False) else v

    @model_validator(mode="after")
    def _ssd_needs_path(self) -> ActivationOffloadConfig:
        if self.enabled and "ssd" in self.tiers and self.ssd_path is None:
            raise PydanticCustomError(
                "dsx_missing",
                "ssd_path is not set, and tiers contains 'ssd': give ssd_path, a directory on the SSD",
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

    @field_validator("shared_memory_dir")
    @classmethod
    def _shm(cls, v: str, info: ValidationInfo) -> str:
        if not info.data.get("enabled", False):  # a disabled section is not used here
            return v
        out = _check_dir(v, "shared_memory_dir")
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
        """A trace file name whose directory exists and is writable, checked at start-up rather than when
        the first trace is written (at close, or after ``log_interval`` steps)."""
        if v is None:
            return None
        if not v.strip():
            raise ValueError("is empty: give trace_path a file name, or null for no trace")
        path = _check_path_length(v, "trace_path")
        if path.is_dir():
            raise ValueError("is a directory: give trace_path a file name in it, e.g. trace.json")
        # a disabled scheduler writes no trace: its directory may be absent
        if info.data.get("enabled", False):
            try:
                _check_dir(str(path.parent), "trace_path")
            except ValueError as exc:
                raise ValueError(f"is in {str(path.parent)!r}, which {exc}") from None
        return str(path)


def _physical_memory() -> int:
    """Bytes of RAM on this machine (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


class DsxConfig(_Section):
    """The whole ``"dsx"`` section of a DeepSpeed config."""

    activation_offload: ActivationOffloadConfig = Field(default_factory=ActivationOffloadConfig)
    unified: UnifiedConfig = Field(default_factory=UnifiedConfig)
    rgnn: RGNNConfig = Field(default_factory=RGNNConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)

    @property
    def any_enabled(self) -> bool:
        return any(getattr(self, name).enabled for name in type(self).model_fields)


# --------------------------------------------------------------------------------------------- errors

# keys that older configs may still carry -> where the setting lives now
_MOVED: dict[tuple[str, ...], str] = {
    ("activation_offload", "io_threads"): "scheduler.io_workers",
}


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class whose field set applies at ``loc`` (for listing valid keys)."""
    model: type[BaseModel] = DsxConfig
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return model
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return model
    return model


def _fmt_loc(loc: tuple[Any, ...]) -> str:
    out = DSX_KEY
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isascii() and part.isidentifier():
            out += f".{part}"
        else:  # keys that are not identifiers are shown quoted, so that the path stays unambiguous
            out += f"[{json.dumps(part)}]"
    return out


def _allowed(err: dict[str, Any]) -> str:
    kind, ctx = err["type"], err.get("ctx", {})
    simple = {
        "bool_type": "true or false",
        "int_type": "an integer",
        "float_type": "a number",
        "string_type": "a string",
        "list_type": "a list",
        "model_type": "an object",
        "dict_type": "an object",
        "none_required": "null",
        "finite_number": "a finite number",
    }
    if kind in simple:
        return simple[kind]
    if kind == "literal_error":
        return f"one of {ctx.get('expected')}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        sign = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[
            kind
        ]
        bound = next(iter(ctx.values()))
        return f"a number {sign} {bound}"
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", err["msg"]))
    if kind == "too_short":
        return f"a list of at least {ctx.get('min_length')} item(s)"
    if kind == "too_long":
        return f"a list of at most {ctx.get('max_length')} item(s)"
    return err["msg"]


def _format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        # Union members add their own loc part ("float", "none", "list[...]"); drop those for the path.
        loc = tuple(
            p for p in loc if not (isinstance(p, str) and ("[" in p or p in {"float", "none", "int"}))
        )
        if err["type"] == "extra_forbidden":
            moved = _MOVED.get(tuple(loc))
            if moved is not None:
                lines.append(f"{_fmt_loc(loc)}: this key moved: use {DSX_KEY}.{moved} instead")
                continue
            model = _model_at(loc[:-1])
            valid = ", ".join(model.model_fields) if model is not None else "?"
            lines.append(f"{_fmt_loc(loc)}: unknown key; valid keys here are: {valid}")
            continue
        if err["type"] == "dsx_missing":  # a key that must be given (its message says which and why)
            lines.append(f"{_fmt_loc(loc)}: {err['msg']}")
            continue
        value = err.get("input")
        shown = json.dumps(value, default=repr)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        if err["type"] in ("value_error", "assertion_error"):  # our checks: the message says what is wrong
            lines.append(f"{_fmt_loc(loc)}: {shown} {err.get('ctx', {}).get('error', err['msg'])}")
            continue
        lines.append(f"{_fmt_loc(loc)}: value {shown} is not allowed; expected {_allowed(err)}")
    # One line per problem, deduplicated (a union reports each member's failure).
    seen: list[str] = []
    for line in lines:
        if line not in seen:
            seen.append(line)
    return "invalid dsx config:\n  " + "\n  ".join(seen)


# ------------------------------------------------------------------------------------------- parsing


def parse_dsx_config(section: Any) -> DsxConfig:
    """Validate a ``"dsx"`` section (a mapping, or None for all-off).

    Raises
    ------
    DsxConfigError
        With one line per problem: key path, value given and what is allowed.
    """
    if section is None:
        return DsxConfig()
    if not isinstance(section, Mapping):
        raise DsxConfigError(
            f"invalid dsx config:\n  {DSX_KEY}: value {json.dumps(section, default=repr)[:80]} is not allowed; "
            "expected an object"
        )
    try:
        return DsxConfig.model_validate(dict(section))
    except ValidationError as exc:
        raise DsxConfigError(_format_errors(exc)) from None


def load_deepspeed_config(config: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Read a DeepSpeed config given as a path or a dict (the dict is copied, never changed)."""
    if isinstance(config, Mapping):
        return json.loads(json.dumps(config))
    path = Path(config)
    if not path.is_file():
        raise DsxConfigError(f"DeepSpeed config {str(path)!r} does not exist or is not a file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DsxConfigError(f"DeepSpeed config {str(path)!r} is not valid JSON: {exc}") from None


def split_config(config: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[dict[str, Any], DsxConfig]:
    """Split a DeepSpeed config into what DeepSpeed reads and the validated ``"dsx"`` section."""
    raw = load_deepspeed_config(config)
    if not isinstance(raw, dict):
        raise DsxConfigError("a DeepSpeed config must be a JSON object")
    section = raw.pop(DSX_KEY, None)
    return raw, parse_dsx_config(section)
