"""Worker for tests/direct/test_shm.py: one rank per launcher "node", each its node's leader (gloo, CPU).

argv: OUT_DIR SHM_DIR. Rank 0's leader creates its segment; rank 1's leader fails (it has no tensor to
share). Every rank must then raise the same SharedMemoryError, and rank 0's segment must not outlive it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from dsx.config import UnifiedConfig
from dsx.direct import SharedMemoryError, shm
from dsx.runtime.process import exit_distributed


def main() -> None:
    out_dir, shm_dir = (a for a in sys.argv[1:] if not a.startswith("--"))
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    table = torch.randn(1000, 64) if rank == 0 else None
    try:
        shm.share_tensor(table, UnifiedConfig(shared_memory_dir=shm_dir).shared_memory_dir, name="feat")
        error = None
    except SharedMemoryError as exc:
        error = str(exc)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "error": error}))


if __name__ == "__main__":
    main()
    exit_distributed()
