"""Activation offload (SSDTrain in dsx): saved activations leave the device in forward, return in backward.

``attach(engine, section, runtime)`` is what ``dsx.initialize`` calls; :class:`ActivationOffload` also works
on a bare ``nn.Module`` (call :meth:`ActivationOffload.end_step` after each optimizer step).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dsx.config import ActivationOffloadConfig, DsxConfigError
from dsx.offload.agree import agree_peak, agree_profiles
from dsx.offload.hooks import LayerHooks, find_layers
from dsx.offload.io import describe_backends, select_backend
from dsx.offload.profile import Profiler
from dsx.offload.store import HostPool, RunDir, SsdFile
from dsx.offload.transfer import Mover, OffloadIntegrityError
from dsx.offload.wear import WearWatch
from dsx.runtime import allocator
from dsx.runtime.scheduler import Scheduler

__all__ = [
    "ActivationOffload",
    "OffloadIntegrityError",
    "attach",
    "check_model",
    "describe_backends",
    "select_backend",
]

logger = logging.getLogger("dsx.offload")
GB = 1 << 30
MAX_CALIBRATIONS = 2  # re-plans after a planned step measured over the budget (policy auto, CUDA)


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def _st_dev(path: str) -> int:
    """st_dev of ``path`` or of its nearest existing parent (DeepSpeed creates nvme_path lazily)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return os.stat(path).st_dev


# settings a fixed policy may ignore, and the policies that read each
_READERS = {
    "memory_budget_gb": ("auto",),
    "profile_mode": ("auto",),
    "profile_warmup_steps": ("auto",),
    "write_barrier": ("auto", "offload_all"),
}


def _warn_unused_auto_settings(cfg: ActivationOffloadConfig) -> None:
    """A fixed policy has no profile and no plan: say so when the config sets what only a plan uses."""
    set_keys = [
        k
        for k, readers in _READERS.items()
        if k in cfg.model_fields_set
        and getattr(cfg, k) != type(cfg).model_fields[k].default
        and cfg.policy not in readers
    ]
    if set_keys and _rank() == 0:
        logger.warning(
            "dsx activation offload: policy %r ignores %s",
            cfg.policy,
            ", ".join(
                f"{k}={getattr(cfg, k)!r} (read by policy {', '.join(map(repr, _READERS[k]))} only)"
                for k in set_keys
            ),
        )


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _recompute_modules(layer: nn.Module, names: list[str]) -> list[nn.Module]:
    """The outermost sub-modules of ``layer`` whose class name is in ``names``."""
    if not names:
        return []
    out: list[nn.Module] = []
    for m in layer.modules():
        if m is not layer and type(m).__name__ in names and not any(m in set(o.modules()) for o in out):
            out.append(m)
    return out


def _layers_and_subs(
    model: nn.Module, cfg: ActivationOffloadConfig
) -> tuple[list[nn.Module], list[list[nn.Module]]]:
    """The layers (``layer_classes``) and each one's ``recompute_modules``; ValueError naming what is there
    when a name matches nothing."""
    layers = find_layers(model, cfg.layer_classes)
    subs = [_recompute_modules(layer, cfg.recompute_modules) for layer in layers]
    missing = [name for name in cfg.recompute_modules if not any(
        type(m).__name__ == name for s in subs for m in s)]  # fmt: skip
    if missing:
        found = sorted({type(m).__name__ for layer in layers for m in layer.modules()} - {""})
        raise ValueError(
            f"dsx activation offload: recompute_modules {missing} match no sub-module of the layers "
            f"({type(layers[0]).__name__}); classes inside a layer: {found}"
        )
    return layers, subs


def check_model(model: nn.Module, section: ActivationOffloadConfig) -> None:
    """What ``attach`` would find wrong with ``model`` (``layer_classes``, ``recompute_modules``), as a
    :class:`~dsx.config.DsxConfigError`: ``dsx.initialize`` calls it before DeepSpeed starts."""
    try:
        _layers_and_subs(model, section)
    except ValueError as exc:
        raise DsxConfigError(str(exc)) from None


def _reentrant(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], wrap: Any = None) -> Any:
    """torch's reentrant checkpoint of ``fn(*args, **kwargs)`` (it takes positional arguments only).

    The reentrant form computes no parameter gradients when no input requires grad (e.g. frozen
    embeddings feeding trainable layers), so such calls take the non-reentrant form instead. ``wrap``
    (the profiler's) wraps ``fn``, told which form runs it.
    """
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())):
        fn = wrap(fn, count_saved=False) if wrap else fn
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    fn = wrap(fn) if wrap else fn
    n, keys = len(args), tuple(kwargs)

    def run(*flat: Any) -> Any:
        return fn(*flat[:n], **dict(zip(keys, flat[n:])))

    return checkpoint(run, *args, *kwargs.values(), use_reentrant=True)


