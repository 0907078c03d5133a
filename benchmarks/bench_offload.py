"""Activation offload, side by side: step time and activation memory of one model under each strategy.

The model is the default GPT or (``--model llama``) a Llama-style decoder (RMSNorm, RoPE,
grouped-query attention, SwiGLU; megatron-core with SDPA/flash core attention on a GPU). On the same model and
data: no offload; full recompute (dsx ``recompute_all``: torch checkpointing per
layer); megatron-core's selective recompute (core attention only); torch ``save_on_cpu(pin_memory=True)``;
``hooks_offload``, a saved-tensor-hook offload with pinned buffers and side streams as torchtune describes
its ``OffloadActivations`` (``_hook_offload.py``: a baseline written here, not dsx);
``megatron_offload_<set>`` (asked for by name), megatron-core's own fine-grained activation offloading of a
set of each layer's sub-modules (``_megatron_offload.py``: it runs without TransformerEngine through a holder
for TE's offload flag, megatron's code unchanged); dsx host tier; dsx SSD tier; dsx ``auto`` with a budget
equal to full recompute's measured peak; dsx ``auto`` with no budget (hide only); ``dsx_auto_budget_host``,
the budget config over the host tier alone (beside a pool capped by ``--pool-gb`` and an SSD tier of
``--ssd-gb``: what the SSD adds); and the dsx configs again with ``recompute_modules`` (``_sel``: the GPT's core
attention or the Llama decoder's SwiGLU activation recomputed where the plan says, the rest kept or moved per
layer). ``none_copies`` is no offload with as many bytes
copied to the host in forward and back in backward as the hide-only plan moved, on side streams and without
dsx (``_BackgroundCopies``): what moving those bytes alone costs the step. Each config runs in its own process (a fresh
``dsx.initialize`` engine; in one process, memory the earlier engines held made later configs run out);
step time is the median over ``--steps`` after ``--warmup`` (``dsx_auto`` configs warm up longer: through their
profiled step, and then until their plan has settled and run a step); activation peak is ``max_memory_allocated``
during the steps minus the memory held before the first measured forward, and ``peak_allocated_gb`` the
absolute maximum (model, optimizer and whatever a strategy keeps between steps included: torch checkpointing
of megatron-core layers was seen to keep ~3.8 GB per layer allocated between steps, see
``memory_per_step_gb``).

    python benchmarks/bench_offload.py --hidden 2048 --layers 8 --seq-len 2048 --micro-batch 8 --out /tmp/offload
    python benchmarks/bench_offload.py --quick --out /tmp/offload     # CPU smoke test with the small torch GPT

Every shape is a section of one file: ``--section NAME`` writes (or, with ``--merge``, adds to) that section of
``<out>/bench_offload.json`` and leaves the others as they are; ``bench_offload.png`` draws every section, a
panel each. The GPU suites' sections: ``h2048`` (the GPT above), ``llama``, ``hide``, ``long``, ``8b``,
``8b_capacity``, ``8b_pool``, ``8b_pool_capacity`` (docs/performance.md says what each is).

Capacity: ``--micro-batches`` and ``--seq-lens`` run configs at several sizes (rows ``config@mbN``,
``config@seqN``; a run out of memory, without a plan under its budget or out of time is an error row, and the
config's larger sizes in that round are not run), and the JSON gives the largest each trained (``limit_found``:
a larger one did not fit; ``failed_otherwise_at``: one ran out of time) and each dsx config's tokens/s at the
largest the best of the others trained.
``--gpu-memory-gb`` caps the process's use of the GPU, so that a larger card answers for a smaller one, and
``--fit-budget`` gives dsx the whole capped card: the cap less the static memory the rows before it measured (the
least of them) and less ``--fit-reserve-gb``:

    python benchmarks/bench_offload.py --model llama --offload-optimizer --gpu-memory-gb 85 --fit-budget \
        --configs recompute dsx_auto_budget_sel --seq-lens 32768,65536

``--memory-history DIR`` (CUDA) records the allocator over the measured steps and writes what is allocated at
their peak, grouped by the line that allocated it (``_memory_trace.py``): where a plan's measured peak and its
prediction part, this says which tensors make the difference; a step that runs out of memory writes what was
live when it did (``..._oom.json``). ``--memory-history-from start`` records from the first step on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _kernel_trace
import _memory_trace
from _common import (
    HelpFormatter,
    add_common_args,
    device_name,
    environment,
    host_probe_s,
    is_peer,
    median_runs,
    read_sections,
    save_sections_png,
    section_name,
    utc_now,
    write_section,
)
from _hook_offload import SavedTensorOffload
from _megatron_offload import (
    OFFLOAD_SETS,
    hold_te_offload_flag,
    offload_bytes,
    release_offload,
    reset_offload,
    start_offload_step,
)

import dsx
from dsx.models.gpt import GPT, GPTConfig
from dsx.models.llama import Llama, LlamaConfig
from dsx.models.megatron_gpt import build_megatron_gpt, build_megatron_llama, megatron_available
from dsx.runtime import allocator
from dsx.runtime.bandwidth import measure_file_bandwidth
from dsx.runtime.events import EVENT_WAIT_MODES
from dsx.runtime.process import single_process_env

CONFIGS = [
    "none", "recompute", "megatron_selective", "save_on_cpu", "hooks_offload", "ds_cpu_ckpt", "dsx_host", "dsx_host_sel",
    "dsx_ssd", "dsx_ssd_noverify", "dsx_ssd_sel", "dsx_auto_budget", "dsx_auto_budget_sel", "dsx_auto_budget_host",
    "dsx_auto_budget_host_sel", "dsx_auto_hide", "dsx_auto_hide_sel", "none_copies",
]  # fmt: skip
# megatron-core's fine-grained activation offloading of one set of sub-modules (llama model, megatron on a GPU;
# _megatron_offload.py): asked for by name, not in the default list
MEGATRON_OFFLOAD = [f"megatron_offload_{k}" for k in OFFLOAD_SETS]
# dsx_auto_budget profiled with the layers' inputs on the host (profile_mode "recompute+host"; those the host pool
# has no room for go to the SSD tier): for lengths whose profiling under full recompute does not fit; with _host,
# the host tier alone (what the SSD tier adds beside a capped pool); asked for by name
PROFILE_HOST = [
    "dsx_auto_budget_hp",
    "dsx_auto_budget_hp_sel",
    "dsx_auto_budget_host_hp",
    "dsx_auto_budget_host_hp_sel",
]
ALL_CONFIGS = CONFIGS + MEGATRON_OFFLOAD + PROFILE_HOST
# configs whose steps take seconds (bandwidth-bound copies): fewer steps, same warm-up rule
SLOW = ("save_on_cpu", "hooks_offload", "dsx_ssd", "dsx_ssd_noverify", "dsx_ssd_sel", "dsx_host")
NEEDS_BUDGET = (
    "dsx_auto_budget",
    "dsx_auto_budget_sel",
    "dsx_auto_budget_host",
    "dsx_auto_budget_host_sel",
    *PROFILE_HOST,
)


def _ds_config(
    micro: int,
    bf16: bool,
    dsx_section: dict[str, Any] | None,
    offload_optimizer: bool = False,
    trace_path: str | None = None,
    event_wait: str | None = None,
    adam: str = "foreach",
) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 1}
    if offload_optimizer:  # ZeRO-2 with the optimizer (fp32 master, Adam moments, step) on the CPU
        zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    params: dict[str, Any] = {"lr": 1e-4, "torch_adam": not offload_optimizer}
    if adam == "fused" and not offload_optimizer:
        # torch's fused AdamW updates in one kernel; foreach's temporaries are as large as the fp32 master
        # weights (ZeRO-1 keeps them as one flat buffer), and on a large model they, not activations, set the
        # step's peak
        params["fused"] = True
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if dsx_section:
        cfg["dsx"] = {"activation_offload": dsx_section}
        sched: dict[str, Any] = {"event_wait": event_wait} if event_wait else {}
        if trace_path:
            sched.update({"enabled": True, "trace_path": trace_path, "trace_steps": 3})
        if sched:
            cfg["dsx"]["scheduler"] = sched
    return cfg


def _trace_path(args: argparse.Namespace, name: str) -> str | None:
    return None if args.trace is None else str(Path(args.trace) / f"trace_{name}{_size_tag(args)}.json")


def _megatron(args: argparse.Namespace) -> bool:
    return not args.quick and megatron_available()[0]


def _llama_config(args: argparse.Namespace) -> LlamaConfig:
    # FFN width as Llama-3's 14336 for hidden 4096 (3.5x), a multiple of 256, unless given
    ffn = args.ffn_hidden or -(-int(3.5 * args.hidden) // 256) * 256
    return LlamaConfig(vocab_size=args.vocab, seq_len=args.seq_len, layers=args.layers, hidden=args.hidden,
                       heads=args.heads, kv_heads=args.kv_heads or max(1, args.heads // 4), ffn_hidden=ffn)  # fmt: skip


def _model(args: argparse.Namespace, name: str) -> torch.nn.Module:
    granularity = "selective" if name == "megatron_selective" else None
    if args.model == "llama":
        cfg = _llama_config(args)
        if name in MEGATRON_OFFLOAD:
            modules = OFFLOAD_SETS[name.removeprefix("megatron_offload_")]
            return build_megatron_llama(cfg, seed=0, bf16=True, offload_modules=modules,
                                        offload_fraction=args.megatron_offload_fraction)  # fmt: skip
        if _megatron(args):
            return build_megatron_llama(cfg, seed=0, bf16=True, recompute_granularity=granularity)
        return Llama(cfg, seed=0)
    if _megatron(args):
        return build_megatron_gpt(args.layers, args.hidden, args.heads, args.seq_len, args.vocab, seed=0, bf16=True,
                                  recompute_granularity=granularity)  # fmt: skip
    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq_len, layers=args.layers, hidden=args.hidden, heads=args.heads
    )
    return GPT(cfg, seed=0)


def _sel_module(args: argparse.Namespace) -> str:
    """What the ``_sel`` configs name in ``recompute_modules``. The GPT: its core attention, which megatron's
    selective recompute recomputes too (unfused, it saves the ``[b, heads, s, s]`` scores). The Llama decoder:
    its SwiGLU activation, which drops two FFN-wide tensors a layer (megatron-core's unit; one in the plain-torch
    model) for an elementwise pass; recomputing its flash core attention would drop one hidden-wide tensor for
    a second attention forward."""
    if args.model == "llama":
        return "SwiGLUActivation"
    return "DotProductAttention" if _megatron(args) else "Attention"


def _section(
    name: str,
    ssd_dir: str,
    budget_gb: float | None,
    pool_gb: float,
    ssd_gb: float,
    sel_module: str,
    read_pool: str = "auto",
    write_barrier: str = "auto",
    io_backend: str = "auto",
) -> dict[str, Any] | None:
    base = {"enabled": True, "min_tensor_bytes": 1 << 16, "host_pool_gb": pool_gb, "ssd_capacity_gb": ssd_gb,
            "read_pool": read_pool, "io_backend": io_backend}  # fmt: skip
    if name.endswith("_sel"):
        base["recompute_modules"] = [sel_module]
        name = name.removesuffix("_sel")
    barrier = {"write_barrier": write_barrier}  # (read by the policies that move bytes)
    auto = {"policy": "auto", **barrier}
    return {
        "recompute": {**base, "policy": "recompute_all"},
        "dsx_host": {**base, **barrier, "policy": "offload_all", "tiers": ["host"]},
        "dsx_ssd": {**base, **barrier, "policy": "offload_all", "tiers": ["ssd"], "ssd_path": ssd_dir},
        # the same without the default integrity check of SSD reads: what verifying costs
        "dsx_ssd_noverify": {**base, **barrier, "policy": "offload_all", "tiers": ["ssd"], "ssd_path": ssd_dir,
                             "verify": False},
        "ds_cpu_ckpt": None,
        "dsx_auto_budget": {**base, **auto, "tiers": ["host", "ssd"], "ssd_path": ssd_dir,
                            "memory_budget_gb": budget_gb},
        # the same with the host tier alone: what the SSD tier adds beside a capped host pool
        "dsx_auto_budget_host": {**base, **auto, "tiers": ["host"], "memory_budget_gb": budget_gb},
        "dsx_auto_budget_hp": {**base, **auto, "tiers": ["host", "ssd"], "ssd_path": ssd_dir,
                               "memory_budget_gb": budget_gb, "profile_mode": "recompute+host"},
        "dsx_auto_budget_host_hp": {**base, **auto, "tiers": ["host"], "memory_budget_gb": budget_gb,
                                    "profile_mode": "recompute+host"},
        "dsx_auto_hide": {**base, **auto, "tiers": ["host", "ssd"], "ssd_path": ssd_dir},
    }.get(name)  # fmt: skip


def _history_path(args: argparse.Namespace, name: str, budget_gb: float | None, suffix: str = "") -> Path:
    """``--memory-history``'s file for a config: one per budget (a config runs at several: --budget-scales)
    and size."""
    tag = f"_budget{budget_gb:.2f}gib" if budget_gb is not None else ""
    return Path(args.memory_history) / f"memory_{name}{tag}{_size_tag(args)}{suffix}.json"


def run_one(name: str, args: argparse.Namespace, ssd_dir: str, budget_gb: float | None) -> dict[str, Any]:
    if name == "megatron_selective" and not _megatron(args):
        raise RuntimeError(f"megatron_selective needs megatron-core on a GPU ({megatron_available()[1]})")
    megatron_offload = name in MEGATRON_OFFLOAD
    if megatron_offload and not (_megatron(args) and args.model == "llama"):
        raise RuntimeError(
            f"{name} needs --model llama, no --quick, and megatron-core on a GPU ({megatron_available()[1]})"
        )
    te_flag_held = hold_te_offload_flag() if megatron_offload else None
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if args.gpu_memory_gb is not None and dev.type == "cuda":
        _cap_device_memory(dev, args.gpu_memory_gb)
    if name == "ds_cpu_ckpt" and dev.type != "cuda":
        # DeepSpeed copies a checkpointed input "to the host" and then empties the input: on a CPU device
        # the copy is the input itself, so backward would find nothing
        raise RuntimeError("ds_cpu_ckpt needs a GPU: DeepSpeed's cpu_checkpointing loses its inputs on a CPU")
    model = _model(args, name)
    bf16 = dev.type == "cuda"
    section = _section(name, ssd_dir, budget_gb, args.pool_gb, args.ssd_gb, _sel_module(args), args.read_pool,
                       args.write_barrier, args.io_backend)  # fmt: skip
    if name == "ds_cpu_ckpt":
        _deepspeed_checkpointing(model)
    engine, _, _, _ = dsx.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=_ds_config(
            args.micro_batch,
            bf16,
            section,
            args.offload_optimizer,
            _trace_path(args, name),
            args.event_wait,
            args.adam,
        ),
    )
    copies = None
    if name == "none_copies":
        if args.copy_gb is None:
            raise RuntimeError(
                "none_copies needs --copy-gb, or a dsx_auto_hide run before it in the same invocation"
            )
        # hooked after the engine's own: DeepSpeed's forward pre-hook synchronizes the device (its throughput
        # timer), which would otherwise wait for this step's copies before the forward's first kernel
        copies = _BackgroundCopies(model, dev, int(args.copy_gb * 1e9))
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len + 1), generator=gen).to(engine.device)
    inp, tgt = x[:, :-1], x[:, 1:]
    ctx = {
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=dev.type == "cuda"),
        "hooks_offload": lambda: SavedTensorOffload(min_bytes=1 << 16),
    }.get(name, contextlib.nullcontext)

    if megatron_offload:
        reset_offload()  # (its first step records the groups; the warm-up covers it)

    def train_step(eng: Any) -> torch.Tensor:  # the engine is passed: run_one deletes its name at the end
        if megatron_offload:
            start_offload_step()
        with ctx():
            loss = eng(inp, tgt)
        eng.backward(loss)
        eng.step()
        return loss

    times: list[float] = []
    losses: list[float] = []
    base = peak = peak_total = 0
    allocator_base: dict[str, int] = {}
    per_step: list[tuple[float, float]] = []  # (allocated at the step's start, its peak above that), GB
    # the measured steps' wall-clock window (Unix time): to match samples taken beside the run (GPU clocks)
    window = [0.0, 0.0]
    n_steps = min(args.steps, 2) if name in SLOW else args.steps
    # policy auto: the warm-up also covers the profiled step and the plan's settling (_SettledWarmup), so that
    # the measured steps run the plan that settled
    warmup = args.warmup
    auto = None
    if megatron_offload:  # megatron's first step records its groups and offloads every one of them
        warmup = max(warmup, 1)
    if name.startswith("dsx_auto"):
        from dsx.config import ActivationOffloadConfig
        from dsx.offload import MAX_CALIBRATIONS

        # at most: the planner's own warm-up steps, the profiled one, the re-plans
        warmup = max(warmup, ActivationOffloadConfig().profile_warmup_steps) + 1 + MAX_CALIBRATIONS
        auto = _SettledWarmup(
            dsx.runtime_of(engine).features["activation_offload"].offload, args.warmup, warmup
        )
    gc_clock = _GcClock()
    host_probe = [host_probe_s()]  # the host CPU's speed before and after the measured steps
    step = -1
    while (step := step + 1) < warmup + n_steps:
        if step == warmup:
            gc_clock.start()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            if step == warmup:
                base = torch.cuda.memory_allocated()
                allocator_base = _allocator_counts()
            if args.memory_history and step == (0 if args.memory_history_from == "start" else warmup):
                _memory_trace.start()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
        if step == warmup:
            window[0] = time.time()
        t0 = time.perf_counter()
        try:
            loss = train_step(engine)
        except torch.OutOfMemoryError:
            if args.memory_history and (args.memory_history_from == "start" or step >= warmup):
                # what held the memory when the step ran out (the trace's end, not its peak: one large
                # request can fail below an earlier peak)
                _memory_trace.stop_and_write(
                    str(_history_path(args, name, budget_gb, "_oom")),
                    f"{name} out of memory at step {step}",
                    "end",
                )
            raise
        if dev.type == "cuda":
            torch.cuda.synchronize()
            per_step.append((start / 1e9, (torch.cuda.max_memory_allocated() - start) / 1e9))
            if step >= warmup:
                peak = max(peak, torch.cuda.max_memory_allocated() - base)
                peak_total = max(peak_total, torch.cuda.max_memory_allocated())
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
            window[1] = time.time()
        # on stderr, which a child that runs past its time limit leaves in its row: how far it got
        print(f"{name}: step {step + 1}/{warmup + n_steps} ({'measured' if step >= warmup else 'warm-up'}) "
              f"{time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)  # fmt: skip
        if auto is not None:
            warmup = auto.step_ended(step)
    gc_clock.stop()
    host_probe.append(host_probe_s())
    # what the peak is made of (CUDA): the weights, what else persists between steps (gradient buffers and
    # optimizer state as DeepSpeed keeps them), and what the step adds at its peak (saved activations,
    # workspace, the backward's gradients): whether activations set the peak
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cuda")
    breakdown = (
        {"weights": weights / 1e9, "gradients_and_optimizer_state": (base - weights) / 1e9,
         "step_peak_above_static": peak / 1e9, "total": peak_total / 1e9}
        if dev.type == "cuda" else None
    )  # fmt: skip
    memory = None
    if args.memory_history and dev.type == "cuda":
        path = _history_path(args, name, budget_gb)
        memory = _memory_trace.stop_and_write(str(path), f"{name} micro-batch {args.micro_batch}")
        memory = {"path": str(path), "peak_bytes_since_recording": memory["peak_bytes_since_recording"]}
    alloc_counts = _allocator_counts() if dev.type == "cuda" else {}
    alloc_counts = {k: (v - allocator_base.get(k, 0)) / n_steps for k, v in alloc_counts.items()}
    rt = dsx.runtime_of(engine)
    telemetry = rt.scheduler.telemetry.summary() if rt and rt.scheduler else {}
    if rt and rt.scheduler:  # bytes written per measured step (the summary averages warm-up steps in)
        # every device-to-host copy counts under "host", an SSD tier's too ("ssd" counts those a second time,
        # when the file write lands): "host" alone is what left the device
        telemetry["written_gb_per_measured_step"] = [
            r.bytes_by_tier.get("host", 0) / 1e9 for r in rt.scheduler.telemetry.history[-n_steps:]
        ]
        # what the measured steps waited for (write barrier, reads at unpack, gates), seconds per step
        telemetry["stall_by_measured_step"] = [r.stall_by for r in rt.scheduler.telemetry.history[-n_steps:]]
        # how long the GPU itself waited (CUDA events): for reads' copies and idle while the host waited for a read
        # ("unpack"), idle at the write barrier; s per step
        telemetry["gpu_wait_by_measured_step"] = [
            r.gpu_wait_by for r in rt.scheduler.telemetry.history[-n_steps:]
        ]
        # activation offload's host time in its hooks (see StepRecord.hook_s), s per step
        telemetry["hook_s_by_measured_step"] = [r.hook_s for r in rt.scheduler.telemetry.history[-n_steps:]]
    plan = None
    if rt and "activation_offload" in rt.features:
        off = rt.features["activation_offload"].offload
        if getattr(off, "plan", None) is not None:
            plan = {"actions": [a.value for a in off.plan.actions], "bound": off.plan.bound,
                    "predicted_step_s": off.plan.predicted_step_s,
                    "predicted_total_step_s": off.plan.predicted_total_step_s, "predicted_peak_gb": off.plan.peak_bytes / 1e9,
                    "predicted_step_peak_gb": off.plan.predicted_step_peak_bytes / 1e9,
                    "write_barrier_waits": [len(off.plan.write_barrier), len(off.plan.write_barrier_bwd)],
                    "profiles": [dataclasses.asdict(p) for p in off.plan.profiles]}  # fmt: skip
    read_pool = None  # the pool dsx's reads used ("auto" resolved)
    barrier = None  # whether the write barrier was installed (the host waits for moved bytes to leave)
    ssd_io = None  # the backend the SSD tier's file opened with ("auto" resolved; None: no SSD tier)
    if rt and "activation_offload" in rt.features:
        read_pool = rt.features["activation_offload"].offload.mover.read_pool
        ssd = rt.features["activation_offload"].offload.mover.ssd
        ssd_io = ssd.io.name if ssd is not None else None
        hooks = rt.features["activation_offload"].offload.hooks
        barrier = bool(hooks.write_barrier or hooks.write_barrier_bwd)
    # the event_wait mode ("auto" resolved; None: a dsx without the setting, which spins)
    waiter = getattr(rt.scheduler, "waiter", None) if rt and rt.scheduler else None
    # whether the steps ran with expandable allocator segments (dsx restores the setting at close)
    expandable = dev.type == "cuda" and allocator.expandable_segments()
    kernel_trace = None
    if args.kernel_trace and dev.type == "cuda":  # one more step, after the measured ones, under the profiler
        from torch.profiler import ProfilerActivity, profile

        path = Path(args.kernel_trace) / f"ktrace_{name}{_size_tag(args)}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            train_step(engine)
            torch.cuda.synchronize()
            traced_s = time.perf_counter() - t0
        prof.export_chrome_trace(str(path))
        kernel_trace = {"path": str(path), "step_s": traced_s, **_kernel_trace.summarize(path)}
    offloaded = None
    if megatron_offload:
        offloaded = offload_bytes()
        release_offload()
    if rt:
        rt.close()
    copied_gb = None
    if copies is not None:
        copies.remove()
        copied_gb = copies.per_step_gb
    del engine, model, copies
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    step_s = statistics.median(times)
    return {"config": name, "step_s": step_s, "tokens_per_s": args.micro_batch * args.seq_len / step_s,
            "activation_peak_gb": peak / 1e9, "peak_allocated_gb": peak_total / 1e9, "peak_breakdown_gb": breakdown,
            "memory_per_step_gb": per_step, "losses": losses, "telemetry": telemetry, "plan": plan,
            "allocator_per_step": alloc_counts, "read_pool": read_pool, "write_barrier": barrier, "ssd_io_backend": ssd_io, "event_wait": waiter.mode if waiter else None,
            "expandable_segments": expandable, "warmup_steps": warmup,
            "measured_window_unix": window, "step_times_s": times, "gc_in_measured_steps": gc_clock.summary(),
            "host_probe_s": host_probe, "dsx_path": str(Path(dsx.__file__).parent),
            **({"copied_gb_per_step": copied_gb} if copied_gb is not None else {}),
            **({"megatron_offload": {"modules": OFFLOAD_SETS[name.removeprefix("megatron_offload_")],
                                     "fraction": args.megatron_offload_fraction, "bytes_per_group": offloaded,
                                     "te_flag_holder": te_flag_held}} if megatron_offload else {}),
            **({"kernel_trace": kernel_trace} if kernel_trace else {}),
            **({"checksum_GBps": _checksum_GBps(dev)} if name.startswith("dsx_ssd") else {}),
            **({"memory_trace": memory} if memory else {})}  # fmt: skip


def _checksum_GBps(dev: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """How fast the device checksums the bytes an SSD entry moves (dsx.offload.checksum), median of
    ``repeats``: with the bytes verified per step, what verifying costs the device per step."""
    from dsx.offload.checksum import checksum

    buf = torch.randint(0, 256, (nbytes if dev.type == "cuda" else 1 << 24,), dtype=torch.uint8, device=dev)
    checksum(buf)  # (warm-up)
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        checksum(buf)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return buf.numel() / statistics.median(times) / 1e9


class _BackgroundCopies:
    """Bytes moved the way a hide-only plan moves them, without dsx: device-to-host copies queued on a side
    stream as each forward starts, host-to-device copies on another as its backward starts, between scratch
    buffers that no kernel of the model touches.

    Against no offload this is what the copies alone cost the step (the device memory they read and write,
    the copy engines, pinned-memory traffic on the host) with no saved-tensor hooks and no host work beyond
    ``chunks`` calls per direction; against ``dsx_auto_hide`` moving the same bytes, what dsx adds to them.
    The copies start at once rather than as tensors are saved, so the link is busy from the forward's start
    for ``nbytes`` over its bandwidth (about the forward, for a plan at its bound), and reads run in the
    first part of the backward, as a prefetch ahead of each layer does. On the CPU they are plain copies.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, nbytes: int, chunks: int = 4) -> None:
        from dsx.offload import tensors_of

        self._tensors = tensors_of
        per = -(-nbytes // chunks // (1 << 21)) * (1 << 21)  # one chunk's bytes, rounded up to 2 MiB
        cuda = device.type == "cuda"
        gen = torch.Generator(device=device).manual_seed(1)
        # random bytes, never zeros: a link or engine that compresses would otherwise be measured idle
        self.src = torch.randint(0, 256, (per,), dtype=torch.uint8, device=device, generator=gen)
        self.dst = torch.empty_like(self.src)
        self.host = [torch.empty(per, dtype=torch.uint8, pin_memory=cuda) for _ in range(chunks)]
        self.streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else (None, None)
        self.per_step_gb = per * chunks / 1e9
        self._handles = [
            model.register_forward_pre_hook(self._forward_starts),
            model.register_forward_hook(self._forward_ends),
        ]

    def _queue(self, to_host: bool) -> None:
        stream = self.streams[0 if to_host else 1]
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for h in self.host:
                (h.copy_(self.src, non_blocking=True) if to_host else self.dst.copy_(h, non_blocking=True))

    def _forward_starts(self, module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self._queue(to_host=True)

    def _forward_ends(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        y = next((t for t in self._tensors(out) if t.requires_grad), None)
        if torch.is_grad_enabled() and y is not None:  # fires as the backward starts
            y.register_hook(lambda g: self._queue(to_host=False))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        if self.streams[0] is not None:
            torch.cuda.synchronize()


class _GcClock:
    """Python's cyclic collections during the measured steps, per generation, and the seconds they took: a
    full collection stops the host thread that queues the GPU's work."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = 0.0
        self._t0 = 0.0

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._t0

    def start(self) -> None:
        gc.callbacks.append(self._cb)

    def stop(self) -> None:
        if self._cb in gc.callbacks:
            gc.callbacks.remove(self._cb)

    def summary(self) -> dict[str, Any]:
        return {"collections_by_generation": self.count, "seconds": self.seconds}


def _allocator_counts() -> dict[str, int]:
    """The caching allocator's counters that cost time: retries (a failed allocation frees every cached
    block, synchronising the device, and tries again) and cudaMalloc/cudaFree calls."""
    stats = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams", "num_ooms")
    return {k: int(stats.get(k, 0)) for k in keys}


def _deepspeed_checkpointing(model: torch.nn.Module, in_cpu: bool = True) -> None:
    """DeepSpeed's activation checkpointing with ``cpu_checkpointing`` around every layer: full recompute,
    the layer inputs it keeps moved to the host by DeepSpeed's ``_ActivationOffloadEngine`` (``in_cpu=False``:
    kept on the device, DeepSpeed's plain activation checkpointing)."""
    import deepspeed
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

    from dsx.offload import find_layers

    ds_ckpt.configure(None, partition_activations=False, checkpoint_in_cpu=in_cpu)
    for layer in find_layers(model, None):
        orig = layer.forward

        def fwd(*a: Any, _orig: Any = orig, **kw: Any) -> Any:
            if not torch.is_grad_enabled():
                return _orig(*a, **kw)
            # DeepSpeed's CPU checkpointing empties every floating-point input it offloads, in place. Inputs
            # that need no gradient (a rotary table: one tensor shared by every layer) are captured, so that
            # the next layer still finds them; those that do (the hidden states, positional or by keyword) go
            # through the checkpoint, so that gradients reach the layers before.
            args = [(i, v) for i, v in enumerate(a)] + list(kw.items())
            moving = [(k, v) for k, v in args if torch.is_tensor(v) and v.requires_grad]
            fixed = dict((k, v) for k, v in args if not (torch.is_tensor(v) and v.requires_grad))
            nested = [k for k, v in fixed.items() if isinstance(v, (list, tuple, dict)) and any(
                torch.is_tensor(t) and t.requires_grad for t in (v.values() if isinstance(v, dict) else v))]  # fmt: skip
            if nested:
                raise TypeError(f"ds_cpu_ckpt: inputs {nested} hold tensors that need gradients inside a container; "
                                "DeepSpeed's checkpoint would not pass gradients to them")  # fmt: skip
            if not moving:  # nothing for a gradient to flow through: a checkpoint would cut the layer off
                return _orig(*a, **kw)

            def run(*xs: Any) -> Any:
                given = {**fixed, **{k: x for (k, _), x in zip(moving, xs)}}
                return _orig(*(given[i] for i in range(len(a))), **{k: given[k] for k in kw})

            return deepspeed.checkpointing.checkpoint(run, *(v for _, v in moving))

        layer.forward = fwd


RESULT_TAG = "BENCH_OFFLOAD_RESULT "


def _cap_device_memory(dev: torch.device, gb: float) -> None:
    """Let this process use at most ``gb`` (10^9 bytes) of ``dev``'s memory: a larger card runs as a smaller one
    (an H200 as an H100 80GB: 85 GB, its 79.2 GiB), so that what fits is the smaller card's. Whatever already
    holds the device's memory outside this process's allocator (its CUDA context, libraries' handles, other
    processes on the device) comes out of the smaller card's memory too, so torch's share is ``gb`` less that;
    what libraries allocate later outside torch's allocator (NCCL's buffers) is not counted, a small bias
    toward fitting."""
    # (the fraction's setter needs an index)
    index = torch.cuda.current_device() if dev.index is None else dev.index
    free, total = torch.cuda.mem_get_info(index)
    outside = total - free - torch.cuda.memory_reserved(index)
    if gb * 1e9 > total:
        raise ValueError(f"--gpu-memory-gb {gb:g} is more than this GPU's {total / 1e9:.1f} GB")
    torch.cuda.set_per_process_memory_fraction(max(0.0, gb * 1e9 - outside) / total, index)


def _fit_budget_gb(results: list[dict[str, Any]], args: argparse.Namespace, mb: int) -> float | str:
    """``--fit-budget``: the activation budget (GB) that fills the GPU: ``--gpu-memory-gb`` less the static
    memory (weights, gradients, optimizer state: ``peak_breakdown_gb``) the rows so far measured at micro-batch
    ``mb`` (the least of them; it does not depend on the sequence length) less ``--fit-reserve-gb``; or why there
    is none."""
    if args.gpu_memory_gb is None:
        return "--fit-budget needs --gpu-memory-gb (the memory the budget fills)"
    # the least any row held: what a strategy keeps between steps beyond the model and its optimizer
    # (cpu_checkpointing's host staging buffers on the device) is that strategy's, not the budget's
    static = min(
        (b["weights"] + b["gradients_and_optimizer_state"] for r in results
         if "error" not in r and r.get("micro_batch") == mb and (b := r.get("peak_breakdown_gb"))),
        default=None,
    )  # fmt: skip
    if static is None:
        return f"--fit-budget needs a row measured before it at micro-batch {mb} (GPU run): list a peer first"
    budget = args.gpu_memory_gb - static - args.fit_reserve_gb
    if budget <= 0:
        return f"--fit-budget: the static {static:.1f} GB and the reserve leave no room in {args.gpu_memory_gb:g} GB"
    return budget


class _SettledWarmup:
    """Policy auto's warm-up (``off``: its ``ActivationOffload``): at least ``floor`` steps (``--warmup``), at most
    ``ceiling`` (its own warm-up, the profiled step and every re-plan its calibration may make). It ends after the
    first step at whose end the plan has settled (planned, its calibration measuring no more steps) and has run
    a step since it was installed: the measured steps run the plan that settled, and none is its first. A step
    at a long sequence is long: the re-plans that did not happen should not cost the run their steps."""

    def __init__(self, off: Any, floor: int, ceiling: int) -> None:
        self.off, self.floor, self.steps = off, floor, ceiling
        self._last: Any = None  # the plan in force at the previous step's end

    def step_ended(self, step: int) -> int:
        """Step ``step`` (from 0) has ended: the warm-up's length in steps, now."""
        plan = self.off.plan
        ran, self._last = plan is not None and plan is self._last, plan
        if ran and not self.off.calibration.pending and self.floor <= step + 1 < self.steps:
            self.steps = step + 1
        return self.steps


def _init_distributed() -> None:
    single_process_env()
    import deepspeed

    # megatron-core's model parallel state needs the process group before the model is built.
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def _guarded(name: str, args: argparse.Namespace, ssd: str, budget: float | None) -> dict[str, Any]:
    """Run one config; an exception is recorded, not raised: one failing strategy must not hide the others."""
    try:
        return run_one(name, args, ssd, budget)
    except Exception as exc:
        import traceback

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"config": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                "where": traceback.format_exc(limit=-12)[-3000:]}  # fmt: skip


def _child(name: str, argv: list[str], budget: float | None, timeout_s: float) -> dict[str, Any]:
    """Run one config in a fresh process: its memory peak is its own, whatever the others left behind."""
    import subprocess

    cmd = [sys.executable, __file__, *argv, "--one", name]
    if budget is not None:
        cmd += ["--budget-gb", str(budget)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        # what it had printed, both streams (its plan and warnings go to stderr): how far it got
        out = "".join(
            s.decode(errors="replace") if isinstance(s, bytes) else s or "" for s in (exc.stdout, exc.stderr)
        )
        return {"config": name, "error": f"timed out after {timeout_s:g} s", "where": out[-3000:]}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            res = json.loads(line[len(RESULT_TAG) :])
            # the planner prints its plan on stderr: keep it with the result
            plan_at = proc.stderr.find("dsx activation offload plan")
            if plan_at >= 0:
                res["plan_log"] = proc.stderr[plan_at : plan_at + 8000]
            return res
    tail = (proc.stdout + proc.stderr)[-800:]
    return {"config": name, "error": f"child exited {proc.returncode} without a result", "where": tail,
            "returncode": proc.returncode}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_common_args(p)
    p.add_argument("--configs", nargs="+", default=CONFIGS, choices=ALL_CONFIGS,
                   help=f"strategies; also, by name: {', '.join(MEGATRON_OFFLOAD)} (megatron-core's fine-grained "
                        "activation offloading of those sub-modules, --model llama on a GPU)")  # fmt: skip
    p.add_argument("--megatron-offload-fraction", type=float, default=1.0,
                   help="megatron_offload_*: megatron's activation_offload_fraction")  # fmt: skip
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--model", choices=["gpt", "llama"], default="gpt",
                   help="gpt: the default GPT; llama: RMSNorm, RoPE, grouped-query attention, SwiGLU "
                        "(megatron-core with SDPA core attention on a GPU, dsx.models.Llama elsewhere)")  # fmt: skip
    p.add_argument("--kv-heads", type=int, default=None, help="llama: key/value heads (default heads / 4)")
    p.add_argument("--ffn-hidden", type=int, default=None,
                   help="llama: FFN width (default 3.5 x hidden rounded up to 256, Llama-3's ratio)")  # fmt: skip
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=256,
                   help="vocabulary size: the default keeps the head negligible beside the layers; Llama-3's "
                        "128256 gives the head (its logits and loss) its real share of time and memory")  # fmt: skip
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--micro-batches", nargs="+", default=None, metavar="[CONFIG=]N[,N...]",
                   help="micro-batches to run (rows named config@mbN), for every config or for one "
                        "(e.g. none=14,15,16 recompute=32,48): the largest that trains without dsx against the "
                        "largest dsx makes room for")  # fmt: skip
    p.add_argument("--seq-lens", nargs="+", default=None, metavar="[CONFIG=]N[,N...]",
                   help="sequence lengths to run (rows named config@seqN), for every config or for one: the "
                        "longest each trains, and each dsx config's tokens/s at the longest the best of the "
                        "others trains (with --auto-budget-gb, a fixed budget at every length)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every config, interleaved (the JSON gives each config's median and spread)")  # fmt: skip
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--name", default="bench_offload",
                   help="the result file, <out>/<name>.json and .png (a benchmark built on this one names its own)")  # fmt: skip
    p.add_argument("--section", default="default", type=section_name,
                   help="the file's section this run writes: one shape a section (the file's other sections are "
                        "kept)")  # fmt: skip
    p.add_argument("--merge", action="store_true",
                   help="add this run's rows to the section (same model and step settings), replacing "
                        "rows of the same name: a sweep too long for one job runs in parts, and a budget "
                        "relative to recompute's peak may use the earlier part's measurement")  # fmt: skip
    p.add_argument("--merge-repeat", action="store_true",
                   help="with --merge: keep the file's rows of the same name, so that this run's rows add repeats "
                        "to them (interleaved rounds too long for one job, one round a part)")  # fmt: skip
    p.add_argument("--pool-gb", type=float, default=40.0, help="host pool (and SSD file) size per config")
    p.add_argument("--ssd-gb", type=float, default=None,
                   help="SSD file size per config, if not --pool-gb: a host pool capped below what the SSD holds, "
                        "as when the ranks of a node share its memory")  # fmt: skip
    p.add_argument("--ssd-dir", default=None, help="directory on the SSD (default: a temporary directory)")
    p.add_argument("--budget-scales", type=float, nargs="+", default=[1.0],
                   help="budgets for the dsx_auto_budget configs, as multiples of full recompute's peak")  # fmt: skip
    p.add_argument("--in-process", action="store_true", help="run every config in this process")
    p.add_argument("--adam", choices=["foreach", "fused"], default="foreach",
                   help="torch AdamW's implementation on the GPU (fused: no update temporaries)")  # fmt: skip
    p.add_argument("--offload-optimizer", action="store_true",
                   help="ZeRO-2 with the optimizer offloaded to the CPU (DeepSpeedCPUAdam)")  # fmt: skip
    p.add_argument("--child-timeout", type=float, default=120.0, help="seconds per config (own process)")
    p.add_argument(
        "--one", choices=ALL_CONFIGS, help=argparse.SUPPRESS
    )  # a child: run one config, print JSON
    p.add_argument("--auto-budget-gb", type=float, default=None,
                   help="activation budget (GB) for the dsx_auto_budget configs, times --budget-scales, instead of "
                        "full recompute's peak at the same micro-batch (a micro-batch sweep past what fits)")  # fmt: skip
    p.add_argument("--fit-budget", action="store_true",
                   help="the dsx_auto_budget configs' budget fills --gpu-memory-gb: that less the static memory "
                        "(weights, gradients, optimizer state; the least the rows before them measured: list a "
                        "peer first), less --fit-reserve-gb (capacity: the longest sequence that trains)")  # fmt: skip
    p.add_argument("--fit-reserve-gb", type=float, default=2.0,
                   help="--fit-budget: GB left free for the allocator's fragmentation and the CUDA libraries")  # fmt: skip
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="CUDA: let each config's process use at most this many GB (10^9 bytes) of the GPU, what it "
                        "holds outside torch's allocator included, so that a larger card runs as a smaller one (85: "
                        "an H100 80GB's 79.2 GiB)")  # fmt: skip
    p.add_argument("--budget-gb", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--memory-history", default=None, metavar="DIR",
                   help="record the allocator over the measured steps (CUDA) and write what is live at their "
                        "peak, by allocating line, to DIR/memory_<config>_mb<N>.json (slows the steps)")  # fmt: skip
    p.add_argument("--memory-history-from", choices=["measured", "start"], default="measured",
                   help="--memory-history from the measured steps on, or from the first step (start); either "
                        "way a step that runs out of memory writes what was live then "
                        "(memory_<config>..._oom.json)")  # fmt: skip
    p.add_argument("--copy-gb", type=float, default=None,
                   help="none_copies: GB copied each way a step (default: what a dsx_auto_hide run before it in "
                        "this invocation wrote per measured step, its median)")  # fmt: skip
    p.add_argument("--read-pool", choices=["auto", "compute", "prefetch"], default="auto",
                   help="dsx configs: the read_pool setting (allocator pool of read buffers)")  # fmt: skip
    p.add_argument("--write-barrier", choices=["auto", "on", "off"], default="auto",
                   help="dsx configs that move bytes: the write_barrier setting (default: dsx's)")  # fmt: skip
    p.add_argument("--io-backend", choices=["auto", "kvikio", "aio", "posix"], default="auto",
                   help="dsx configs: the SSD tier's io_backend (auto: the best available)")  # fmt: skip
    p.add_argument(
        "--event-wait",
        choices=EVENT_WAIT_MODES,
        default=None,
        help="dsx configs: scheduler.event_wait (how I/O threads wait for copies; default: dsx's)",
    )
    p.add_argument("--kernel-trace", default=None, metavar="DIR",
                   help="CUDA: one more step after the measured ones under torch.profiler; its Chrome trace to "
                        "DIR/ktrace_<config>_mb<N>.json and a summary (GPU busy and idle, copies, host blocked in "
                        "CUDA calls) into the result")  # fmt: skip
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="dsx configs: the scheduler's timeline of the last steps (transfers, stalls) to "
                        "DIR/trace_<config>_mb<N>.json; `dsx trace` draws it")  # fmt: skip
    args = p.parse_args(argv)
    if args.fit_budget and args.auto_budget_gb is not None:
        p.error("--fit-budget and --auto-budget-gb both set the dsx_auto_budget configs' budget: give one")
    if args.fit_budget and (args.gpu_memory_gb is None or args.budget_scales != [1.0]):
        p.error("--fit-budget fills --gpu-memory-gb (give it) with one budget (no --budget-scales)")
    if args.gpu_memory_gb is not None and args.gpu_memory_gb <= 0:
        p.error(f"--gpu-memory-gb must be > 0, not {args.gpu_memory_gb:g}")
    if args.merge_repeat and not args.merge:
        p.error("--merge-repeat adds this run's rows to a file's: give --merge too")
    if args.memory_history_from != "measured" and not args.memory_history:
        p.error("--memory-history-from says when --memory-history records: give --memory-history DIR too")
    if args.fit_reserve_gb < 0:
        p.error(f"--fit-reserve-gb must be >= 0, not {args.fit_reserve_gb:g}")
    if args.adam == "fused" and args.offload_optimizer:
        p.error("--adam fused builds torch's AdamW on the GPU; --offload-optimizer uses DeepSpeed's CPU Adam")
    if args.quick:
        args.hidden, args.layers, args.heads, args.seq_len, args.micro_batch = 64, 2, 2, 32, 2
        args.warmup, args.steps, args.pool_gb = 2, 2, 0.25  # auto: its warm-up steps, then the profiled one
    if args.ssd_gb is None:  # the SSD file the pool's size, unless capped apart
        args.ssd_gb = args.pool_gb
    if not args.one:  # a file whose sections cannot be kept stops the run before its first config, not after
        read_sections(args.out, args.name)
    earlier, parts = _earlier(args) if args.merge and not args.one else ([], [])
    # each row names its part, and each part its device: rows merged from another machine are not comparable
    # with this run's (a part none of whose rows is left is marked superseded)
    device, part = device_name(), len(parts)
    parts.append(
        {"utc": utc_now(), "device": device, "configs": args.configs, "budget_scales": args.budget_scales}
    )
    elsewhere = sorted({p.get("device") for p in parts[:-1] if p.get("device") not in (None, device)})
    if elsewhere:
        print(f"bench_offload --merge: {args.name}.json's section {args.section!r} holds rows from {elsewhere}, "
              f"this run is on {device!r}: "
              "compare rows of one device only (each row's part names its device)", file=sys.stderr)  # fmt: skip
    new: list[dict[str, Any]] = []  # this run's rows
    results = [*earlier, *new]
    with tempfile.TemporaryDirectory(dir=args.ssd_dir) as ssd:
        if args.one:
            _init_distributed()
            print(RESULT_TAG + json.dumps(_guarded(args.one, args, ssd, args.budget_gb)), flush=True)
            return {}
        if args.in_process:
            _init_distributed()
        sizes = _per_config(args.micro_batches, args.micro_batch, "--micro-batches")
        seqs = _per_config(args.seq_lens, args.seq_len, "--seq-lens")
        # --repeats interleaves: every config once, then every config again, so that a drift of the machine
        # over the run falls on all of them alike
        runs = [
            (rep, name, scale, mb, seq)
            for rep in range(args.repeats)
            for name in args.configs
            for seq in seqs[name]
            for mb in sizes[name]
            for scale in (args.budget_scales if name in NEEDS_BUDGET else [1.0])
        ]
        # a config that failed at a size (out of memory, no plan under the budget, out of time) fails at larger
        # ones too: in that round they are not run (a capacity sweep's longest runs are its slowest)
        failed: dict[tuple[int, str, float], tuple[int, int]] = {}
        for rep, name, scale, mb, seq in runs:
            budget: float | None = None
            res: dict[str, Any] | None = None
            smaller = failed.get((rep, name, scale))
            if smaller is not None and seq >= smaller[0] and mb >= smaller[1]:
                res = {"config": name, "error": f"not run: failed at sequence {smaller[0]}, micro-batch "
                                                f"{smaller[1]} in this round", "not_run": True}  # fmt: skip
            elif name in NEEDS_BUDGET and args.fit_budget:
                fit = _fit_budget_gb(results, args, mb)
                if isinstance(fit, str):
                    res = {"config": name, "error": fit, "not_run": True}
                else:
                    budget = fit * 1e9 / 2**30
            elif name in NEEDS_BUDGET and args.auto_budget_gb is not None:
                budget = scale * args.auto_budget_gb * 1e9 / 2**30
            elif name in NEEDS_BUDGET:
                rec = next((r for r in results if r["config"].split("@")[0] == "recompute"
                            and r.get("micro_batch") == mb and r.get("seq_len") == seq and "error" not in r), None)  # fmt: skip
                if rec is None or rec["activation_peak_gb"] <= 0:
                    res = {"config": name, "error": f"needs a measured 'recompute' peak at micro-batch {mb}, "
                                                    f"sequence {seq} (GPU run)", "not_run": True}  # fmt: skip
                else:
                    budget = scale * rec["activation_peak_gb"] * 1e9 / 2**30
            if res is None:
                res = _run_one(name, args, argv, mb, seq, budget, results, ssd)
                if "error" in res:
                    failed[rep, name, scale] = (seq, mb)
            if scale != 1.0:
                res["config"] = f"{name}@{scale:g}x"
            res["micro_batch"], res["seq_len"] = mb, seq
            if args.micro_batches:
                res["config"] = f"{res['config']}@mb{mb}"
            if args.seq_lens:
                res["config"] = f"{res['config']}@seq{seq}"
            if budget is not None:
                res["budget_gb"] = budget * 2**30 / 1e9
            res["part"] = part
            new.append(res)
            # (a merged file's row of the same name is replaced by this run's, unless this one did not run or
            # --merge-repeat keeps both as repeats)
            if not res.get("not_run") and not args.merge_repeat:
                earlier = [r for r in earlier if r["config"] != res["config"]]
            results = [*earlier, *new]
            _write(results, args, parts)  # after every config: a run cut short still leaves its JSON
            print(
                json.dumps({k: v for k, v in res.items() if k not in ("losses", "telemetry", "plan")}),
                flush=True,
            )
    out = _write(results, args, parts)
    save_sections_png(read_sections(args.out, args.name), _draw, args.out, args.name)
    return out


