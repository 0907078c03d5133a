"""Worker for tests/direct/test_unified.py, started by the deepspeed launcher (gloo): shares a tensor per node.

argv: OUT_DIR SHM_DIR MODE   (MODE: "share" or "kill")
Every rank writes OUT_DIR/rank<r>.json with what it saw; in "kill" mode the last rank SIGKILLs itself after
mapping the segment, mid-run, while the others keep working.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import deepspeed
import torch
import torch.distributed as dist

from dsx.config import UnifiedConfig
from dsx.direct import unified


def _smaps_for(path_prefix: str) -> dict[str, int]:
    """Rss/Pss (kB) of this process's mappings of files whose path starts with path_prefix."""
    out = {"Rss": 0, "Pss": 0, "mappings": 0, "deleted": 0}
    cur = False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:  # a mapping header
                cur = len(parts) >= 6 and parts[5].startswith(path_prefix)
                if cur:
                    out["mappings"] += 1
                    out["deleted"] += int(parts[-1] == "(deleted)")
            elif cur and parts[0] in ("Rss:", "Pss:"):
                out[parts[0][:-1]] += int(parts[1])
    return out


def main() -> None:
    out_dir, shm_dir, mode = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = UnifiedConfig(shared="auto", shared_memory_dir=shm_dir)
    rows, cols = 4096, 256  # 4 MiB of float32
    gen = torch.Generator().manual_seed(1234)
    data = torch.randn(rows, cols, generator=gen)  # same on every rank: each can check what it maps
    ut = unified(data if rank == 0 else None, name="feat", config=cfg)
    files_after = sorted(os.listdir(shm_dir))
    idx = torch.randint(0, rows, (1000,), generator=torch.Generator().manual_seed(rank))
    ok_gather = bool(torch.equal(ut.gather(idx), data[idx]))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # On the GPU machine each rank gathers from the shared pages zero-copy on its own GPU (the CPU job may run
    # on a host with fewer GPUs than ranks: those ranks check the host gather only).
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        torch.cuda.set_device(local_rank)
        ok_gather = ok_gather and ut.is_pinned and bool(torch.equal(ut.gather(idx.cuda()).cpu(), data[idx]))
    ut.tensor.sum()  # touch every page so Rss/Pss count them
    dist.barrier()  # every rank has touched them: only then is each page charged half to each (Pss)
    smaps = _smaps_for(shm_dir)
    dist.barrier()
    # Same pages, not copies: a write by rank 0 after mapping is seen by every other rank.
    if rank == 0:
        ut.tensor[7, 3] = 4242.0
    dist.barrier()
    seen = float(ut.tensor[7, 3])
    report = {
        "rank": rank,
        "world": world,
        "shared": ut.shared,
        "group": list(ut.group.ranks) if ut.group else None,
        "equal": bool(torch.equal(ut.tensor[:7], data[:7])),
        "gather_ok": ok_gather,
        "files_after_unified": files_after,
        "smaps": smaps,
        "seen_write": seen,
        "nbytes": ut.nbytes,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if mode == "kill":
        dist.barrier()
        if rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # dies holding its mapping
        time.sleep(60)  # the launcher tears the survivors down when it sees the dead rank
    dist.barrier()
    ut.close()


if __name__ == "__main__":
    main()