def _checkpointed(
    module: nn.Module, on: bool, key: int, saved: dict[int, Any], reentrant: bool = False, wrap: Any = None
) -> None:
    """Run ``module`` under torch checkpointing (``on``) or restore its own forward.

    Whole layers use the reentrant form. With the non-reentrant one, megatron-core layers (hidden 2048,
    micro-batch 8, H100) kept ~3.7 GB per layer allocated between steps, so full recompute's absolute peak
    was 44.7 GB against 47.1 GB without recompute, and micro-batch 16 ran out of memory (the small torch GPT
    shows no such retention; the cause inside megatron-core was not pinned down). DeepSpeed's reentrant
    checkpoint of the same layers held nothing between steps; reentrant recomputation frees what it
    re-creates when the layer's backward ends. Sub-modules (``recompute_modules``) keep the non-reentrant
    form, which lets their inputs be saved (and moved) like any other tensor.
    """
    if on and key not in saved:
        orig = module.forward
        saved[key] = module.__dict__.get("forward")  # None: the class's forward, restored by deleting ours

        def fwd(*args: Any, _orig: Any = orig, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _orig(*args, **kwargs)
            if reentrant:
                return _reentrant(_orig, args, kwargs, wrap)
            return checkpoint(_orig, *args, use_reentrant=False, **kwargs)

        module.forward = fwd
    elif not on and key in saved:
        own = saved.pop(key)
        if own is None:
            del module.forward
        else:
            module.forward = own


class ActivationOffload:
    """Hooks, tiers and the per-layer plan for one model.

    Parameters
    ----------
    model
        The module whose layers offload (``engine.module`` under DeepSpeed).
    cfg
        The ``"dsx"."activation_offload"`` section.
    scheduler
        The rank's :class:`~dsx.runtime.scheduler.Scheduler` (side streams, I/O threads, telemetry).
    device
        The compute device; defaults to the device of the model's first parameter. On a CPU run the whole
        mechanism runs with CPU tensors (the CI path).
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: ActivationOffloadConfig,
        scheduler: Scheduler,
        device: torch.device | None = None,
        shared_ssd_with: str | None = None,
    ) -> None:
        self.cfg, self.sched = cfg, scheduler
        self._closed = False
        self.device = device or _device_of(model)
        self._root = model  # its forward's start is where a step's activation memory is measured from
        # checked before any hook, file or buffer exists: a bad name leaves the model as it was
        self.layers, self._subs = _layers_and_subs(model, cfg)
        self.run_dir: RunDir | None = None
        self.ssd: SsdFile | None = None
        self.wear: WearWatch | None = None  # ssd_endurance_tbw given: warns when the drive would wear out
        self.shared_ssd = False
        if cfg.policy == "auto":
            from dsx.offload import plan as _plan

            self._plan_mod = _plan
        if "ssd" in cfg.tiers and cfg.policy != "none":
            self.run_dir = RunDir(cfg.ssd_path, _rank())
            try:
                self.ssd = SsdFile(
                    self.run_dir, int(cfg.ssd_capacity_gb * GB), cfg.io_backend, cfg.io_threads
                )
            except BaseException:  # (an unavailable io_backend): a failed start leaves no directory behind
                self.run_dir.remove()
                raise
            logger.info(
                "dsx activation offload: SSD file %s, backend %s, %s",
                self.ssd.path,
                self.ssd.io.name,
                self.ssd.direct_reason,
            )
            if cfg.ssd_endurance_tbw is not None:
                self.wear = WearWatch(cfg.ssd_path, cfg.ssd_endurance_tbw, cfg.wear_warn_years)
            if shared_ssd_with:
                self.shared_ssd = _st_dev(shared_ssd_with) == _st_dev(cfg.ssd_path)
                if self.shared_ssd:
                    logger.info(
                        "dsx activation offload: %s shares a device with ZeRO's nvme_path %s: activation "
                        "writes pause during engine.step()",
                        cfg.ssd_path,
                        shared_ssd_with,
                    )
        self._bws: list[Any] = []
        if cfg.policy in ("auto", "offload_all"):
            # a collective call (every rank of the node measures at once, then they agree on a share), made
            # here, where all ranks are in dsx.initialize together, before training traffic shares the links
            from dsx.runtime.bandwidth import measure_tier_bandwidth

            self._bws = measure_tier_bandwidth(cfg.tiers, self.run_dir.path if self.run_dir else None)
        self._expandable_before: bool | None = None  # the allocator setting to restore at close
        self.host = HostPool(int(cfg.host_pool_gb * GB), pin=self.device.type == "cuda")
        self.mover = Mover(
            self.device, scheduler, self.host, self.ssd, cfg.verify, read_pool=cfg.resolved("read_pool")
        )
        self.hooks = LayerHooks(model, self.layers, self.mover, cfg.min_tensor_bytes)
        self._orig_forward: dict[int, Any] = {}
        self._orig_sub_forward: dict[int, Any] = {}
        self.plan: Any = None
        self._model_budget = 0.0  # the budget the planner is given: memory_budget_gb less measured overshoot
        self._calibrations_left = 0
        self._peak_base: int | None = None  # memory allocated as the measured step's forward started
        self._peak_hook: Any = None
        self.step = 0
        self.profiler: Profiler | None = None
        self._outside_s = 0.0  # the profiled step's time outside the layers (Profiler.outside_s)
        self._profile_rc = False  # policy auto profiles under recomputation (set below)
        if cfg.policy != "auto":
            _warn_unused_auto_settings(cfg)
        if cfg.policy == "offload_all":
            last = cfg.tiers[-1]  # "ordered": writes pass the tiers in order and rest in the last
            sel = [f"{last}+sel" if subs else last for subs in self._subs]
            from dsx.offload.plan import write_barrier_fixed

            # ("auto" holds it: memory is what offload_all is for; resolved() decides "auto" for policy auto)
            on = cfg.write_barrier != "off"
            self._apply(
                sel, cfg.prefetch_depth or 1, barriers=write_barrier_fixed(len(sel)) if on else ([], [])
            )
        elif cfg.policy == "recompute_all":
            self._apply(["recompute"] * len(self.layers), 1)
        elif cfg.policy == "auto":
            # a budget means the micro-batch may fit only with dsx: profile under recomputation then
            self._profile_rc = cfg.resolved("profile_mode") == "recompute"
            self.profiler = Profiler(
                self.layers,
                self.hooks,
                self.device,
                cfg.recompute_modules,
                under_recompute=self._profile_rc,
                root=model,
            )
            self._profile_next(cfg.profile_warmup_steps == 0)
        # last: a constructor that raised is never closed, and this setting is process-wide
        if self.device.type == "cuda" and cfg.policy != "none":
            want = cfg.resolved("expandable_segments") == "on"
            if cfg.expandable_segments != "auto" or (want and not allocator.user_configured()):
                self._expandable_before = allocator.set_expandable_segments(want)
                logger.info("dsx activation offload: CUDA allocator expandable_segments=%s (setting %r)",
                            want, cfg.expandable_segments)  # fmt: skip

    # ------------------------------------------------------------------------------------ actions
    def _apply(
        self,
        actions: list[str],
        depth: int,
        caps: dict[int, int] | None = None,
        barriers: tuple[list[int], list[int]] = ([], []),
    ) -> None:
        """Install per-layer actions: ``keep``, ``host``, ``ssd``, ``recompute``, ``<keep|host|ssd>+sel`` or
        ``recompute+<host|ssd>`` (recomputed, with the inputs the checkpoint keeps moved to the tier), and the
        write barriers (forward, backward): the plan's, or ``offload_all``'s fixed rule."""
        tiers = []
        for i, a in enumerate(actions):
            parts = a.split("+")
            _checkpointed(self.layers[i], parts[0] == "recompute", i, self._orig_forward, reentrant=True)
            for sub in self._subs[i]:
                _checkpointed(sub, parts[-1] == "sel", id(sub), self._orig_sub_forward)
            # the reentrant checkpoint saves its inputs with save_for_backward, inside the layer's hooks
            tiers.append(next((t for t in parts if t in ("host", "ssd")), "keep"))
        self.hooks.actions = tiers
        self.hooks.prefetch_depth = depth
        self.hooks.move_caps = dict(caps or {})
        self.hooks.write_barrier, self.hooks.write_barrier_bwd = list(barriers[0]), list(barriers[1])

    def _profile_next(self, on: bool) -> None:
        """Profile the coming step (``on``), or run it as the profiling step will, unprofiled (a warm-up
        step): everything kept, or every layer recomputed (``profile_mode``)."""
        profiler = self.profiler
        assert profiler is not None
        profiler.enabled = on
        if on:
            self.hooks.start_profile()
        if not self._profile_rc:
            self.hooks.actions = ["profile" if on else "keep"] * len(self.layers)
            return
        self.hooks.actions = ["keep"] * len(self.layers)  # the profiler counts inside the recomputation
        self._uncheckpoint_layers()
        for i, layer in enumerate(self.layers):
            wrap = (lambda fn, count_saved=True, i=i: profiler.wrap(i, fn, count_saved)) if on else None
            _checkpointed(layer, True, i, self._orig_forward, reentrant=True, wrap=wrap)

    def _uncheckpoint_layers(self) -> None:
        for i in list(self._orig_forward):
            _checkpointed(self.layers[i], False, i, self._orig_forward)

    def end_step(self) -> None:
        """Mark an optimizer-step boundary: after the profiling step of policy 'auto', plan and apply."""
        warmup = self.cfg.profile_warmup_steps
        if self.profiler is not None and self.step + 1 == warmup:
            self._profile_next(True)
        elif self.profiler is not None and self.step == warmup:
            # every rank plans from the same numbers, so that all recompute the same layers (a collective)
            profiles, self._outside_s = agree_profiles(self.profiler.finish(), self.profiler.outside_s)
            self.profiler = None
            if _rank() == 0 and len(profiles) > 16:  # tens of seconds from 32 layers on (plan.py's notes)
                logger.warning("dsx activation offload: planning %d layers ...", len(profiles))
            self._uncheckpoint_layers()  # the profiler's wrappers go; the plan checkpoints what it recomputes
            self._install(
                self._plan_mod.make_plan(
                    profiles, self._bws, self.cfg, best_effort=True, outside_s=self._outside_s
                )
            )
            if self.cfg.memory_budget_gb is not None:
                self._model_budget = self.cfg.memory_budget_gb * GB
                self._calibrations_left = MAX_CALIBRATIONS
                self._mark_peak()
        elif self._calibrations_left > 0:
            peak = agree_peak(self._peak_since_mark(), len(self.layers))  # (a collective)
            if peak is not None:
                self._calibrate(peak)
        self.hooks.release_dead()
        if self.wear is not None and self.ssd is not None:
            self.wear.step(self.ssd.bytes_written)
        self.step += 1
        self.sched.end_step()

    def _install(self, plan: Any) -> None:
        self.plan = plan
        if _rank() == 0:
            how = "every layer recomputed" if self._profile_rc else "everything kept"
            logger.warning(
                "dsx activation offload plan (profiled with %s; reads into the %s stream's allocator pool%s):\n%s",
                how,
                self.mover.read_pool,
                "; expandable segments"
                if self.device.type == "cuda" and allocator.expandable_segments()
                else "",
                plan.describe(),
            )
        self._apply(
            [a.value if hasattr(a, "value") else str(a) for a in plan.actions],
            self.cfg.prefetch_depth or plan.prefetch_depth,
            plan.move_caps,
            (plan.write_barrier, plan.write_barrier_bwd),
        )

    # ------------------------------------------------------------------------ budget calibration
    def _mark_peak(self) -> None:
        """Measure the next step's activation peak (CUDA) as the profiler did for the prediction: from the
        model's forward on, above the memory allocated then. Measured from the step boundary instead,
        gradients that the optimizer's ``zero_grad(set_to_none=True)`` frees before the next forward would
        be in the base and not in the peak (a GPU test's plan ran 2% over its budget unseen that way)."""
        if self.device.type != "cuda":
            return
        self._drop_peak_hook()
        self._peak_base = None

        def forward_starts(module: nn.Module, args: Any) -> None:
            self._drop_peak_hook()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._peak_base = torch.cuda.memory_allocated(self.device)

        self._peak_hook = self._root.register_forward_pre_hook(forward_starts)

    def _drop_peak_hook(self) -> None:
        if self._peak_hook is not None:
            self._peak_hook.remove()
            self._peak_hook = None

    def _peak_since_mark(self) -> int | None:
        """The activation peak since the marked step's forward started; None before it has."""
        if self.device.type != "cuda" or self._peak_base is None:
            return None
        return torch.cuda.max_memory_allocated(self.device) - self._peak_base

    def _calibrate(self, measured: int) -> None:
        """The planned step peaked at ``measured`` bytes above its start: if that is over the budget, plan
        again against a budget lowered by the overshoot.

        The cost model counts saved bytes, recomputation and what the profiling step measured beyond them
        (background, workspaces), but not what it cannot see (allocator rounding, what a recomputed
        sub-module's checkpoint frame holds, memory that differs between a kept and a recomputed layer).
        Before the background was profiled, megatron-core plans on the H100 peaked 4.6–4.9 GB above their
        prediction. Measuring the step that ran is exact; at most ``MAX_CALIBRATIONS`` re-plans, each on
        the same profiles (no new profiling step); the budget is only ever lowered.
        """
        budget = self.cfg.memory_budget_gb * GB
        self._calibrations_left -= 1
        if measured <= budget:
            self._calibrations_left = 0
            return
        self._model_budget -= measured - budget
        cfg = self.cfg.model_copy(update={"memory_budget_gb": max(self._model_budget, 0.0) / GB})
        try:
            plan = self._plan_mod.make_plan(self.plan.profiles, self._bws, cfg, outside_s=self._outside_s)
        except self._plan_mod.PlanError as exc:
            if self._calibrations_left > 0 and any(not a.recomputed for a in self.plan.actions):
                # the model has no plan with that margin, but its error runs both ways (on the H100 at hidden
                # 4096 a mixed plan peaked 1.1 GiB over its prediction while full recompute's was
                # overestimated): fall back to recomputing every layer and measure that
                logger.warning(
                    "dsx activation offload: the planned step peaked at %.2f GiB, over memory_budget_gb=%s, and "
                    "the model has no plan with a margin for that (%s); trying recompute for every layer",
                    measured / GB,
                    self.cfg.memory_budget_gb,
                    exc,
                )
                self._install(self._plan_mod.make_plan(
                    self.plan.profiles, self._bws, self.cfg.model_copy(update={"policy": "recompute_all"}),
                    outside_s=self._outside_s))  # fmt: skip
                self._mark_peak()
                return
            self._calibrations_left = 0
            logger.warning(
                "dsx activation offload: the planned step peaked at %.2f GiB, over memory_budget_gb=%s, and no "
                "plan with a margin for that exists (%s); keeping the current plan",
                measured / GB,
                self.cfg.memory_budget_gb,
                exc,
            )
            return
        if _rank() == 0:
            logger.warning(
                "dsx activation offload: the planned step peaked at %.2f GiB against a budget of %.2f GiB "
                "(predicted %.2f GiB); planning again against %.2f GiB",
                measured / GB,
                budget / GB,
                self.plan.peak_bytes / GB,
                self._model_budget / GB,
            )
        self._install(plan)
        self._mark_peak()

    def close(self) -> None:
        """Wait for the writes in flight, remove the hooks, close and remove the SSD file; once (a second call
        does nothing)."""
        if self._closed:
            return
        self._closed = True
        self._drop_peak_hook()
        try:
            self.mover.drain()
        finally:
            self.hooks.remove()
            self._uncheckpoint_layers()
            for sub in [s for subs in self._subs for s in subs]:
                _checkpointed(sub, False, id(sub), self._orig_sub_forward)
            if self.ssd is not None:
                self.ssd.close()
            if self.run_dir is not None:
                self.run_dir.remove()
            if self._expandable_before is not None:
                allocator.set_expandable_segments(self._expandable_before)
                self._expandable_before = None


class _EngineHandle:
    def __init__(self, engine: Any, offload: ActivationOffload) -> None:
        self.engine, self.offload = engine, offload
        self._step = engine.step

        def step(*args: Any, **kwargs: Any) -> Any:
            boundary = getattr(engine, "is_gradient_accumulation_boundary", lambda: True)()
            if offload.shared_ssd:
                # DeepSpeed swaps optimizer state on the same drive in step(): activation writes wait
                with offload.sched.paused("ssd"):
                    out = self._step(*args, **kwargs)
            else:
                out = self._step(*args, **kwargs)
            if boundary:
                offload.end_step()
            return out

        engine.step = step

    def close(self) -> None:
        self.engine.step = self._step
        self.offload.close()


def _nvme_path(engine: Any) -> str | None:
    cfg = getattr(engine, "_config", None)
    zc = getattr(cfg, "zero_config", None)
    for key in ("offload_optimizer", "offload_param"):
        sub = getattr(zc, key, None)
        path = getattr(sub, "nvme_path", None) if sub is not None else None
        if path:
            return str(path)
    return None


def attach(engine: Any, section: ActivationOffloadConfig, runtime: Any) -> _EngineHandle:
    """Install activation offload on ``engine.module``; the handle's ``close()`` removes hooks and files."""
    sched = runtime.scheduler
    offload = ActivationOffload(
        engine.module, section, sched, device=torch.device(engine.device), shared_ssd_with=_nvme_path(engine)
    )
    return _EngineHandle(engine, offload)
