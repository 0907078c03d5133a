"""What the example jobs share: the distributed init (also for one process without a launcher), and the
node-classification epoch of the GNN examples.

The examples put this folder on ``sys.path`` and import it as ``_launch``; it is not part of the dsx package.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import sys
import time
from collections.abc import Callable
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from dsx.ops import announce_comm_build
from dsx.runtime.process import single_process_env

__all__ = ["add_loop_args", "all_sum", "fit", "init_distributed", "param_digest", "run_epoch"]


def init_distributed(local_rank: int) -> tuple[int, int]:
    """Join the process group (NCCL on GPUs, gloo on CPU ranks) and pick this rank's GPU; (rank, world)."""
    single_process_env()
    announce_comm_build()  # DeepSpeed compiles its CPU all-reduce op here on a first CPU run
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size()


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks in place (a collective), or ``t`` itself in one process."""
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def param_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the model's parameters (names and bytes, in order): equal only when training was bitwise
    equal. A collective under ZeRO-3 (every rank gathers its partitioned parameters)."""
    params = list(model.named_parameters())
    gather = any(hasattr(p, "ds_id") for _, p in params)  # ZeRO-3 keeps only a partition on each rank
    ctx = deepspeed.zero.GatheredParameters([p for _, p in params]) if gather else contextlib.nullcontext()
    h = hashlib.sha256()
    with ctx, torch.no_grad():
        for name, p in params:
            h.update(name.encode())
            h.update(p.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def add_loop_args(p: argparse.ArgumentParser) -> None:
    """The GNN examples' training-loop flags: epochs, batches per epoch, where features live, seed, summary,
    progress bars."""
    p.add_argument("--epochs", type=int, default=3, help="passes over the training seeds")
    p.add_argument("--max-batches", type=int, default=0, help="stop each epoch after N batches (0: all)")
    p.add_argument("--feature-placement", choices=["host", "gpu"], default="host",
                   help="host: pinned, shared host memory gathered zero-copy; gpu: a copy on each GPU")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="graph, model and sampling seed")
    p.add_argument("--log-json", default=None, help="write the summary here (rank 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run_epoch(
    engine: Any,
    loader: Any,
    forward: Callable[[Any], tuple[torch.Tensor, torch.Tensor]],
    training: bool,
    epoch: int,
    *,
    max_batches: int = 0,
    progress: bool = True,
    losses: list[torch.Tensor] | None = None,
) -> tuple[float, float, float]:
    """One pass of a node-classification ``loader`` through the DeepSpeed ``engine``: (mean loss, accuracy,
    seconds), loss and accuracy over every rank's seeds. ``forward(batch) -> (logits, labels)`` of the
    batch's seeds; ``max_batches`` (0: all) stops early; training steps append their loss to ``losses``
    (kept on the device: no host synchronisation per step on a GPU)."""
    loader.set_epoch(epoch)
    engine.train(training)
    stats = torch.zeros(3, device=engine.device)  # loss sum, correct, seeds
    n = len(loader) if not max_batches else min(len(loader), max_batches)
    bar = tqdm(total=n, desc=f"epoch {epoch} {'train' if training else 'val'}", disable=not progress,
               file=sys.stdout)  # fmt: skip
    t0 = time.perf_counter()
    with torch.set_grad_enabled(training):
        for i, b in enumerate(loader):
            if i == n:
                break
            out, y = forward(b)
            loss = F.cross_entropy(out, y)
            if training:
                engine.backward(loss)
                engine.step()
                if losses is not None:
                    losses.append(loss.detach())
            k = y.numel()
            stats += torch.stack([loss.detach() * k, (out.argmax(1) == y).sum().float(),
                                  torch.full((), float(k), device=engine.device)])  # fmt: skip
            bar.update()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    bar.close()
    s = all_sum(stats).tolist()
    return s[0] / max(s[2], 1), s[1] / max(s[2], 1), dt


def fit(
    engine: Any,
    train: Any,
    val: Any,
    forward: Callable[[Any], tuple[torch.Tensor, torch.Tensor]],
    epochs: int,
    *,
    max_batches: int = 0,
    progress: bool = True,
    log: bool = True,
) -> tuple[list[dict[str, float]], list[torch.Tensor]]:
    """``epochs`` of training on ``train`` then evaluation on ``val`` (:func:`run_epoch`); the per-epoch
    history (loss, train and validation accuracy, epoch seconds; printed where ``log``, progress bars where
    ``progress``) and the loss of every training step."""
    history: list[dict[str, float]] = []
    losses: list[torch.Tensor] = []
    for epoch in range(epochs):
        kw = dict(max_batches=max_batches, progress=progress)
        loss, acc, dt = run_epoch(engine, train, forward, True, epoch, losses=losses, **kw)
        _, vacc, _ = run_epoch(engine, val, forward, False, epoch, **kw)
        history.append({"epoch": epoch, "loss": loss, "train_acc": acc, "val_acc": vacc, "epoch_s": dt})
        if log:
            print(
                f"epoch {epoch}: loss {loss:.4f} train acc {acc:.4f} val acc {vacc:.4f} epoch time {dt:.2f} s"
            )
    return history, losses
