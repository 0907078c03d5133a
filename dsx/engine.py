"""``dsx.initialize``: ``deepspeed.initialize`` plus the dsx features its config turns on."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import deepspeed
import torch

from dsx import defaults
from dsx.config import DsxConfig, DsxConfigError, split_config
from dsx.runtime.monitor import MonitorSink
from dsx.runtime.process import rank_and_world, release_deepspeed_shm_at_exit, single_process_env
from dsx.runtime.scheduler import Scheduler
from dsx.runtime.trace import TraceWriter

__all__ = ["DsxRuntime", "Feature", "initialize", "runtime_of"]

logger = logging.getLogger("dsx")

# Each feature's DeepSpeed glue lives in its package's ``deepspeed`` module, which exposes
# ``attach(engine, runtime) -> Feature``. Imported only when its section is enabled, so a missing optional
# dependency of one feature never breaks another.
_FEATURES: dict[str, str] = {
    "activation_offload": "dsx.offload.deepspeed",
    "unified": "dsx.direct.deepspeed",
    "rgnn": "dsx.rgnn.deepspeed",
}


class Feature(Protocol):
    """What a feature's ``attach`` returns. Optional hooks, found by name: ``around_step()`` (a context
    manager entered around every ``engine.step()``) and ``after_step()`` (called after each optimizer step,
    before the scheduler ends the step)."""

    def close(self) -> None: ...


@dataclass
class DsxRuntime:
    """What dsx attached to one DeepSpeed engine; reachable as ``engine.dsx``."""

    config: DsxConfig
    scheduler: Scheduler
    features: dict[str, Feature] = field(default_factory=dict)
    _step: _StepDriver | None = field(default=None, repr=False)
    _defaults: defaults.Restore | None = field(default=None, repr=False)

    def close(self) -> None:
        """Detach features (hooks, files, shared segments), stop the threads, write the trace; restore the
        process defaults that were current before :func:`initialize`."""
        errors: list[BaseException] = []
        # first: nothing made from now on (a loader, a unified tensor) picks up this engine's scheduler
        if self._defaults is not None:
            self._defaults.restore()
            self._defaults = None
        if self._step is not None:
            self._step.close()
            self._step = None
        for close in [h.close for h in reversed(list(self.features.values()))] + [self.scheduler.close]:
            try:
                close()
            except BaseException as exc:  # keep closing the rest, then re-raise the first
                errors.append(exc)
        self.features.clear()
        if errors:
            raise errors[0]


class _StepDriver:
    """The one wrapper of ``engine.step``: runs it inside the features' ``around_step`` contexts and, after
    each optimizer step (a gradient-accumulation boundary), calls their ``after_step`` and ends the
    scheduler's step, so that every optimizer step is ended exactly once."""

    def __init__(self, engine: Any, runtime: DsxRuntime) -> None:
        self.engine, self._inner = engine, engine.step
        self._own = "step" not in vars(
            engine
        )  # engine.step was the class's method, not an instance's wrapper
        arounds = [f.around_step for f in runtime.features.values() if hasattr(f, "around_step")]
        afters = [f.after_step for f in runtime.features.values() if hasattr(f, "after_step")]

        def step(*args: Any, **kwargs: Any) -> Any:
            # read before step(): DeepSpeed advances its micro-step counter inside it
            boundary = getattr(engine, "is_gradient_accumulation_boundary", lambda: True)()
            with contextlib.ExitStack() as stack:
                for around in arounds:
                    stack.enter_context(around())
                out = self._inner(*args, **kwargs)
            if boundary:
                for after in afters:
                    after()
                runtime.scheduler.end_step()
            return out

        engine.step = self._wrapper = step

    def close(self) -> None:
        """Take the wrapper off; one installed over it since stays (it calls this one, which calls step)."""
        if vars(self.engine).get("step") is not self._wrapper:
            return
        if self._own:
            del self.engine.step  # the class's method again, no instance attribute left behind
        else:
            self.engine.step = self._inner


def _add_sinks(engine: Any, scheduler: Scheduler) -> None:
    """The monitor and trace sinks the ``scheduler`` section asks for (only when it is enabled)."""
    cfg = scheduler.config
    if not cfg.enabled:
        if cfg.trace_path is not None:
            logger.warning("dsx: scheduler.trace_path is set but scheduler.enabled is false: no trace")
        return
    rank, world = rank_and_world()
    monitor = getattr(engine, "monitor", None)
    if rank == 0 and monitor is not None and monitor.enabled:
        scheduler.add_sink(MonitorSink(engine, cfg.log_interval))
    if cfg.trace_path is not None:
        writer = TraceWriter(cfg.trace_path, rank, world, cfg.log_interval, cfg.trace_steps)
        scheduler.add_sink(writer)
        logger.info("dsx: scheduler trace -> %s", writer.path)


