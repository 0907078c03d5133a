"""Token data for the GPT main job: the embedded default corpus, user shards, and the batch loader.

The embedded default is byte-level text (vocabulary 256) of the Python standard library's own ``.py``
sources, which every machine that runs dsx has: no downloads. Files are read in sorted order up to a cap and
split into train and validation by a hash of the file's relative path, so the split is the same everywhere
for the same Python version.

Batches are windows of ``seq_len + 1`` tokens at offsets drawn from a seeded generator; rank ``r`` of ``w``
takes every ``w``-th window of the global sequence, so the union over ranks of one step is the same global
batch whatever the number of ranks. Two loaders yield identical batches: a DALI pipeline (when
``nvidia-dali`` is installed; CPU pipeline without a GPU, output on the GPU otherwise) and a plain torch one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

__all__ = [
    "WITH_DALI",
    "TokenData",
    "dali_available",
    "load_shards",
    "make_loader",
    "stdlib_corpus",
    "window_offsets",
]


def dali_available() -> bool:
    """Whether ``nvidia.dali`` can be imported (checked without importing it).

    ``find_spec("nvidia.dali")`` imports the parent first, so it raises ModuleNotFoundError instead of
    returning None when no ``nvidia`` namespace package is installed at all.
    """
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except (ImportError, ValueError):  # ValueError: a parent module whose __spec__ is None
        return False


WITH_DALI = dali_available()


@dataclass
class TokenData:
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    source: str


def stdlib_corpus(max_bytes: int = 8 << 20, val_fraction: float = 0.05) -> TokenData:
    """Bytes of the standard library's ``.py`` files (sorted, capped at ``max_bytes``), split by path hash."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train: list[bytes] = []
    val: list[bytes] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "test" in rel.split("/")[0]:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        h = int.from_bytes(hashlib.sha1(rel.encode()).digest()[:4], "little") / 2**32
        (val if h < val_fraction else train).append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not train or not val:
        raise RuntimeError(f"found too little Python source under {root} to build the default corpus")
    as_arr = lambda parts: np.frombuffer(b"".join(parts), dtype=np.uint8).astype(np.int32)  # noqa: E731
    return TokenData(as_arr(train), as_arr(val), 256, f"stdlib:{root}")


def load_shards(path: str | Path, dtype: str = "uint16", val_fraction: float = 0.05) -> TokenData:
    """Token ids from ``.npy`` files or raw ``.bin`` files (``dtype``, default uint16) in a file or directory.

    Shards are concatenated in sorted name order; the last ``val_fraction`` of tokens is validation.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"--data {str(p)!r} does not exist (give a .npy/.bin file or a directory of them)"
        )
    files = sorted(f for f in (p.iterdir() if p.is_dir() else [p]) if f.suffix in (".npy", ".bin"))
    if not files:
        raise ValueError(f"--data {str(p)!r} holds no .npy or .bin token shards")
    arrays = [
        np.load(f, mmap_mode="r") if f.suffix == ".npy" else np.memmap(f, dtype=dtype, mode="r")
        for f in files
    ]
    tokens = np.concatenate([np.asarray(a).reshape(-1) for a in arrays]).astype(np.int64)
    if tokens.size and tokens.min() < 0:
        raise ValueError(f"--data {str(p)!r} holds negative token ids")
    n_val = max(1, int(len(tokens) * val_fraction))
    vocab = int(tokens.max()) + 1 if tokens.size else 0
    return TokenData(tokens[:-n_val].astype(np.int32), tokens[-n_val:].astype(np.int32), vocab, f"shards:{p}")


def window_offsets(n_tokens: int, seq_len: int, global_batch: int, step: int, seed: int) -> np.ndarray:
    """Start offsets of the ``global_batch`` windows of one step (a pure function of seed and step)."""
    span = n_tokens - (seq_len + 1)
    if span < 0:
        raise ValueError(
            f"token data has {n_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}: use a shorter --seq-len "
            "or more data"
        )
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, span + 1, size=global_batch, dtype=np.int64)


@dataclass(frozen=True)
class _Shard:
    """Which windows of each step's global batch this rank reads."""

    seq_len: int
    micro_batch: int
    seed: int
    rank: int
    world: int
    accum: int

    def windows(self, tokens: np.ndarray, it: int) -> list[np.ndarray]:
        # Micro-batch k of an optimizer step on rank r reads slice k * world + r of that step's global batch:
        # one rank with accum=2 and two ranks with accum=1 read the same windows for the same step.
        step, k = divmod(it, self.accum)
        m = self.micro_batch
        offs = window_offsets(len(tokens), self.seq_len, m * self.world * self.accum, step, self.seed)
        part = k * self.world + self.rank
        return [
            np.ascontiguousarray(tokens[o : o + self.seq_len + 1]) for o in offs[part * m : (part + 1) * m]
        ]


def _torch_loader(
    tokens: np.ndarray, shard: _Shard, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    it = 0
    while True:
        w = torch.from_numpy(np.stack(shard.windows(tokens, it)))
        w = w.to(device=device, dtype=torch.long, non_blocking=True)
        yield w[:, :-1], w[:, 1:]
        it += 1


def _dali_loader(
    tokens: np.ndarray, shard: _Shard, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import feed_ndarray

    on_gpu = device.type == "cuda"

    def source(info):  # called by DALI's prefetching thread, one batch per iteration
        return shard.windows(tokens, info.iteration)

    seq_len = shard.seq_len
    device_id = (device.index or 0) if on_gpu else None

    @pipeline_def(batch_size=shard.micro_batch, num_threads=2, device_id=device_id, seed=shard.seed)
    def pipe():
        w = fn.external_source(source=source, batch=True, batch_info=True, dtype=types.INT32, ndim=1)
        if on_gpu:
            w = w.gpu()
        w = fn.cast(w, dtype=types.INT64)
        return fn.slice(w, 0, seq_len, axes=[0]), fn.slice(w, 1, seq_len, axes=[0])

    p = pipe()
    p.build()
    while True:
        inp, tgt = p.run()
        out = []
        for tl in (inp, tgt):
            tl = tl.as_tensor()
            t = torch.empty(tl.shape(), dtype=torch.long, device=device)
            feed_ndarray(tl, t, cuda_stream=torch.cuda.current_stream(device) if on_gpu else None)
            out.append(t)
        yield out[0], out[1]


def make_loader(
    tokens: np.ndarray,
    seq_len: int,
    micro_batch: int,
    seed: int,
    rank: int = 0,
    world: int = 1,
    backend: Literal["auto", "dali", "torch"] = "auto",
    device: torch.device | str = "cpu",
    grad_accum: int = 1,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (input, target) batches of shape ``[micro_batch, seq_len]`` for this rank.

    Each optimizer step reads ``micro_batch * world * grad_accum`` windows; rank ``r`` reads slice
    ``k * world + r`` for its ``k``-th micro-batch. ``backend="auto"`` uses DALI when it is installed, the
    torch loader otherwise; both give equal batches.
    """
    if backend == "dali" and not WITH_DALI:
        raise RuntimeError(
            "loader backend 'dali' asked for, but nvidia-dali is not installed (pip install dsx[dali])"
        )
    window_offsets(len(tokens), seq_len, 1, 0, seed)  # fail early on data shorter than one window
    device = torch.device(device)
    use_dali = backend == "dali" or (backend == "auto" and WITH_DALI)
    shard = _Shard(seq_len, micro_batch, seed, rank, world, grad_accum)
    return (_dali_loader if use_dali else _torch_loader)(tokens, shard, device)
