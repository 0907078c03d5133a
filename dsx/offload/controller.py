"""The activation-offload controller: hooks, tiers and the per-layer plan for one model.

:class:`ActivationOffload` sets up the tiers (a pinned host pool, a per-rank SSD file), the mover that copies
to and from them, the per-layer saved-tensor hooks and, for policy ``auto``, the profiling step whose
measurements the planner turns into a plan. Under DeepSpeed, :mod:`dsx.offload.deepspeed` attaches it to the
engine; on a bare module call :meth:`ActivationOffload.end_step` after each optimizer step.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch
from torch import nn

from dsx import defaults
from dsx.config import ActivationOffloadConfig
from dsx.offload.agree import agree_peak, agree_profiles
from dsx.offload.calibration import Calibration
from dsx.offload.checkpointing import checkpointed, layers_and_subs, noting_oom
from dsx.offload.hooks import LayerHooks
from dsx.offload.plan import Action, Plan, make_plan, write_barrier_fixed
from dsx.offload.profile import Profiler
from dsx.offload.store import HostPool, RunDir, SsdFile
from dsx.offload.transfer import Mover
from dsx.offload.wear import WearWatch
from dsx.runtime import allocator
from dsx.runtime.bandwidth import measure_tier_bandwidth
from dsx.runtime.process import rank_and_world
from dsx.runtime.scheduler import Scheduler

__all__ = ["ActivationOffload"]

logger = logging.getLogger("dsx.offload")
GB = 1 << 30

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
    if set_keys and rank_and_world()[0] == 0:
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


class ActivationOffload:
    """Hooks, tiers and the per-layer plan for one model.

    Parameters
    ----------
    model
        The module whose layers offload (``engine.module`` under DeepSpeed).
    cfg
        The ``"dsx"."activation_offload"`` section; by default ``dsx.defaults.get("activation_offload")``.
    scheduler
        The rank's :class:`~dsx.runtime.scheduler.Scheduler` (side streams, I/O threads, telemetry); by default
        :func:`dsx.defaults.scheduler`.
    device
        The compute device; defaults to the device of the model's first parameter. On a CPU run the whole
        mechanism runs with CPU tensors (the CI path).
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: ActivationOffloadConfig | None = None,
        scheduler: Scheduler | None = None,
        device: torch.device | None = None,
    ) -> None:
        cfg = cfg if cfg is not None else defaults.get("activation_offload")
        scheduler = scheduler if scheduler is not None else defaults.scheduler()
        self.cfg, self.sched = cfg, scheduler
        self._closed = False
        self.device = device or _device_of(model)
        # checked before any hook, file or buffer exists: a bad name leaves the model as it was
        self.layers, self._subs = layers_and_subs(model, cfg)
        self.host = HostPool(int(cfg.host_pool_gb * GB), pin=self.device.type == "cuda", device=self.device)
        self.wear: WearWatch | None = None  # ssd_endurance_tbw given: warns when the drive would wear out
        # the SSD tier shares a drive with another writer (ZeRO's nvme_path: set by dsx.offload.deepspeed);
        # activation writes then pause while that writer runs
        self.shared_ssd = False
        # what close() undoes, so that a constructor that raises can undo what it had done so far
        self.run_dir: RunDir | None = None
        self.ssd: SsdFile | None = None
        self.mover: Mover | None = None
        self.hooks: LayerHooks | None = None
        self.calibration: Calibration | None = None
        self._orig_forward: dict[int, Any] = {}
        self._orig_sub_forward: dict[int, Any] = {}
        self._expandable_before: bool | None = None  # the allocator setting to restore at close
        try:
            self._start(model, cfg, scheduler)
        except BaseException:
            self.close()
            raise

    def _start(self, model: nn.Module, cfg: ActivationOffloadConfig, scheduler: Scheduler) -> None:
        """The rest of the constructor: tiers, bandwidth probe, mover, hooks, and the policy's first actions."""
        if cfg.policy == "offload_all":  # it moves bytes from the first step: the pool now, or a clear error
            self.host.allocate()
        if "ssd" in cfg.tiers and cfg.policy != "none":
            self.run_dir = RunDir(cfg.ssd_path, rank_and_world()[0])
            self.ssd = SsdFile(self.run_dir, int(cfg.ssd_capacity_gb * GB), cfg.io_backend, scheduler)
            logger.info(
                "dsx activation offload: SSD file %s, backend %s, %s",
                self.ssd.path,
                self.ssd.io.name,
                self.ssd.direct_reason,
            )
            if cfg.ssd_endurance_tbw is not None:
                self.wear = WearWatch(cfg.ssd_path, cfg.ssd_endurance_tbw, cfg.wear_warn_years)
        self._bws: list[Any] = []
        if cfg.policy in ("auto", "offload_all"):
            # a collective call (every rank of the node measures at once, then they agree on a share), made
            # here, where all ranks are in dsx.initialize together, before training traffic shares the links
            self._bws = measure_tier_bandwidth(
                cfg.tiers, self.run_dir.path if self.run_dir else None, mb=scheduler.config.bandwidth_probe_mb
            )
        self.mover = Mover(
            self.device,
            scheduler,
            self.host,
            self.ssd,
            cfg.verified_tiers(),
            read_pool=cfg.resolved("read_pool"),
        )
        self.hooks = LayerHooks(model, self.layers, self.mover, cfg.min_tensor_bytes)
        self.plan: Plan | None = None
        # the planned steps' measured peaks (its forward start is where a step's activation memory counts from)
        self.calibration = Calibration(cfg, model, self.device)
        self.step = 0
        self.profiler: Profiler | None = None
        self._outside_s = 0.0  # the step's time outside the layers (Profiler.outside_s)
        self._outside_peak = 0  # its peak after the layers' backward (Profiler.outside_peak)
        self._profile_rc = False  # policy auto profiles under recomputation (set below)
        self._profile_host = False  # ... with the layers' inputs on the host tier
        if cfg.policy != "auto":
            _warn_unused_auto_settings(cfg)
        if cfg.policy == "offload_all":
            last = Action(cfg.tiers[-1])  # "ordered": writes pass the tiers in order and rest in the last
            sel = [Action(f"{last.value}+sel") if subs else last for subs in self._subs]
            # ("auto" holds it: memory is what offload_all is for; resolved() decides "auto" for policy auto)
            on = cfg.write_barrier != "off"
            self._apply(
                sel, cfg.prefetch_depth or 1, barriers=write_barrier_fixed(len(sel)) if on else ([], [])
            )
        elif cfg.policy == "recompute_all":
            self._apply([Action.RECOMPUTE] * len(self.layers), 1)
        elif cfg.policy == "auto":
            # a budget means the micro-batch may fit only with dsx: profile under recomputation then
            mode = cfg.resolved("profile_mode")
            self._profile_rc = mode in ("recompute", "recompute+host")
            self._profile_host = mode == "recompute+host"
            # the offload's waits that profiled intervals leave out (not "pool-full": it waits after a layer's
            # forward is queued, while the GPU may still run it): on CUDA what they cost the GPU, on the CPU the
            # host's time in them
            tel = self.sched.telemetry
            waits = tel.gpu_waited_s if self.device.type == "cuda" else tel.stalled_s
            waited = functools.partial(waits, "unpack", "write-barrier")
            self.profiler = Profiler(
                self.layers,
                self.hooks,
                self.device,
                cfg.recompute_modules,
                under_recompute=self._profile_rc,
                root=model,
                waited=waited,
            )
            self._profile_next(cfg.profile_warmup_steps == 0)
        # last: the setting is process-wide, and close() restores it
        if self.device.type == "cuda" and cfg.policy != "none":
            want = cfg.resolved("expandable_segments") == "on"
            if cfg.expandable_segments != "auto" or (want and not allocator.user_configured()):
                self._expandable_before = allocator.set_expandable_segments(want)
                logger.info("dsx activation offload: CUDA allocator expandable_segments=%s (setting %r)",
                            want, cfg.expandable_segments)  # fmt: skip

    # ------------------------------------------------------------------------------------ actions
    def _apply(
        self,
        actions: list[Action],
        depth: int,
        caps: dict[int, int] | None = None,
        barriers: tuple[list[int], list[int]] = ([], []),
    ) -> None:
        """Install an :class:`~dsx.offload.plan.Action` per layer (a recomputed layer runs under the
        reentrant checkpoint, a ``+sel`` one's ``recompute_modules`` under the non-reentrant one, and what it
        stores moves to ``Action.tier``), the prefetch depth, the partial layers' caps and the write barriers
        (forward, backward): the plan's, or ``offload_all``'s fixed rule."""
        tiers = []
        for i, a in enumerate(actions):
            checkpointed(self.layers[i], a.recomputed, i, self._orig_forward, reentrant=True)
            for sub in self._subs[i]:
                checkpointed(sub, a.sel, id(sub), self._orig_sub_forward)
            # the reentrant checkpoint saves its inputs with save_for_backward, inside the layer's hooks
            tiers.append(a.tier.value if a.tier is not None else "keep")
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
        n = len(self.layers)
        self.hooks.actions = ["keep"] * n  # the profiler counts inside the recomputation
        if self._profile_host:
            # what each checkpoint keeps (the layer's inputs) goes to the host as a recompute+host layer's does;
            # the recomputation runs outside the layers' hooks, so what it saves stays. A layer waits for the
            # writes of the layer two back (the warm-up steps are not synchronized per layer, and the host
            # would otherwise queue later layers before the moved bytes are freed)
            self.host.allocate()
            self.hooks.actions = ["host"] * n
            # inputs the pool has no room for go to the SSD tier where the tiers list it, not stay on the device;
            # the pool keeps staging room for one write and the backward's reads (its layer and the prefetch)
            if "ssd" in self.cfg.tiers:
                self.mover.overflow_slots = 2 + self.hooks.prefetch_depth
            self.hooks.write_barrier, self.hooks.write_barrier_bwd = write_barrier_fixed(n)
        self._uncheckpoint_layers()
        for i, layer in enumerate(self.layers):

            def wrap(fn: Any, count_saved: bool = True, i: int = i) -> Any:
                return noting_oom(profiler.wrap(i, fn, count_saved) if on else fn, self.profile_oom_note)

            checkpointed(layer, True, i, self._orig_forward, reentrant=True, wrap=wrap)

    def profile_oom_note(self) -> str | None:
        """What an out-of-memory error says to do while policy auto's warm-up and profiling steps run under
        recomputation (None otherwise): those steps peak as full recompute does unless the layers' inputs go
        to the host, whatever the plan after them would need. The layers' forwards and recomputations add it
        (:func:`~dsx.offload.checkpointing.noting_oom`); under DeepSpeed, so does ``engine.backward``."""
        if self.profiler is None or not self._profile_rc or self._closed:
            return None
        where = "dsx activation offload: out of memory in policy auto's warm-up or profiling steps"
        if self._profile_host:
            return (
                f"{where}, which recompute every layer with its inputs on the host tier: one layer's forward, or "
                "its recomputation and backward, do not fit beside what the step holds, the inputs the host "
                'pool had no room for included. If dsx logged "host pool full", raise '
                'activation_offload.host_pool_gb, or add "ssd" to activation_offload.tiers (with ssd_path) so that '
                "the inputs the pool cannot hold go to the drive; else lower the micro-batch or the sequence length"
            )
        fix = 'set activation_offload.profile_mode to "recompute+host"'
        if "host" not in self.cfg.tiers:
            fix = f'add "host" to activation_offload.tiers and {fix}'
        mode = self.cfg.profile_mode
        mode = "'auto', which is 'recompute' under memory_budget_gb" if mode == "auto" else repr(mode)
        return (
            f"{where}, which recompute every layer and keep its inputs on the device (profile_mode {mode}): "
            "they peak as full recompute does, whatever the plan after them would need. To move those inputs to "
            f'the host in these steps, {fix} (docs/offload.md, "What the profile costs in memory")'
        )

    def _uncheckpoint_layers(self) -> None:
        for i in list(self._orig_forward):
            checkpointed(self.layers[i], False, i, self._orig_forward)

    # ------------------------------------------------------------------------------------- steps
    def after_step(self) -> None:
        """Mark an optimizer-step boundary: after the profiling step of policy 'auto', plan and apply; after a
        planned step under a budget (or a hide-only one that moves bytes), calibrate. The caller ends the
        scheduler's step (the engine does)."""
        warmup = self.cfg.profile_warmup_steps
        if self.profiler is not None and self.step < warmup:
            self.profiler.end_warm_step()
        if self.profiler is not None and self.step + 1 == warmup:
            self._profile_next(True)
        elif self.profiler is not None and self.step == warmup:
            # every rank plans from the same numbers, so that all recompute the same layers (a collective)
            profiler, self.profiler = self.profiler, None
            self._end_overflow()
            profiles, self._outside_s, self._outside_peak = agree_profiles(
                profiler.finish(), profiler.outside_s, profiler.outside_peak
            )
            if (
                rank_and_world()[0] == 0 and len(profiles) > 16
            ):  # the search grows about as n^3 (make_plan's notes)
                logger.warning("dsx activation offload: planning %d layers ...", len(profiles))
            self._uncheckpoint_layers()  # the profiler's wrappers go; the plan checkpoints what it recomputes
            self._install(
                make_plan(
                    profiles,
                    self._bws,
                    self._budget_for_tail(),
                    best_effort=True,
                    outside_s=self._outside_s,
                    outside_peak_bytes=self._outside_peak,
                )
            )
            self.calibration.start(self.plan)
        elif self.calibration.pending:
            peak = agree_peak(self.calibration.meter.since_mark(), len(self.layers))  # (a collective)
            if peak is not None:
                self.calibration.calibrate(peak, self.plan, self._replan, self._install)
        self.hooks.release_dead()
        if self.wear is not None and self.ssd is not None:
            self.wear.step(self.ssd.bytes_written)
        self.step += 1

    def end_step(self) -> None:
        """:meth:`after_step`, then end the scheduler's step: call it after each optimizer step when no
        engine does (a bare ``nn.Module``)."""
        self.after_step()
        self.sched.end_step()

    def _replan(self, cfg: ActivationOffloadConfig) -> Plan:
        """A plan from the installed plan's profiles under ``cfg`` (budget calibration)."""
        assert self.plan is not None
        return make_plan(self.plan.profiles, self._bws, cfg, outside_s=self._outside_s,
                         outside_peak_bytes=self._outside_peak)  # fmt: skip

    def _budget_for_tail(self) -> ActivationOffloadConfig:
        """The config the first plan is made under: where the step's tail, not its layers, puts it over the
        budget, say so (rank 0) and plan against that tail, which the step reaches anyway (recomputing to stay
        under the budget would buy nothing there)."""
        budget = self.cfg.memory_budget_gb
        if budget is None or self._outside_peak <= budget * GB:
            return self.cfg
        if rank_and_world()[0] == 0:
            self._warn_outside_peak(budget)
        return self.cfg.model_copy(update={"memory_budget_gb": self._outside_peak / GB})

    def _warn_outside_peak(self, budget: float) -> None:
        logger.warning(
            "dsx activation offload: after the layers' backward the step peaks at %.2f GiB above its start "
            "(the gradients' reduction and the optimizer step), over memory_budget_gb=%s: no activation plan "
            "lowers that part, so the layers are planned against that peak instead (the step reaches it "
            "anyway). To meet the budget, lower what the optimizer step holds (ZeRO stage 2 or 3 over several "
            "ranks, optimizer offload); or set memory_budget_gb to at least %.2f",
            self._outside_peak / GB,
            budget,
            math.ceil(self._outside_peak / GB * 100) / 100,
        )

    def _end_overflow(self) -> None:
        """The profiling steps are over: the plan names each layer's tier. A layer the drive refused while
        inputs overflowed to it is not held to the host tier in the plan's steps: the plan did not size the
        pool for it (a refusal then demotes it, as in any planned step)."""
        if self.mover is not None and self.mover.overflow_slots:
            self.mover.overflow_slots = 0
            self.mover.demoted.clear()

    def _install(self, plan: Plan) -> None:
        self._end_overflow()
        if any(
            a.moved for a in plan.actions
        ):  # the first plan that moves bytes: the pool now, or a clear error
            self.host.allocate()
        else:  # keeping everything (a fallback): the pinned pool goes back once nothing in it is in use
            self.host.release()
        self.plan = plan
        if rank_and_world()[0] == 0:
            how = "every layer recomputed" if self._profile_rc else "everything kept"
            if self._profile_host:
                how += ", its inputs on the host"
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
            plan.actions,
            self.cfg.prefetch_depth or plan.prefetch_depth,
            plan.move_caps,
            (plan.write_barrier, plan.write_barrier_bwd),
        )

    def close(self) -> None:
        """Wait for the writes in flight, remove the hooks, close and remove the SSD file; once (a second call
        does nothing)."""
        if self._closed:
            return
        self._closed = True
        if self.calibration is not None:
            self.calibration.meter.close()
        try:
            if self.mover is not None:
                self.mover.drain()
        finally:
            try:  # the pinned pool back now, not at garbage collection (kept while in use)
                self.host.release()
            except Exception as exc:  # the rest of close() must run: hooks, files, the allocator setting
                logger.warning("dsx activation offload: the host pool was not unpinned at close: %s", exc)
            if self.hooks is not None:
                self.hooks.remove()
            self._uncheckpoint_layers()
            for sub in [s for subs in self._subs for s in subs]:
                checkpointed(sub, False, id(sub), self._orig_sub_forward)
            if self.ssd is not None:
                self.ssd.close()
            if self.run_dir is not None:
                self.run_dir.remove()
            if self._expandable_before is not None:
                allocator.set_expandable_segments(self._expandable_before)
                self._expandable_before = None
