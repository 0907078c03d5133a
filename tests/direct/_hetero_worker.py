"""Worker for tests/direct/test_hetero_loader.py, started by the deepspeed launcher (gloo, CPU accelerator).

argv: OUT_DIR. Each rank builds a DistributedHeteroNeighborLoader over the same graph and writes the seeds
of its batches for two epochs to OUT_DIR/rank<r>.json, after checking each batch against the reference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
import torch.distributed as dist

from dsx.direct import DistributedHeteroNeighborLoader
from dsx.runtime.process import exit_distributed
from tests.direct.test_hetero_loader import check_batch, hetero_graph


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    data = hetero_graph()
    loader = DistributedHeteroNeighborLoader(
        data, [3, 2], ("paper", None), batch_size=8, shuffle=True, device="cpu"
    )
    fanouts = {et: [3, 2] for et in data.edge_types}
    seeds = {}
    for epoch in range(2):
        loader.set_epoch(epoch)
        got = []
        for batch in loader:
            bs = batch["paper"].batch_size
            check_batch(data, batch, fanouts, "paper", batch["paper"].n_id[:bs])
            got += batch["paper"].n_id[:bs].tolist()
        seeds[epoch] = got
    out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "loader": [loader.rank, loader.world_size],
           "seeds": seeds, "num_papers": data["paper"].num_nodes}  # fmt: skip
    out_dir = next(a for a in sys.argv[1:] if not a.startswith("--"))  # (the launcher adds --local_rank)
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
    loader.close()


if __name__ == "__main__":
    main()
    exit_distributed()
