"""Tier bandwidth as one rank really gets it: measured with every rank of the node transferring at once.

The ranks of a node (same hostname and launcher node) are found through ``all_gather_object``; they start
the probe together after a barrier, so each measures its share of the shared PCIe link or drive. The shares
are logged on each node's first rank and handed to the planner.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dsx.runtime.process import all_gather, collective

__all__ = ["TierBandwidth", "measure_file_bandwidth", "measure_host_bandwidth", "measure_tier_bandwidth"]

logger = logging.getLogger("dsx")


@dataclass
class TierBandwidth:
    """Bandwidth one rank gets on a tier while every rank of its node uses it (bytes per second), and the host
    time each tensor moved through it costs a step whatever its size (its write, read and handles; the planner
    sets it from ``moved_tensor_host_us``)."""

    tier: str
    write_Bps: float
    read_Bps: float
    per_tensor_s: float = 0.0


def measure_file_bandwidth(
    directory: str | os.PathLike[str], mb: int = 64, block_mb: int = 4
) -> dict[str, Any]:
    """Sequential write then read of a temporary file in ``directory`` (O_DIRECT where the filesystem allows).

    Blocks are page-aligned ``block_mb`` MiB buffers; the buffered fallback fsyncs and drops the file's
    pages before reading so that the read comes from the device. The file is removed afterwards.
    """
    d = Path(directory)
    if not d.is_dir() or not os.access(d, os.W_OK):
        raise OSError(f"{str(d)!r} is not a writable directory")
    block = block_mb << 20
    n = max(1, (mb << 20) // block)
    buf = mmap.mmap(-1, block)
    buf.write(os.urandom(1 << 16) * (block >> 16))
    fd, name = tempfile.mkstemp(prefix=".dsx-bw-", dir=d)
    os.close(fd)
    mode = "O_DIRECT"
    try:
        try:
            fd = os.open(name, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
            os.pwrite(fd, buf, 0)  # some filesystems refuse O_DIRECT only at the first write
        except OSError:
            mode = "buffered+fsync"
            fd = os.open(name, os.O_WRONLY)
        t0 = time.perf_counter()
        for k in range(n):
            os.pwrite(fd, buf, k * block)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.close(fd)
        fd = os.open(name, os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if mode == "O_DIRECT" else 0))
        if mode != "O_DIRECT":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for k in range(n):
            os.preadv(fd, [buf], k * block)
        read_s = time.perf_counter() - t0
        os.close(fd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
        buf.close()
    size = n * block
    return {"path": str(d), "mode": mode, "bytes": size, "write_GBps": size / write_s / 1e9,
            "read_GBps": size / read_s / 1e9}  # fmt: skip


def measure_host_bandwidth(mb: int = 256, device: torch.device | None = None) -> tuple[float, float]:
    """(device->host, host->device) bytes/s through pinned memory; on CPU, memcpy bandwidth both ways."""
    device = device or (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    )
    n = mb << 20
    if device is None or device.type != "cuda":
        a, b = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        a.fill_(1)
        b.copy_(a)
        t0 = time.perf_counter()
        for _ in range(3):
            b.copy_(a)
        bps = 3 * n / (time.perf_counter() - t0)
        return bps, bps
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    out = []
    for dst, src in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        out.append(3 * n / (time.perf_counter() - t0))
    return out[0], out[1]


def _node_peers() -> list[int]:
    """Global ranks on this node (same host and launcher node rank)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [0]
    me = (socket.gethostname(), os.environ.get("CROSS_RANK", os.environ.get("GROUP_RANK", "")))
    return [r for r, k in enumerate(all_gather(me, "finding the ranks on this node")) if tuple(k) == me]


def measure_tier_bandwidth(
    tiers: list[str], ssd_dir: str | os.PathLike[str] | None, *, mb: int = 64
) -> list[TierBandwidth]:
    """Per-rank bandwidth of each tier with all ranks of the node measuring at once (a collective call).

    ``mb`` is the probe's size per tier (``"dsx"."scheduler"."bandwidth_probe_mb"``); the host probe copies at
    least 64 MiB each way, and a small or nearly full drive gets a smaller file probe."""
    peers = _node_peers()
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    out: list[TierBandwidth] = []
    for tier in tiers:
        if distributed:
            with collective("the barrier before a bandwidth probe"):
                dist.barrier()
        if tier == "host":
            # two buffers of the probe's size: never more than a small share of the machine's memory
            ram_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
            w, r = measure_host_bandwidth(min(max(mb, 64), max(64, ram_mb // 32)))
        elif tier == "ssd":
            if ssd_dir is None:
                continue
            # a small or nearly full drive gets a smaller probe (at least one 4 MiB block), never ENOSPC
            st = os.statvfs(ssd_dir)
            try:
                res = measure_file_bandwidth(ssd_dir, max(4, min(mb, (st.f_bavail * st.f_frsize >> 20) // 8)))
            except OSError as exc:  # e.g. ENOSPC: the tier still works (it falls back per layer when full)
                logger.warning("dsx: could not measure the ssd tier in %s (%s); the planner will not use it",
                               ssd_dir, exc)  # fmt: skip
                w = r = 0.0
            else:
                w, r = res["write_GBps"] * 1e9, res["read_GBps"] * 1e9
        else:
            raise ValueError(f"unknown tier {tier!r}; expected 'host' or 'ssd'")
        out.append(TierBandwidth(tier, w, r))
    if distributed:
        return _agree(out, peers)
    for b in out:
        logger.warning("dsx: %s measured write %.2f GB/s, read %.2f GB/s (one rank)", b.tier, b.write_Bps / 1e9,
                       b.read_Bps / 1e9)  # fmt: skip
    return out


def _agree(measured: list[TierBandwidth], peers: list[int]) -> list[TierBandwidth]:
    """Every rank of the node plans with the smallest share any of them measured (a collective call).

    The shares differ by a few percent from rank to rank (PCIe switch, drive queue); planning every rank
    with the same, slowest one keeps their plans, and so their step times, alike. Each node's first rank
    logs every rank's measurement and the agreed share.
    """
    allm = all_gather([(b.tier, b.write_Bps, b.read_Bps) for b in measured], "agreeing on tier bandwidths")
    mine = [allm[r] for r in peers]
    agreed = [
        TierBandwidth(b.tier, min(m[k][1] for m in mine), min(m[k][2] for m in mine))
        for k, b in enumerate(measured)
    ]
    if dist.get_rank() == min(peers):
        for k, b in enumerate(agreed):
            each = ", ".join(f"rank {r} {m[k][1] / 1e9:.2f}/{m[k][2] / 1e9:.2f}" for r, m in zip(peers, mine))
            logger.warning(
                "dsx: node %s: %d rank(s) share %s, measured all at once (write/read GB/s): %s; agreed per-rank "
                "share: write %.2f GB/s, read %.2f GB/s", socket.gethostname(), len(peers), b.tier, each,
                b.write_Bps / 1e9, b.read_Bps / 1e9,
            )  # fmt: skip
    return agreed
