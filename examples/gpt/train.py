"""The main job: a GPT trained through ``dsx.initialize`` on the embedded default text, or your shards.

Run with the deepspeed launcher, e.g.::

    deepspeed --num_gpus 1 examples/gpt/train.py --deepspeed_config configs/gpt_zero2.json
    python examples/gpt/train.py --deepspeed_config configs/gpt_zero2.json      # one process, no launcher

DALI is optional: ``--loader auto`` uses it when ``nvidia-dali`` is installed, the torch loader otherwise
(both yield the same batches).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from tqdm import tqdm

import dsx
from dsx.cli import run_entry_point
from dsx.config import load_deepspeed_config
from dsx.data.tokens import TokenData, load_shards, make_loader, stdlib_corpus
from dsx.models.gpt import GPT, GPTConfig
from dsx.models.llama import Llama, LlamaConfig
from dsx.models.megatron_gpt import build_megatron_gpt, build_megatron_llama, megatron_available

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: the start-up the examples share
from _launch import init_distributed, param_digest

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a GPT through dsx.initialize (the dsx main job).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="this rank's GPU on its machine (set by the launcher)")  # fmt: skip
    p.add_argument("--steps", type=int, default=120, help="optimizer steps")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per training window")
    p.add_argument("--layers", type=int, default=4, help="transformer layers")
    p.add_argument("--hidden", type=int, default=128, help="hidden size")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--model", choices=["auto", "torch", "megatron", "llama", "megatron-llama"], default="auto",
                   help="auto: megatron-core GPTModel when it and CUDA are there, else the small torch GPT; "
                        "llama: the Llama-style torch decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU); "
                        "megatron-llama: the same decoder built with megatron-core, SDPA as its core attention")  # fmt: skip
    p.add_argument("--kv-heads", type=int, default=None,
                   help="key/value heads of the llama models (None: --heads, no grouping)")  # fmt: skip
    p.add_argument("--ffn-hidden", type=int, default=None,
                   help="MLP width of the llama models (None: 8/3 x hidden, rounded up to a multiple of 32)")  # fmt: skip
    p.add_argument(
        "--data", default=None, help="token shards (.npy / .bin file or directory); None: the stdlib's text"
    )
    p.add_argument("--data-dtype", default="uint16", help="dtype of raw .bin shards")
    p.add_argument("--loader", choices=["auto", "dali", "torch"], default="auto",
                   help="batch loader; auto: DALI when nvidia-dali is installed, else torch (same batches)")  # fmt: skip
    p.add_argument("--seed", type=int, default=1234, help="model initialisation and data order")
    p.add_argument("--eval-every", type=int, default=0, help="validation every N steps (0: only at the end)")
    p.add_argument("--eval-batches", type=int, default=8, help="validation micro-batches per evaluation")
    p.add_argument("--log-json", default=None, help="write per-step losses and the summary here (rank 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--trace", metavar="PATH", default=None,
                   help="write the scheduler's timeline here (enables dsx.scheduler; .rank<r> added per rank "
                        "when there are several); draw it with `dsx trace PATH`")  # fmt: skip
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args(argv)
    if args.deepspeed_config is None:
        p.error("--deepspeed_config is required (see configs/)")
    return args


def _pick_model(args: argparse.Namespace, vocab: int, bf16: bool) -> tuple[torch.nn.Module, str]:
    ok, why = megatron_available()
    kind = ("megatron" if ok else "torch") if args.model == "auto" else args.model
    if kind in ("megatron", "megatron-llama") and not ok:
        raise SystemExit(f"--model {kind}: {why}")
    if kind == "megatron":
        model = build_megatron_gpt(args.layers, args.hidden, args.heads, args.seq_len, vocab, args.seed, bf16)
        return model, "megatron-core GPTModel"
    if kind in ("llama", "megatron-llama"):
        ffn = -(-8 * args.hidden // 3 // 32) * 32 if args.ffn_hidden is None else args.ffn_hidden
        try:
            llama = LlamaConfig(vocab_size=vocab, seq_len=args.seq_len, layers=args.layers, hidden=args.hidden,
                                heads=args.heads, kv_heads=args.heads if args.kv_heads is None else args.kv_heads,
                                ffn_hidden=ffn)  # fmt: skip
        except ValueError as exc:
            raise SystemExit(f"--model {kind}: {exc}") from None
        if kind == "megatron-llama":
            return build_megatron_llama(llama, args.seed, bf16), "megatron-core Llama (SDPA attention)"
        return Llama(llama, seed=args.seed), "dsx torch Llama"
    cfg = GPTConfig(
        vocab_size=vocab, seq_len=args.seq_len, layers=args.layers, hidden=args.hidden, heads=args.heads
    )
    return GPT(cfg, seed=args.seed), "dsx torch GPT"


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


def _mean_over_ranks(x: torch.Tensor) -> float:
    if dist.is_initialized() and dist.get_world_size() > 1:
        x = x.detach().clone()
        dist.all_reduce(x)
        x /= dist.get_world_size()
    return float(x)


@torch.no_grad()
def _evaluate(
    engine: Any, data: TokenData, args: argparse.Namespace, micro: int, rank: int, world: int
) -> float:
    engine.eval()
    loader = make_loader(data.val, args.seq_len, micro, args.seed + 1, rank, world, "torch", engine.device)
    total = torch.zeros((), device=engine.device)
    for _ in range(args.eval_batches):
        x, y = next(loader)
        total += engine(x, y).float()
    engine.train()
    return _mean_over_ranks(total / args.eval_batches)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train, print the summary on rank 0, and return it."""
    args = parse_args(argv)
    ds_config = load_deepspeed_config(args.deepspeed_config)
    if args.trace:
        # the flag wins over the file's scheduler section, without editing the JSON
        sched = ds_config.setdefault("dsx", {}).setdefault("scheduler", {})
        sched.update(enabled=True, trace_path=args.trace)
    torch.manual_seed(args.seed)
    rank, world = init_distributed(args.local_rank)
    data = load_shards(args.data, args.data_dtype) if args.data else stdlib_corpus()
    bf16 = bool(ds_config.get("bf16", {}).get("enabled", False))
    model, model_name = _pick_model(args, data.vocab_size, bf16)

    engine, _, _, _ = dsx.initialize(
        args=args, model=model, model_parameters=model.parameters(), config=ds_config
    )
    micro = engine.train_micro_batch_size_per_gpu()
    accum = engine.gradient_accumulation_steps()
    loader = make_loader(
        data.train, args.seq_len, micro, args.seed, rank, world, args.loader, engine.device, accum
    )
    tokens_per_step = micro * accum * world * args.seq_len

    if rank == 0:
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 partitions
        print(f"dsx: {model_name}, {n_params / 1e6:.2f}M parameters, "
              f"{world} rank(s), micro-batch {micro} x accum {accum}, seq {args.seq_len}, data {data.source}")  # fmt: skip
    bar = tqdm(
        total=args.steps, desc="train", unit="step", disable=rank != 0 or args.no_progress, file=sys.stdout
    )
    losses: list[float] = []
    evals: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    t_warm = t0
    for step in range(args.steps):
        acc = torch.zeros((), device=engine.device)
        for _ in range(accum):
            x, y = next(loader)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            acc += loss.detach().float()
        losses.append(_mean_over_ranks(acc / accum))
        if step == 0:
            t_warm = (
                time.perf_counter()
            )  # start-up, first-step compilation and profiling excluded from tokens/s
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"loss became {losses[-1]} at step {step}")
        if args.eval_every and (step + 1) % args.eval_every == 0:
            evals.append((step + 1, _evaluate(engine, data, args, micro, rank, world)))
        elapsed = time.perf_counter() - t_warm
        tps = tokens_per_step * step / elapsed if step else 0.0
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tps:,.0f}")
        bar.update()
    bar.close()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t_warm
    val = _evaluate(engine, data, args, micro, rank, world)
    summary = {
        "model": model_name,
        "ranks": world,
        "steps": args.steps,
        "tokens_per_s": tokens_per_step * (args.steps - 1) / train_s if args.steps > 1 else 0.0,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "val_loss": val,
        "peak_memory_gb": _peak_memory_gb(engine.device),
        "wall_s": time.perf_counter() - t0,
        "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
    }
    # what training produced, for comparing runs bitwise (the fault harness: tests/faults)
    summary["param_digest"] = param_digest(engine.module)
    runtime = dsx.runtime_of(engine)
    if runtime is not None:
        offload = runtime.features.get("activation_offload")
        ssd = getattr(getattr(offload, "offload", None), "ssd", None)
        if ssd is not None:
            summary["dsx_ssd_bytes_written"] = ssd.bytes_written  # this rank's, over the whole run
        if runtime.scheduler is not None:
            summary["dsx_telemetry"] = runtime.scheduler.telemetry.summary()
            summary["dsx_gate_pauses"] = dict(runtime.scheduler.gate_pauses)
        runtime.close()
    if rank == 0:
        print(
            f"summary: steps {args.steps} | tokens/s {summary['tokens_per_s']:,.0f} | loss {losses[0]:.3f} -> "
            f"{losses[-1]:.3f} | val loss {val:.3f} | peak memory {summary['peak_memory_gb']:.2f} GB | "
            f"{summary['wall_s']:.1f} s"
        )
        tel = summary.get("dsx_telemetry")
        if tel:
            moved = ", ".join(f"{t} {b / 1e9:.2f} GB" for t, b in tel["bytes_by_tier"].items()) or "nothing"
            print(
                f"dsx: per step {moved} moved, transfer {tel['transfer_s'] * 1e3:.0f} ms, exposed stall "
                f"{tel['stall_s'] * 1e3:.0f} ms; I/O gate pauses {summary.get('dsx_gate_pauses') or 'none'}"
            )
        if args.log_json:
            with open(args.log_json, "w") as f:
                json.dump({"losses": losses, "evals": evals, "summary": summary}, f, indent=1)
    return summary


if __name__ == "__main__":
    run_entry_point(main)