def _run_one(
    name: str,
    args: argparse.Namespace,
    argv: list[str] | None,
    mb: int,
    seq: int,
    budget: float | None,
    results: list[dict[str, Any]],
    ssd: str,
) -> dict[str, Any]:
    """One config at one micro-batch and sequence length: in this process (``--in-process``) or its own."""
    run_args = argparse.Namespace(**{**vars(args), "micro_batch": mb, "seq_len": seq})
    if name == "none_copies" and args.copy_gb is None:
        run_args.copy_gb = _hide_written_gb(results, mb, seq)
    if args.in_process:
        res = _guarded(name, run_args, ssd, budget)
    else:
        child_argv = [
            *(argv if argv is not None else sys.argv[1:]),
            "--micro-batch",
            str(mb),
            "--seq-len",
            str(seq),
        ]
        if run_args.copy_gb is not None and args.copy_gb is None:
            child_argv += ["--copy-gb", str(run_args.copy_gb)]
        # bandwidth-bound configs (SSD on a slow disk, synchronous copies) get twice the time
        res = _child(name, child_argv, budget, args.child_timeout * (2 if name in SLOW else 1))
    if "error" not in res and res.get("telemetry", {}).get("bytes_by_tier", {}).get("ssd"):
        # the drive's own rate, measured beside every run whose measured steps wrote to it, as `dsx report --io`
        # measures it; the JSON sets the tier's rates against it
        res["drive_GBps"] = _drive_rates(ssd, 64 if args.quick else 2048)
    return res


