"""Pipelined mini-batch loader over :class:`~dsx.direct.sampler.NeighborSampler`, PyG ``NeighborLoader`` form.

Batch i+1 is sampled and its features gathered by a background thread — on a side CUDA stream when the
loader runs on a GPU — while batch i trains. The consumer waits on a CUDA event (never on the host) and
``record_stream`` marks the batch's tensors as used by the consumer's stream, so the caching allocator
does not recycle them early.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch

from dsx.direct.sampler import NeighborSampler, csr_from_edge_index

__all__ = ["DistributedNeighborLoader", "NeighborLoader", "attach"]

_SECTION: dict[str, Any] = {}  # "unified" config section stored by attach(); loaders with engine= read it

_PYG_UNSUPPORTED = (
    "replace", "subgraph_type", "disjoint", "temporal_strategy", "time_attr", "weight_attr",
    "transform", "transform_sampler_output", "is_sorted", "filter_per_worker", "neighbor_sampler",
    "directed", "input_time", "num_workers", "persistent_workers", "collate_fn", "pin_memory",
)  # fmt: skip


class _Handle:
    def __init__(self, key: int) -> None:
        self.key = key

    def close(self) -> None:
        _SECTION.pop(self.key, None)


def attach(engine: Any, section: Any, runtime: Any) -> _Handle:
    """Feature hook for the ``"dsx"."unified"`` section: loaders built with ``engine=`` use its settings."""
    _SECTION[id(engine)] = section
    return _Handle(id(engine))


def _gather(features: Any, index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rows ``features[index]`` on ``device``: zero-copy ``UnifiedTensor.gather`` when available."""
    if hasattr(features, "gather") and not isinstance(features, torch.Tensor):
        return features.gather(index.to(device))
    if features.device == device:
        return features.index_select(0, index)
    return features.index_select(0, index.to(features.device)).to(device, non_blocking=True)


