"""Worker for tests/runtime/test_process.py, started by the deepspeed launcher (gloo, CPU accelerator).

argv: OUT_DIR MODE   (MODE: "exit": ends with dsx's exit_distributed(); "engine": builds a DeepSpeed engine
through dsx.initialize and tears the process group down itself, leaving the buffer to the atexit hook)
Every rank writes OUT_DIR/rank<r>.json: whether DeepSpeed's shared-memory buffer existed after setup.
"""

from __future__ import annotations

import json
import sys

import deepspeed
import torch
import torch.distributed as dist

import dsx
from dsx.runtime.process import deepspeed_shm_buffer, exit_distributed


def main() -> None:
    out_dir, mode = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    deepspeed.init_distributed(dist_backend="gloo")
    if mode == "engine":
        model = torch.nn.Linear(8, 8)
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        dsx.initialize(model=model, model_parameters=model.parameters(), config=config)
    dist.barrier()  # every rank has mapped every buffer
    rank = dist.get_rank()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"existed": deepspeed_shm_buffer().exists(), "path": str(deepspeed_shm_buffer())}, f)
    if mode == "exit":
        exit_distributed()
    else:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