def _size_tag(args: argparse.Namespace) -> str:
    """The sizes in a run's file names: its micro-batch, and its sequence length in a sequence sweep."""
    return f"_mb{args.micro_batch}" + (f"_seq{args.seq_len}" if args.seq_lens else "")


def _per_config(items: list[str] | None, default: int, flag: str) -> dict[str, list[int]]:
    """``--micro-batches`` / ``--seq-lens`` per config (ascending), ``default`` where they name none."""
    every: list[int] = []
    per: dict[str, list[int]] = {}
    for item in items or []:
        name, _, sizes = item.rpartition("=")
        if name and name not in ALL_CONFIGS:
            raise SystemExit(f"{flag}: unknown config {name!r}; choose from {ALL_CONFIGS}")
        (per.setdefault(name, []) if name else every).extend(int(v) for v in sizes.split(","))
    return {c: sorted(per.get(c) or every or [default]) for c in ALL_CONFIGS}


def _hide_written_gb(results: list[dict[str, Any]], mb: int, seq: int | None = None) -> float | None:
    """The median GB a step that this invocation's ``dsx_auto_hide`` run at micro-batch ``mb`` (and sequence
    length ``seq``, where given) wrote, if any."""
    for r in results:
        written = (r.get("telemetry") or {}).get("written_gb_per_measured_step")
        same = r.get("micro_batch") == mb and (seq is None or r.get("seq_len") == seq)
        if r["config"].split("@")[0] == "dsx_auto_hide" and same and written:
            return statistics.median(written)
    return None


