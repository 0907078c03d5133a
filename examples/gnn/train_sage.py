"""3-layer GraphSAGE node classification with dsx.direct sampling, data parallel through dsx.initialize.

python examples/gnn/train_sage.py                      # synthetic R-MAT, one process (CPU or GPU)
deepspeed --num_gpus 2 examples/gnn/train_sage.py      # one rank per GPU, each its own seed share
python examples/gnn/train_sage.py --dataset graph.pt   # a torch.save'd torch_geometric Data
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch_geometric.nn import SAGEConv
from torch_geometric.utils import trim_to_layer
from tqdm import tqdm

import dsx
from dsx.data.rmat import rmat_graph
from dsx.direct import DistributedNeighborLoader


class SAGE(torch.nn.Module):
    def __init__(self, d_in: int, d_hid: int, d_out: int, layers: int = 3) -> None:
        super().__init__()
        dims = [d_in] + [d_hid] * (layers - 1) + [d_out]
        self.convs = torch.nn.ModuleList(SAGEConv(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x, edge_index, nsn, nse):
        for i, conv in enumerate(self.convs):
            x, edge_index, _ = trim_to_layer(i, nsn, nse, x, edge_index)
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = F.relu(x)
        return x


def load(args):
    if args.dataset:
        if os.path.isfile(args.dataset):
            return torch.load(args.dataset, weights_only=False)
        import torch_geometric.datasets as D

        return getattr(D, args.dataset_class)(args.dataset)[0]
    return rmat_graph(args.nodes, args.edges, args.features, args.classes, seed=0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=20000)
    p.add_argument("--edges", type=int, default=200000)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--dataset", default=None, help="torch.save'd Data file, or a PyG dataset root")
    p.add_argument("--dataset-class", default="Planetoid")
    p.add_argument("--fanouts", default="15,10,5")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.003)
    p.add_argument("--feature-placement", choices=["host", "gpu"], default="host")
    p.add_argument(
        "--deepspeed_config", default=os.path.join(os.path.dirname(__file__), "../../configs/gnn_sage.json")
    )
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--log-json", default=None)
    args = p.parse_args()

    # a plain `python train_sage.py` is a world of one: give deepspeed the env the launcher would
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    data = load(args)
    num_classes = int(data.y.max()) + 1
    device = (
        torch.device("cuda", max(args.local_rank, 0)) if torch.cuda.is_available() else torch.device("cpu")
    )
    model = SAGE(data.num_features, args.hidden, num_classes)
    # a torch optimizer: DeepSpeed's FusedAdam would JIT-build a C++/CUDA op that CPU ranks may lack
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    engine, _, _, _ = dsx.initialize(model=model, optimizer=opt, config=args.deepspeed_config)
    if device.type == "cuda":
        if args.feature_placement == "gpu":
            data.x = data.x.to(device)
        else:
            try:  # zero-copy gathers from pinned host memory (direct-ut's UnifiedTensor)
                data.x = dsx.direct.unified(data.x)
            except AttributeError:
                pass
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(data.num_nodes, generator=g)
    n_train = int(0.8 * data.num_nodes)
    train_idx, test_idx = perm[:n_train], perm[n_train:]
    fan = [int(f) for f in args.fanouts.split(",")]
    train = DistributedNeighborLoader(
        data,
        fan,
        batch_size=args.batch_size,
        shuffle=True,
        input_nodes=train_idx,
        device=device,
        engine=engine,
    )
    test = DistributedNeighborLoader(
        data, fan, batch_size=args.batch_size, input_nodes=test_idx, device=device
    )
    rank = train.rank
    log = {"epochs": []}
    for epoch in range(args.epochs):
        train.set_epoch(epoch)
        engine.train()
        t0 = time.perf_counter()
        loss_sum = 0.0
        for b in tqdm(train, desc=f"epoch {epoch}", disable=rank != 0):
            out = engine(b.x.float(), b.edge_index, b.num_sampled_nodes, b.num_sampled_edges)
            loss = F.cross_entropy(out[: b.batch_size], b.y[: b.batch_size])
            engine.backward(loss)
            engine.step()
            loss_sum += float(loss)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        engine.eval()
        correct = total = 0
        with torch.no_grad():
            for b in test:
                out = engine(b.x.float(), b.edge_index, b.num_sampled_nodes, b.num_sampled_edges)
                correct += int((out[: b.batch_size].argmax(1) == b.y[: b.batch_size]).sum())
                total += b.batch_size
        stats = torch.tensor([correct, total], dtype=torch.float64)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(stats)
        acc = float(stats[0] / stats[1])
        log["epochs"].append(
            {"epoch": epoch, "loss": loss_sum / max(len(train), 1), "acc": acc, "time_s": dt}
        )
        if rank == 0:
            print(
                f"epoch {epoch}: loss {loss_sum / max(len(train), 1):.4f} test acc {acc:.4f} time {dt:.2f}s"
            )
    if rank == 0:
        print(f"final accuracy {log['epochs'][-1]['acc']:.4f}, epoch time {log['epochs'][-1]['time_s']:.2f}s")
        if args.log_json:
            with open(args.log_json, "w") as f:
                json.dump(log, f)


if __name__ == "__main__":
    main()