def runtime_of(engine: Any) -> DsxRuntime | None:
    """The :class:`DsxRuntime` attached to ``engine`` by :func:`initialize`, or None for plain DeepSpeed."""
    return getattr(engine, "dsx", None)


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    if config is not None and config_params is not None:
        raise DsxConfigError("give either config or config_params, not both (as deepspeed.initialize)")
    src = config if config is not None else config_params
    if src is None and args is not None:
        src = getattr(args, "deepspeed_config", None)
        if src is None and getattr(args, "deepscale_config", None) is not None:
            src = args.deepscale_config
    if src is None:
        raise DsxConfigError(
            "no DeepSpeed config: pass config=<path or dict>, or args with --deepspeed_config <path>"
        )
    return src


def _check_ops(ds_config: dict[str, Any], dsx_config: DsxConfig) -> None:
    """Before DeepSpeed starts: a clear error for an op the config needs that cannot be built here (rather
    than a linker error deep in ZeRO's set-up), and one line for each op the start will compile."""
    from dsx.ops.aio import async_io_status
    from dsx.ops.notice import announce_builds, pending_builds

    full = {**ds_config, "dsx": dsx_config.model_dump()}
    zero = ds_config.get("zero_optimization") or {}
    nvme = [k for k in ("offload_optimizer", "offload_param")
            if isinstance(zero.get(k), Mapping) and str(zero[k].get("device", "")).lower() == "nvme"]  # fmt: skip
    if (
        nvme
        and int(zero.get("stage", 0) or 0) == 3
        and any(b.name == "async_io" for b in pending_builds(full))
    ):
        ok, why = async_io_status()
        if not ok:
            raise DsxConfigError(
                f'zero_optimization.{nvme[0]}.device "nvme" needs DeepSpeed\'s async_io op, which cannot be '
                f'built here: {why}; or offload to "cpu" instead'
            )
    announce_builds(full)


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    mesh_param: Any = None,
    config_params: str | os.PathLike[str] | Mapping[str, Any] | None = None,
) -> tuple[Any, Any, Any, Any]:
    """Same arguments and return value as :func:`deepspeed.initialize`.

    The ``"dsx"`` section of the config (a path or a dict, or ``args.deepspeed_config``) is validated
    before DeepSpeed starts; DeepSpeed receives the config without it. Without a ``"dsx"`` section, or with
    every feature disabled, the result is exactly what ``deepspeed.initialize`` returns. Otherwise the
    engine gains an ``engine.dsx`` :class:`DsxRuntime`.
    """
    ds_config, dsx_config = split_config(_config_source(args, config, config_params))
    if model is not None:  # what the model must match is checked before DeepSpeed starts (and builds ops)
        for name, module_name in _FEATURES.items():
            section = getattr(dsx_config, name)
            if section.enabled:
                check = getattr(importlib.import_module(module_name), "check_model", None)
                if check is not None:
                    check(model, section)
    _check_ops(ds_config, dsx_config)
    single_process_env()  # plain ``python train.py``: rank 0 of 1, not DeepSpeed's MPI discovery
    if args is not None and hasattr(args, "deepspeed_config"):
        # DeepSpeed re-reads args.deepspeed_config when config is None; we always pass the dict instead.
        args.deepspeed_config = None
    engine, opt, loader, sched = deepspeed.initialize(
        args=args,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        distributed_port=distributed_port,
        mpu=mpu,
        dist_init_required=dist_init_required,
        collate_fn=collate_fn,
        config=ds_config,
        mesh_param=mesh_param,
    )
    # DeepSpeed's CPU backend leaks a 66 MiB /dev/shm buffer a rank; its peers have mapped it by now
    # (the engine's setup ran collectives), so an exit without exit_distributed() may unlink it too
    release_deepspeed_shm_at_exit()
    if dsx_config.any_enabled:
        engine.dsx = attach(engine, dsx_config)
    return engine, opt, loader, sched


def attach(engine: Any, dsx_config: DsxConfig) -> DsxRuntime:
    """Attach the enabled dsx features to an existing engine (used by :func:`initialize`)."""
    device = getattr(engine, "device", None)
    device = torch.device(device) if device is not None else None
    runtime = DsxRuntime(config=dsx_config, scheduler=Scheduler(dsx_config.scheduler, device=device))
    runtime._defaults = defaults.install(dsx_config, runtime.scheduler)
    try:
        for name, module_name in _FEATURES.items():
            if not getattr(dsx_config, name).enabled:
                continue
            runtime.features[name] = importlib.import_module(module_name).attach(engine, runtime)
            logger.info("dsx: %s attached", name)
        _add_sinks(engine, runtime.scheduler)
        runtime._step = _StepDriver(engine, runtime)
    except BaseException:
        try:
            runtime.close()
        except BaseException:  # the attach error is the one to see; the close error only goes to the log
            logger.exception("dsx: closing after a failed attach failed too")
        raise
    return runtime