def _does_not_fit(row: dict[str, Any]) -> bool:
    """Whether a failed run says that its size does not fit: CUDA out of memory, no dsx plan under the budget
    (``PlanError``), or its process killed (SIGKILL: the kernel's out-of-memory killer, when pinned host copies
    outgrow the host); not a timeout or another crash."""
    error = row["error"]
    return (
        "out of memory" in error.lower()
        or error.startswith("PlanError")
        or row.get("returncode") == -signal.SIGKILL
    )


def _largest(
    results: list[dict[str, Any]], key: str, tag: str, kinds: dict[int, str] | None = None
) -> dict[str, Any]:
    """Per config (its name without the ``@<tag>N`` part): the largest ``key`` (``micro_batch``, ``seq_len``)
    that trained in the rows tagged ``@<tag>``, and its median tokens/s there over the repeats; each dsx
    config's tokens/s against no offload's (the same other tags) at their largest; and ``at_best_peer``: the
    peer (a config not named ``dsx*``; not ``none_copies``, a diagnostic) that trained the largest (the faster
    one on a tie), and each dsx config's median tokens/s at that size against the peer's, and at every size both
    trained (``..._by_<key>``). ``limit_found``: a larger size of the config did not fit (out of memory, or no
    plan under its budget; else its largest is only the largest it was given); ``failed_otherwise_at``: the
    smallest larger size that failed for another reason (out of time: its limit is not known there).
    ``kinds``: each part's GPU kind, for files merged from more than one; a config's entry then names the kinds
    its runs came from (``gpus``), and no ratio compares runs of different kinds. Limits count failures of every
    kind: each process is held to one card's memory (``--gpu-memory-gb``), so lengths compare across kinds."""
    kinds = kinds or {}
    runs: dict[tuple[str, int], list[float]] = {}
    on: dict[tuple[str, int], set[str | None]] = {}  # the GPU kinds of each config's runs at each size
    failed: dict[str, int] = {}  # per config, its smallest size that did not fit
    other: dict[str, int] = {}  # and that failed otherwise
    for r in results:
        if f"@{tag}" not in r["config"]:
            continue
        name = re.sub(rf"@{tag}\d+", "", r["config"])
        if "error" in r:
            if r.get(key) is not None and not r.get("not_run"):  # (it ran and failed)
                into = failed if _does_not_fit(r) else other
                into[name] = min(into.get(name, r[key]), r[key])
            continue
        runs.setdefault((name, r[key]), []).append(r["tokens_per_s"])
        on.setdefault((name, r[key]), set()).add(kinds.get(r.get("part", 0)))
    tps = {k: statistics.median(v) for k, v in runs.items()}

    def alike(a: tuple[str, int], b: tuple[str, int]) -> bool:  # runs of one GPU kind on both sides
        return len(on[a] | on[b]) == 1

    best: dict[str, dict[str, Any]] = {}
    for (name, size), t in sorted(tps.items()):
        # (ascending sizes: the last is the largest)
        best[name] = {key: size, "tokens_per_s": t, "limit_found": failed.get(name, 0) > size}
        if other.get(name, 0) > size:
            best[name]["failed_otherwise_at"] = other[name]
        if kinds:
            best[name]["gpus"] = sorted(str(k) for k in on[(name, size)])
    out: dict[str, Any] = {"largest": best}
    for name, b in best.items():
        base = "none" + name[len(name.split("@")[0]) :]
        if name != base and base in best and alike((name, b[key]), (base, best[base][key])):
            out[f"{name}_vs_none_tokens_per_s"] = b["tokens_per_s"] / best[base]["tokens_per_s"]
    peers = [n for n in best if is_peer(n)]
    if peers:
        peer = max(peers, key=lambda n: (best[n][key], best[n]["tokens_per_s"]))
        size = best[peer][key]
        at = {"peer": peer, key: size, "peer_tokens_per_s": best[peer]["tokens_per_s"]}
        for name in (n for n in best if n.startswith("dsx")):
            if (name, size) in tps and alike((name, size), (peer, size)):
                at[f"{name}_vs_peer_tokens_per_s"] = tps[(name, size)] / best[peer]["tokens_per_s"]
            # how the ratio moves with the size: at every size both trained (JSON keys are strings)
            at[f"{name}_vs_peer_tokens_per_s_by_{key}"] = {
                str(s): t / tps[(peer, s)]
                for (n, s), t in sorted(tps.items())
                if n == name and (peer, s) in tps and alike((n, s), (peer, s))
            }
        out["at_best_peer"] = at
    return out


