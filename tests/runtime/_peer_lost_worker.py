"""Worker for tests/runtime/test_process.py, started by the deepspeed launcher (gloo, CPU accelerator).

argv: OUT_DIR. Rank 1 kills itself with SIGKILL once both ranks are up; rank 0 then enters an exchange
(dsx's all_gather) and writes the error it got to OUT_DIR/rank0.json before failing.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta

import deepspeed
import torch.distributed as dist

from dsx.runtime.process import all_gather


def main() -> None:
    (out_dir,) = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        all_gather(dist.get_rank(), "the test's exchange")
    except Exception as e:
        with open(f"{out_dir}/rank0.json", "w") as f:
            json.dump({"type": type(e).__name__, "message": str(e), "cause": type(e.__cause__).__name__}, f)
        raise
    with open(f"{out_dir}/rank0.json", "w") as f:
        json.dump({"type": None}, f)


if __name__ == "__main__":
    main()