class NeighborLoader:
    """Drop-in for ``torch_geometric.loader.NeighborLoader`` on homogeneous graphs, sampling on the GPU.

    Parameters
    ----------
    data : torch_geometric.data.Data
        Graph with ``edge_index`` and optional ``x`` (tensor or ``dsx.direct.UnifiedTensor``), ``y``.
    num_neighbors, batch_size, shuffle, input_nodes, drop_last
        As in PyG. Any other PyG keyword raises ``TypeError`` naming it.
    device : torch.device, optional
        Where sampling and batches live; default CUDA when available, else CPU. The CSR is built once and
        placed on ``device`` (a GPU graph of 62M edges takes ~1 GB).
    prefetch : int
        Batches prepared ahead by the background thread (0 = synchronous). ``engine=`` takes it from the
        attached ``unified`` section's ``prefetch_batches``.
    seed : int, optional
        Seeds the shuffle and the sampler: same seed, same batches.
    """

    def __init__(
        self,
        data: Any,
        num_neighbors: list[int],
        batch_size: int = 1,
        shuffle: bool = False,
        input_nodes: torch.Tensor | None = None,
        drop_last: bool = False,
        *,
        device: torch.device | str | None = None,
        prefetch: int | None = None,
        seed: int | None = None,
        engine: Any = None,
        **kwargs: Any,
    ) -> None:
        bad = sorted(kwargs)
        if bad:
            known = [k for k in bad if k in _PYG_UNSUPPORTED]
            raise TypeError(
                f"dsx.direct.NeighborLoader does not support {bad} "
                f"({'PyG options not implemented' if known else 'unknown keywords'}); remove them or use "
                "torch_geometric.loader.NeighborLoader"
            )
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if prefetch is None:
            sec = _SECTION.get(id(engine)) if engine is not None else None
            prefetch = getattr(sec, "prefetch_batches", 1) if sec is not None else 1
        self.prefetch = int(prefetch)
        self.data = data
        self.batch_size, self.shuffle, self.drop_last = int(batch_size), bool(shuffle), bool(drop_last)
        num_nodes = int(data.num_nodes)
        rowptr, col, perm = csr_from_edge_index(data.edge_index, num_nodes, device=self.device)
        self.sampler = NeighborSampler(
            rowptr, col, list(num_neighbors), perm=perm, device=self.device, seed=seed
        )
        if input_nodes is None:
            input_nodes = torch.arange(num_nodes)
        elif input_nodes.dtype == torch.bool:
            input_nodes = input_nodes.nonzero().squeeze(1)
        self.input_nodes = input_nodes.long().cpu()
        self.seed = seed if seed is not None else int(torch.randint(2**31, (1,)))
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _seeds(self) -> torch.Tensor:
        if not self.shuffle:
            return self.input_nodes
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return self.input_nodes[torch.randperm(self.input_nodes.numel(), generator=g)]

    def _batches(self) -> list[torch.Tensor]:
        seeds = self._seeds()
        chunks = list(seeds.split(self.batch_size))
        if self.drop_last and chunks and chunks[-1].numel() < self.batch_size:
            chunks.pop()
        return chunks

    def __len__(self) -> int:
        n = self.input_nodes.numel()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _make(self, input_id: torch.Tensor) -> Any:
        from torch_geometric.data import Data

        out = self.sampler.sample(input_id)
        batch = Data(edge_index=out.edge_index, num_nodes=out.n_id.numel())
        for key, value in self.data.items():
            if key in ("edge_index", "num_nodes"):
                continue
            if key == "edge_attr":
                batch.edge_attr = _gather(value, out.e_id, self.device)
            elif self.data.is_node_attr(key):
                batch[key] = _gather(value, out.n_id, self.device)
        batch.n_id, batch.e_id = out.n_id, out.e_id
        batch.input_id = input_id.to(self.device)
        batch.batch_size = out.batch_size
        batch.num_sampled_nodes, batch.num_sampled_edges = out.num_sampled_nodes, out.num_sampled_edges
        return batch

    def __iter__(self) -> Iterator[Any]:
        batches = self._batches()
        self.epoch += 1 if self.shuffle else 0
        if self.prefetch <= 0:
            for b in batches:
                yield self._make(b)
            return
        cuda = self.device.type == "cuda"
        side = torch.cuda.Stream(self.device) if cuda else None
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def work() -> None:
            try:
                for b in batches:
                    if stop.is_set():
                        return
                    if cuda:
                        with torch.cuda.stream(side):
                            batch = self._make(b)
                            ev = torch.cuda.Event()
                            ev.record(side)
                    else:
                        batch, ev = self._make(b), None
                    q.put((batch, ev))
                q.put(None)
            except BaseException as e:  # surface sampler errors in the consumer, not a silent hang
                q.put(e)

        t = threading.Thread(target=work, daemon=True, name="dsx-neighbor-loader")
        t.start()
        try:
            while True:
                item = q.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                batch, ev = item
                if ev is not None:
                    cur = torch.cuda.current_stream(self.device)
                    cur.wait_event(ev)
                    for _, v in batch.items():
                        if isinstance(v, torch.Tensor) and v.is_cuda:
                            v.record_stream(cur)
                yield batch
        finally:
            stop.set()
            while t.is_alive():  # drain so the worker can exit
                try:
                    q.get(timeout=0.1)
                except queue.Empty:
                    pass


class DistributedNeighborLoader(NeighborLoader):
    """Each rank gets its own share of seeds per epoch: one seeded permutation on all ranks, split by rank.

    Every rank yields the same number of batches (the permutation is padded by wrapping, as
    ``DistributedSampler`` does), so DeepSpeed's gradient all-reduce never waits for a missing rank.
    ``rank``/``world_size`` default to ``torch.distributed``'s.
    """

    def __init__(self, *args: Any, rank: int | None = None, world_size: int | None = None, **kw: Any) -> None:
        import torch.distributed as dist

        init = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if init else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if init else 1)
        if kw.get("seed") is None:
            kw["seed"] = 0  # ranks must agree on the permutation
        super().__init__(*args, **kw)

    def _seeds(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        n = self.input_nodes.numel()
        order = torch.randperm(n, generator=g) if self.shuffle else torch.arange(n)
        per = -(-n // self.world_size)
        if per * self.world_size > n:
            order = torch.cat([order, order[: per * self.world_size - n]])
        return self.input_nodes[order[self.rank * per : (self.rank + 1) * per]]

    def __len__(self) -> int:
        per = -(-self.input_nodes.numel() // self.world_size)
        return per // self.batch_size if self.drop_last else -(-per // self.batch_size)