def _drive_rates(ssd_dir: str, mb: int = 2048) -> dict[str, Any]:
    """``dsx report --io ssd_dir --io-mb mb``: a sequential write, then read, of ``mb`` MiB (GB/s); an
    ``OSError`` (a full disk) is recorded, not raised: the run's own figures stand without it."""
    try:
        m = measure_file_bandwidth(ssd_dir, mb)
    except OSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300], "mb": mb}
    return {"write": m["write_GBps"], "read": m["read_GBps"], "mode": m["mode"], "mb": mb}


def _tier_vs_drive(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per config that used the SSD tier: the tier's write and read rates while it had work (telemetry
    ``GBps_by_tier``: the drive's own calls) and the drive's measured after the same runs, each way over the
    runs that have both; ``<way>_fraction`` is the tier's median rate over the drive's (above 1 where the tier
    beats the one-request probe)."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["config"] for r in rows if "write" in r.get("drive_GBps", {})):
        runs = [r for r in rows if r["config"] == name and "write" in r.get("drive_GBps", {})]
        entry: dict[str, Any] = {"runs": len(runs)}
        for way, tier in (("write", "ssd"), ("read", "ssd_read")):
            both = [(r["telemetry"]["GBps_by_tier"][tier], r["drive_GBps"][way]) for r in runs
                    if tier in r["telemetry"].get("GBps_by_tier", {})]  # fmt: skip
            entry[f"tier_{way}_GBps"] = [t for t, _ in both]
            entry[f"drive_{way}_GBps"] = [d for _, d in both]
            if both:
                entry[f"{way}_fraction"] = statistics.median(t for t, _ in both) / statistics.median(
                    d for _, d in both
                )
        out[name] = entry
    return out


# what rows merged into one file must share (the model, its step, the optimizer); configs, sizes and budgets may
# differ from part to part
MERGE_SAME = ("model", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "seq_len", "micro_batch", "vocab",
              "warmup", "steps", "adam", "offload_optimizer", "pool_gb", "ssd_gb", "quick", "gpu_memory_gb")  # fmt: skip


def _earlier(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``--merge``: the rows and parts of the file's ``--section`` (none if it does not exist); a section made
    with other model or step settings is refused, naming them."""
    path = f"{Path(args.out) / args.name}.json's section {args.section!r}"
    before = read_sections(args.out, args.name).get(args.section)
    if before is None:
        return [], []
    theirs = {"vocab": 256, **before.get("config", {})}  # (files from before --vocab ran at 256)
    if theirs.get("ssd_gb") is None:  # (files from before --ssd-gb had an SSD file of the pool's size)
        theirs["ssd_gb"] = theirs.get("pool_gb")
    differ = {k: (theirs.get(k), vars(args)[k]) for k in MERGE_SAME if theirs.get(k) != vars(args)[k]}
    if differ:
        raise SystemExit(
            f"--merge: {path} was run with other settings {differ} (theirs, this run's); run with the same "
            "settings, or write to another --section"
        )
    env = before.get("env") or {}
    parts = before.get("parts") or [
        {"utc": env.get("date_utc"), "device": env.get("device"), "configs": theirs.get("configs")}
    ]
    # (rows from before sizes were recorded per row ran at the file's own sizes)
    rows = [
        {"micro_batch": theirs.get("micro_batch"), "seq_len": theirs.get("seq_len"), **r}
        for r in before.get("results", [])
    ]
    return rows, list(parts)


def _write(
    results: list[dict[str, Any]], args: argparse.Namespace, parts: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The JSON of the results so far, with the throughput ratios the targets are stated in; ``parts``: when
    each run merged into the file ran, and what it ran."""
    ok = median_runs([r for r in results if "error" not in r])
    ratios: dict[str, Any] = {}
    for a, b in [("dsx_auto_budget", "recompute"), ("dsx_host_sel", "ds_cpu_ckpt"), ("dsx_auto_budget_sel", "recompute"),
                 ("dsx_auto_budget_sel", "megatron_selective"), ("dsx_auto_hide", "none"),
                 ("dsx_auto_hide_sel", "none"), ("dsx_host", "save_on_cpu"), ("dsx_host_sel", "save_on_cpu"),
                 ("none_copies", "none"), ("dsx_auto_hide", "none_copies"),
                 ("dsx_ssd", "dsx_ssd_noverify"), ("dsx_auto_budget", "dsx_auto_budget_host"),
                 ("dsx_auto_budget_sel", "dsx_auto_budget_host_sel"),
                 ("dsx_auto_budget_hp_sel", "dsx_auto_budget_host_hp_sel")]:  # fmt: skip
        if a in ok and b in ok:
            ratios[f"{a}_vs_{b}_throughput"] = ok[a]["tokens_per_s"] / ok[b]["tokens_per_s"]
    # the targets as stated: the fastest dsx config whose measured activation peak is within a baseline's
    for base in ("recompute", "save_on_cpu", "ds_cpu_ckpt"):
        if base not in ok:
            continue
        fits = [r for r in ok.values() if r["config"].startswith("dsx") and r["config"] != "recompute"
                and r["activation_peak_gb"] <= ok[base]["activation_peak_gb"]]  # fmt: skip
        if fits:
            best = max(fits, key=lambda r: r["tokens_per_s"])
            ratios[f"best_dsx_within_{base}_peak_vs_{base}_throughput"] = (
                best["tokens_per_s"] / ok[base]["tokens_per_s"]
            )
            ratios[f"best_dsx_within_{base}_peak_config"] = best["config"]  # type: ignore[assignment]
    used = {r.get("part", 0) for r in results}  # (rows from before rows named their part: the file's first)
    kinds = _part_kinds(results, parts or [])
    if args.micro_batches:
        ratios["largest_micro_batch"] = _largest(results, "micro_batch", "mb", kinds)  # type: ignore[assignment]
    if args.seq_lens:
        ratios["longest_sequence"] = _largest(results, "seq_len", "seq", kinds)  # type: ignore[assignment]
    for r in ok.values():
        if r["config"].startswith("dsx_auto_hide") and r.get("plan"):
            bound = r["plan"]["bound"]
            ratios[f"{r['config']}_fraction_of_bound"] = bound["fraction_of_bound"]  # what the plan asked for
            # what the measured steps moved, against the same bound (a plan can move less than it asks for
            # when a layer's storages do not fit its cap)
            written = r["telemetry"].get("written_gb_per_measured_step")
            hideable = min(bound["hideable_write_bytes"], bound["hideable_read_bytes"])
            if written and hideable > 0:
                ratios[f"{r['config']}_measured_fraction_of_bound"] = (
                    statistics.mean(written) * 1e9 / hideable
                )
    ssd = ok.get("dsx_ssd")
    if ssd and ssd.get("checksum_GBps") and ssd["telemetry"].get("written_gb_per_measured_step"):
        # every verified byte is checksummed twice on the device: as it leaves, as it comes back
        written = statistics.median(ssd["telemetry"]["written_gb_per_measured_step"])
        device_s = 2 * written / ssd["checksum_GBps"]
        ratios["verify"] = {"verified_gb_per_step": written, "checksum_GBps": ssd["checksum_GBps"],
                            "checksum_device_s_per_step": device_s, "fraction_of_step": device_s / ssd["step_s"],
                            "step_s_runs_verified": ssd["step_s_runs"]}  # fmt: skip
        off = ok.get("dsx_ssd_noverify")
        if (
            off
        ):  # the same config without the check, interleaved with it: the measured difference and its spread
            ratios["verify"]["step_s_runs_unverified"] = off["step_s_runs"]
            ratios["verify"]["median_step_ratio"] = ssd["step_s"] / off["step_s"]
    drive = _tier_vs_drive([r for r in results if "error" not in r])
    if drive:
        ratios["ssd_tier_vs_drive"] = drive
    parts = [{**p, "superseded": True} if i not in used else {k: v for k, v in p.items() if k != "superseded"}
             for i, p in enumerate(parts or [])]  # fmt: skip
    out = {"name": "bench_offload", "env": environment(), "config": vars(args), "parts": parts or [],
           "model": "megatron-core GPTModel" if _megatron(args) else "dsx torch GPT",
           "results": results, "ratios": ratios}  # fmt: skip
    write_section(out, args.out, args.name, args.section)
    return out


def _shape(result: dict[str, Any]) -> str:
    """The shape a section ran, for its panel's title: model, width, layers, sequence, micro-batch (what its
    config records)."""
    c = result.get("config") or {}
    model = ["Llama" if c.get("model") == "llama" else "GPT", c.get("hidden") and f"h{c['hidden']}",
             c.get("layers") and f"x {c['layers']} layers"]  # fmt: skip
    seq = "lengths swept" if c.get("seq_lens") else c.get("seq_len") and f"seq {c['seq_len']}"
    mb = (
        "micro-batches swept"
        if c.get("micro_batches")
        else c.get("micro_batch") and f"micro-batch {c['micro_batch']}"
    )
    return ", ".join(filter(None, [" ".join(filter(None, model)), seq, mb]))


def _draw(panel: Any, section: str, result: dict[str, Any]) -> None:
    """One section's panel: a sequence-length sweep draws throughput against length
    (:func:`_draw_lengths`); anything else each strategy's step time against its activation peak, and its
    throughput."""
    results, parts = result.get("results") or [], result.get("parts") or []
    title = f"{section}: {_shape(result)}"
    ok = [r for r in results if "error" not in r]
    if not ok:
        panel.suptitle(f"{title}: no config trained", fontsize=10)
        return
    if all("@seq" in r["config"] for r in results) and len({r["seq_len"] for r in results}) > 1:
        _draw_lengths(panel, results, parts, title)
        return
    a, b = panel.subplots(1, 2, width_ratios=[1.2, 1])
    # the trade-off: lower left is better; dsx points in one colour, baselines in another; every repeat a
    # point, each config named once, at its median
    med = median_runs(ok)
    for r in ok:
        dsx_cfg = r["config"].startswith("dsx")
        a.scatter(r["activation_peak_gb"], r["step_s"] * 1e3, color="tab:blue" if dsx_cfg else "tab:gray",
                  marker="o" if dsx_cfg else "s", s=14)  # fmt: skip
    for r in med.values():
        a.annotate(r["config"], (r["activation_peak_gb"], r["step_s"] * 1e3), fontsize=7,
                   xytext=(4, 3), textcoords="offset points")  # fmt: skip
    a.set_xlabel("activation peak (GB)")
    a.set_ylabel("step time (ms)")
    a.set_yscale("log")
    a.grid(alpha=0.3)
    # throughput at the median step, the bar's line spanning the repeats
    names = list(med)
    tps = [med[n]["tokens_per_s"] for n in names]
    spread = [[t - t * med[n]["step_s"] / max(med[n]["step_s_runs"]) for n, t in zip(names, tps, strict=True)],
              [t * med[n]["step_s"] / min(med[n]["step_s_runs"]) - t for n, t in zip(names, tps, strict=True)]]  # fmt: skip
    b.barh(names, [t / 1e3 for t in tps], xerr=[[e / 1e3 for e in side] for side in spread],
           color=["tab:blue" if n.startswith("dsx") else "tab:gray" for n in names])  # fmt: skip
    b.invert_yaxis()
    b.set_xlabel("throughput (k tokens/s)")
    b.tick_params(axis="y", labelsize=7)
    live = [p for p in parts if not p.get("superseded")]
    if len(live) > 1:
        devices = ", ".join(sorted({str(p.get("device")) for p in live}))
        runs = f"{len(live)} runs merged ({devices})"
    else:
        runs = f"one run ({(result.get('env') or {}).get('device', '?')})"
    panel.suptitle(f"{title}: activation offload strategies, same model and data, {runs}; each config in its "
                   "own process", fontsize=10)  # fmt: skip


def _gpu_kind(device: str) -> str:
    """A GPU's model from its name as torch gives it: "NVIDIA H100 80GB HBM3" -> "H100"."""
    words = device.removeprefix("NVIDIA ").split()
    return words[0] if words else device


def _part_kinds(results: list[dict[str, Any]], parts: list[dict[str, Any]]) -> dict[int, str]:
    """The GPU kind of each merged part that has rows and names its device, by part index; empty where those
    are all one kind (nothing then needs a kind named). Rows from before rows named their part belong to the
    file's first."""
    used = {r.get("part", 0) for r in results}
    kinds = {i: _gpu_kind(p["device"]) for i, p in enumerate(parts) if i in used and p.get("device")}
    return kinds if len(set(kinds.values())) > 1 else {}


def _draw_lengths(panel: Any, results: list[dict[str, Any]], parts: list[dict[str, Any]], title: str) -> None:
    """A sequence-length sweep (``--seq-lens``): tokens/s against length, a line per config (its median run at
    each length), and a cross where a config first failed (out of GPU memory, killed for host memory, or
    otherwise, as the cross's label says) at the length it failed. Where the merged parts ran on more than one
    kind of GPU, each config's label names the ones its rows came from."""
    a = panel.subplots()
    kinds = _part_kinds(results, list(parts))
    by: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        if not r.get("not_run"):
            by.setdefault(r["config"].rsplit("@seq", 1)[0], []).append(r)
    crosses: dict[int, int] = {}  # labels already at a length: the next one is drawn beside them
    for i, (cfg, rows) in enumerate(sorted(by.items())):
        color = f"C{i}"
        good = sorted(median_runs([r for r in rows if "error" not in r]).values(), key=lambda r: r["seq_len"])
        failed = [r for r in rows if "error" in r]
        if good:
            on = sorted({kinds[r.get("part", 0)] for r in rows if r.get("part", 0) in kinds})
            where = f"; {', '.join(on)}" if on else ""
            top = f"{good[-1]['seq_len']:,}"
            # (a config that did not run out of memory at a longer length may train longer: what it trained is
            # not its limit)
            limit = any(r["seq_len"] > good[-1]["seq_len"] and _does_not_fit(r) for r in failed)
            most = f"longest {top}" if limit else f"trained {top}, its limit not found"
            a.plot([r["seq_len"] for r in good], [r["tokens_per_s"] / 1e3 for r in good], "o-", color=color,
                   label=f"{cfg} ({most}{where})")  # fmt: skip
        if failed:  # (a longer length tried in another part failed too: only the shortest is the limit)
            r = min(failed, key=lambda r: r["seq_len"])
            if r.get("returncode") == -signal.SIGKILL:
                why = "killed (host memory)"
            else:
                why = "out of memory" if _does_not_fit(r) else "failed otherwise"
            k = crosses[r["seq_len"]] = crosses.get(r["seq_len"], -1) + 1
            a.plot(r["seq_len"], 0, "x", color=color, markersize=10, mew=2)
            a.annotate(f"{cfg}: {why}", (r["seq_len"], 0), fontsize=7, rotation=90, xytext=(3 + 9 * k, 6),
                       textcoords="offset points", color=color)  # fmt: skip
    a.set_xlabel("sequence length (tokens, micro-batch 1)")
    a.set_ylabel("throughput (k tokens/s)")
    a.set_ylim(bottom=0)
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
    panel.suptitle(
        f"{title}: the longest sequence, throughput at each length each config trained; x: its first failure",
        fontsize=10,
    )


if __name__ == "__main__":
    main()
