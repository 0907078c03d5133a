"""Mini-batch RGCN / RGAT / HGT on an ogbn-mag-shaped graph: dsx's pipeline against PyG's, in one run.

One process, one graph (``dsx.data.mag.synthetic_mag``: ogbn-mag's counts at ``--scale 1``), one model
(``dsx.models.hetero_gnn.HeteroClassifier``, two layers, fanouts [25, 20], batch 1024). Pipelines:

* ``pyg_w{N}``: ``torch_geometric.loader.NeighborLoader`` on the ``HeteroData`` (CPU sampling with pyg-lib or
  torch-sparse, ``num_workers`` N, persistent), batches copied to the GPU, PyG's layers;
* ``dsx_host``: ``dsx.direct.HeteroNeighborLoader`` (GPU sampling, paper features in host memory as a
  unified tensor) feeding dsx's fused layers;
* ``dsx_gpu``: the same with the features in GPU memory.

Every pipeline trains (forward, backward, Adam) ``--batches`` batches after ``--warmup`` and after its
loader's queue, filled while it was idle, is empty (``untimed_batches`` in the JSON), ``--repeats`` times,
the pipelines interleaved within each repeat so that drifts of the machine touch all of them, and each timed
once the PyG workers before it are idle (they keep sampling ahead after their timed batches); the
figure is the median batch time with its spread (min, max), and the epoch time is that median times the
batches of an epoch (extrapolated, and said so in the JSON). ``prep_ms`` is dsx's per-batch graph
preparation (typed layout and ``dsx.rgnn.prepare``) timed alone on the same batches; ``--prepare-graph
loader`` moves it from the step into the loader's pipeline (``dsx.rgnn.PrepareGraph``), and ``--breakdown``
shows what the step waits for: its stages, dsx's loader alone and step alone (a batch time near the larger of
the two is a pipeline that overlaps them), and a profile of dsx's steps. ``--learn-steps N`` then trains dsx_gpu and the fastest PyG pipeline N steps
each from the same initial weights, once for each of ``--learn-seeds`` seeds, and records the loss curves and
the validation accuracies: the same learning, not only the same speed, judged against the seed-to-seed spread.
``--merge`` keeps the models of an earlier run's JSON that this run does not run (one model per job; each model
keeps its own ``config``, the top-level one is the last job's), and refuses runs of other graph or model settings.

    python benchmarks/bench_hetero.py                  # H100: ogbn-mag's size, the three models
    python benchmarks/bench_hetero.py --quick          # CPU smoke test (PyG runs need pyg-lib or torch-sparse)
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import add_common_args, environment, save_png, write_json

import dsx.direct
import dsx.rgnn as rg
from dsx.data.mag import synthetic_mag
from dsx.models.hetero_gnn import MODELS, HeteroClassifier

NAME = "bench_hetero"
_WAIT_FLOOR_S = 0.01  # the shortest wait for the loader that ends a drain


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_common_args(p)
    p.add_argument("--scale", type=float, default=1.0, help="graph size relative to ogbn-mag")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: rgcn, rgat, hgt")
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the model")
    p.add_argument("--heads", type=int, default=2, help="attention heads (rgat, hgt)")
    p.add_argument("--batch-size", type=int, default=1024, help="seed papers per batch")
    p.add_argument("--fanouts", default="25,20", help="neighbours sampled per hop and edge type")
    p.add_argument("--batches", type=int, default=20, help="timed batches per pipeline and repeat")
    p.add_argument("--warmup", type=int, default=3, help="batches before the timed ones")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (median and spread)")
    p.add_argument("--pyg-workers", default="4,8,12", help="PyG NeighborLoader num_workers to try")
    p.add_argument("--learn-steps", type=int, default=100, help="steps of the same-learning comparison")
    p.add_argument("--learn-seeds", type=int, default=3,
                   help="initial weights the same-learning comparison runs from, one run each (the loaders "
                        "go on with their sample order)")  # fmt: skip
    p.add_argument("--breakdown", type=int, default=0, metavar="N",
                   help="also time N batches per pipeline stage by stage (wait for the batch, forward, "
                        "backward, optimizer), dsx's loader alone and step alone, and trace dsx's steps with "
                        "torch.profiler: where a batch's time goes")  # fmt: skip
    p.add_argument("--prepare-graph", choices=["step", "loader"], default="step",
                   help="where dsx prepares each batch's graph: in the training step (the layers' first call) "
                        "or in the loader's pipeline (dsx.rgnn.PrepareGraph)")  # fmt: skip
    p.add_argument("--merge", action="store_true",
                   help="keep the models of the existing <out>/bench_hetero.json that this run does not run")  # fmt: skip
    p.add_argument(
        "--trace-dir", default=None, help="where --breakdown's Chrome traces go (default: a temp dir)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.scale, args.hidden, args.batch_size, args.fanouts = 0.002, 16, 64, "5,4"
        args.batches, args.warmup, args.repeats, args.pyg_workers, args.learn_steps = 3, 1, 3, "0", 6
        args.learn_seeds = 2
    return args


class _Pipeline:
    """A loader and its model: ``step()`` trains on the next batch (a new epoch when one ends)."""

    def __init__(
        self, name: str, loader: Any, model: torch.nn.Module, dev: torch.device, target: str
    ) -> None:
        self.name, self.loader, self.model, self.dev, self.target = name, loader, model.to(dev), dev, target
        self.opt = torch.optim.Adam(self.model.parameters(), lr=3e-3)
        self._it = None
        self.last_wait = 0.0  # seconds the last next_batch() waited for the loader
        self.drained = 0  # batches the last drain() trained before the timed ones

    def next_batch(self) -> Any:
        for _ in range(2):
            if self._it is None:
                self._it = iter(self.loader)
            try:
                t0 = time.perf_counter()
                b = next(self._it)
                self.last_wait = time.perf_counter() - t0
                return b.to(self.dev, non_blocking=True) if self.name.startswith("pyg") else b
            except StopIteration:
                self._it = None
        raise RuntimeError(f"{self.name}: the loader yields no batches")

    def step(self, b: Any | None = None) -> torch.Tensor:
        b = self.next_batch() if b is None else b
        k = b[self.target].batch_size
        nodes = {t: b[t].num_nodes for t in b.node_types}
        out = self.model(b.x_dict, b.edge_index_dict, nodes)[:k]
        loss = F.cross_entropy(out, b[self.target].y[:k])
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss.detach()

    def stages(self, n: int) -> dict[str, float]:
        """Median ms per stage over ``n`` batches, the device synchronised after each stage."""
        ms: dict[str, list[float]] = {k: [] for k in ("batch", "forward", "backward", "optimizer")}
        for _ in range(n):
            _sync(self.dev)
            t = [time.perf_counter()]
            b = self.next_batch()
            k = b[self.target].batch_size
            _sync(self.dev)
            t.append(time.perf_counter())
            out = self.model(b.x_dict, b.edge_index_dict, {t_: b[t_].num_nodes for t_ in b.node_types})[:k]
            loss = F.cross_entropy(out, b[self.target].y[:k])
            _sync(self.dev)
            t.append(time.perf_counter())
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            _sync(self.dev)
            t.append(time.perf_counter())
            self.opt.step()
            _sync(self.dev)
            t.append(time.perf_counter())
            for key, a, z in zip(ms, t, t[1:]):
                ms[key].append(1e3 * (z - a))
        return {k: statistics.median(v) for k, v in ms.items()}

    def alone(self, n: int) -> dict[str, float]:
        """Median ms per batch of the loader alone (``n`` batches, no step: its own pace) and of the step
        alone (on ``n`` batches taken first: the step's pace; a loader's ``transform``, whose cache keeps a
        few batches' work, is applied again, untimed, before each). A pipeline whose batch time is near the
        larger of the two overlaps them; near their sum, it runs them one after the other."""
        self._close_iterator()
        loader_ms = []
        for i in range(n + 2):  # (the first two start the pipeline)
            _sync(self.dev)
            t0 = time.perf_counter()
            self.next_batch()  # (into the next epoch if this one ends)
            _sync(self.dev)
            if i >= 2:
                loader_ms.append(1e3 * (time.perf_counter() - t0))
        ready = [self.next_batch() for _ in range(n + 1)]
        self._close_iterator()  # (its prefetched batches are dropped: nothing samples while the step runs)
        transform = getattr(self.loader, "transform", None)
        step_ms = []
        for i, b in enumerate(ready):
            b = b if transform is None else transform(b)
            _sync(self.dev)
            t0 = time.perf_counter()
            self.step(b)
            _sync(self.dev)
            if i:  # (the first wakes the step from the loader's run)
                step_ms.append(1e3 * (time.perf_counter() - t0))
        return {"loader_alone": statistics.median(loader_ms), "step_alone": statistics.median(step_ms)}

    def _close_iterator(self) -> None:
        close = getattr(self._it, "close", None)  # dsx's loaders iterate in a generator
        if close is not None:
            close()
        self._it = None

    @property
    def workers(self) -> int:
        """The loader's worker processes (PyG's ``num_workers``); 0 for dsx's, which has none."""
        return int(getattr(self.loader, "num_workers", 0) or 0)

    def buffered(self) -> int:
        """Batches the loader prepares ahead of the caller: PyG's ``prefetch_factor`` x ``num_workers``,
        dsx's ``prefetch``. Served from a full queue, these would time the training step, not the loader."""
        if self.workers:
            return (self.loader.prefetch_factor or 2) * self.workers
        return int(getattr(self.loader, "prefetch", 0))

    def ready(self) -> int | None:
        """Batches a torch ``DataLoader``'s workers hold finished now (in its result queue, or stashed
        because they came out of order); None for loaders that do not say (dsx's)."""
        it = self._it
        queue, info = getattr(it, "_data_queue", None), getattr(it, "_task_info", None)
        if queue is None or info is None:
            return None
        try:
            waiting = queue.qsize()
        except (NotImplementedError, OSError):  # (macOS's multiprocessing queues have no qsize)
            return None
        return waiting + sum(1 for v in list(info.values()) if len(v) == 2)

    def drain(self, warmup: int) -> int:
        """Train ``warmup`` batches or the queued ones, whichever are more, then on until the queue that filled
        while the pipeline was idle is empty: the first batch the loader makes the step wait for (well beyond
        what the first ready batches took), at most ``4 x`` :meth:`buffered` batches (a loader that keeps
        ahead of the step never empties it). What follows is an epoch's steady state, not batches sampled
        while nothing was timed. Returns the batches trained.

        A torch ``DataLoader`` that keeps ahead says so sooner. Each worker holds ``prefetch_factor`` tasks,
        so more ready batches than ``buffered() - num_workers`` mean some worker has all of its batches ready
        and idles. Once the queued batches are trained, a worker idle after each of ``num_workers``
        consecutive steps that did not wait (a whole round of the workers: a slow batch that held the others'
        finished ones back would have made one of them wait) shows the step sets the pace; the drain stops
        there."""
        waits: list[float] = []
        # the queued batches are served first, however long unpacking one of them takes
        first = max(warmup, self.buffered())
        cap = warmup + 4 * self.buffered()
        workers = self.workers
        ahead = 0  # consecutive steps since the queued ones that found a worker idle
        for i in range(cap):
            self.step()
            if len(waits) < 3:
                waits.append(self.last_wait)
            # (a wait is at least 10 ms: taking a ready batch off the queue can take several ms on a busy host)
            elif i >= first and self.last_wait > max(_WAIT_FLOOR_S, 3 * statistics.median(waits)):
                return i + 1
            if workers and i >= first:  # (the batches after the queued ones: a round made during the drain)
                ready = self.ready()
                ahead = ahead + 1 if ready is not None and ready > self.buffered() - workers else 0
                if ahead >= workers:
                    return i + 1
        return cap

    def time_batches(self, warmup: int, n: int) -> float:
        """Seconds per batch over ``n`` batches after :meth:`drain`, at least one per loader worker (a round
        of every worker: fewer could fall between two slow ones); then :meth:`quiesce`."""
        n = max(n, self.workers)
        self.drained = self.drain(warmup)
        _sync(self.dev)
        t0 = time.perf_counter()
        for _ in range(n):
            self.step()
        _sync(self.dev)
        seconds = (time.perf_counter() - t0) / n
        self.quiesce()
        return seconds

    def quiesce(self, timeout_s: float = 60.0) -> float:
        """Wait until this pipeline's loader workers are idle; the seconds waited.

        PyG's workers keep sampling after the timed batches (``prefetch_factor`` x ``num_workers`` batches in
        flight, up to seconds of every core): the next pipeline would be timed against that leftover work.
        Idle means no CPU time charged to any worker over a quarter second (``/proc``; elsewhere no wait).
        """
        workers = getattr(self._it, "_workers", None)
        if not workers:
            return 0.0

        def ticks() -> int | None:
            try:
                return sum(sum(map(int, Path(f"/proc/{w.pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13]))
                           for w in workers)  # fmt: skip
            except (OSError, ValueError, IndexError):
                return None

        t0, last = time.perf_counter(), ticks()
        while last is not None and time.perf_counter() - t0 < timeout_s:
            time.sleep(0.25)
            now = ticks()
            if now is None or now == last:
                break
            last = now
        return time.perf_counter() - t0


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _prep_ms(pipe: _Pipeline, batches: int) -> float:
    """dsx's per-batch graph preparation alone, as the model's layers do it in a step (typed layout, then
    ``dsx.rgnn.prepare`` building the maps that model reads), caches cleared: median ms. The batches are taken
    first and the loader's prefetching let finish, so that its thread does not share the host meanwhile; two
    untimed preparations then wake the host and the GPU from that pause (a step never starts from idle)."""
    prep = rg.PrepareGraph(pipe.model)
    ready = [pipe.next_batch() for _ in range(batches + 2)]
    _sync(pipe.dev)
    time.sleep(0.5)  # the loader fills its prefetch queue (a few batches of ~10 ms) and waits
    for b in ready[:2]:
        prep(b)
    times = []
    for b in ready[2:]:
        rg.clear_cache()
        _sync(pipe.dev)
        t0 = time.perf_counter()
        prep(b)
        _sync(pipe.dev)
        times.append(time.perf_counter() - t0)
    rg.clear_cache()
    return 1e3 * statistics.median(times)


def _trace(pipe: _Pipeline, steps: int, trace_dir: Path) -> dict[str, Any]:
    """``steps`` steps of ``pipe`` under torch.profiler: the GPU's busy time, host blocking (see
    ``_kernel_trace``) and the kernels that took the most time."""
    from _kernel_trace import summarize
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if pipe.dev.type == "cuda" else [])
    pipe.step()
    _sync(pipe.dev)
    with profile(activities=acts) as prof:
        for _ in range(steps):
            pipe.step()
        _sync(pipe.dev)
    trace_dir.mkdir(parents=True, exist_ok=True)
    path = trace_dir / f"{pipe.name}.json"
    prof.export_chrome_trace(str(path))
    ev = prof.key_averages()
    kernels = sorted(
        (e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: -e.self_device_time_total,
    )
    out = summarize(path) if pipe.dev.type == "cuda" else {}
    return {"steps": steps, **out,
            "top_kernels_ms_per_step": {e.key[:80]: round(e.self_device_time_total / 1e3 / steps, 3)
                                        for e in kernels[:15]},
            "kernel_launches_per_step": sum(e.count for e in kernels) / steps}  # fmt: skip


def _learn(pipe: _Pipeline, model0: torch.nn.Module, steps: int, val: Any, target: str) -> dict[str, Any]:
    """Train ``steps`` steps from ``model0``'s weights; the loss curve and the accuracy on ``val`` batches."""
    pipe.model.load_state_dict(model0.state_dict())
    pipe.opt = torch.optim.Adam(pipe.model.parameters(), lr=3e-3)
    losses = [float(pipe.step()) for _ in range(steps)]
    correct = total = 0
    with torch.no_grad():
        for b in val:
            b = b.to(pipe.dev, non_blocking=True)
            k = b[target].batch_size
            out = pipe.model(b.x_dict, b.edge_index_dict, {t: b[t].num_nodes for t in b.node_types})[:k]
            correct += int((out.argmax(1) == b[target].y[:k]).sum())
            total += k
    return {"losses": losses, "val_acc": correct / max(total, 1), "val_seeds": total}


def _same_learning(
    by: dict[str, _Pipeline],
    best: str | None,
    model_for: Any,
    data: Any,
    fanouts: list[int],
    val_idx: torch.Tensor,
    target: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """dsx_gpu and the fastest PyG pipeline trained ``args.learn_steps`` steps from the same initial weights,
    once per seed (the seeds interleaved): the validation accuracy per seed, and whether the gap between the
    two pipelines' means lies within the seed-to-seed spread (the noise of one run)."""
    from torch_geometric.loader import NeighborLoader as PygLoader

    dev = by["dsx_gpu"].dev
    val = {"dsx_gpu": dsx.direct.HeteroNeighborLoader(data, fanouts, (target, val_idx),
                                                      batch_size=args.batch_size, device=dev,
                                                      feature_placement="gpu", prefetch=0)}  # fmt: skip
    if best in by:
        val[best] = PygLoader(
            data, num_neighbors=fanouts, input_nodes=(target, val_idx), batch_size=args.batch_size
        )
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in val}
    errors: dict[str, str] = {}
    for seed in range(args.learn_seeds):
        model0 = model_for(seed)
        for name in [n for n in runs if n not in errors]:
            torch.manual_seed(seed)
            try:
                runs[name].append(
                    {"seed": seed, **_learn(by[name], model0, args.learn_steps, val[name], target)}
                )
            except torch.OutOfMemoryError as exc:
                errors[name] = f"OutOfMemoryError: {exc}"[:300]
                torch.cuda.empty_cache()
    val["dsx_gpu"].close()
    out: dict[str, Any] = {
        "steps": args.learn_steps,
        "seeds": args.learn_seeds,
        "runs": runs,
        "errors": errors,
    }
    acc = {name: [r["val_acc"] for r in rs] for name, rs in runs.items() if rs}
    out["val_acc"] = {name: {"mean": statistics.fmean(a), "min": min(a), "max": max(a), "all": a}
                      for name, a in acc.items()}  # fmt: skip
    if best in acc and len(acc) == 2:
        gap = statistics.fmean(acc["dsx_gpu"]) - statistics.fmean(acc[best])
        noise = max(max(a) - min(a) for a in acc.values())
        out["gap_dsx_minus_pyg"], out["seed_spread"] = gap, noise
        out["within_noise"] = abs(gap) <= noise if len(acc["dsx_gpu"]) > 1 else None
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fanouts = [int(k) for k in args.fanouts.split(",")]
    t0 = time.perf_counter()
    data = synthetic_mag(args.scale, seed=0)
    target, meta = "paper", data.metadata()
    train_idx = data[target].train_mask.nonzero().view(-1)
    val_idx = data[target].val_mask.nonzero().view(-1)[: 8 * args.batch_size]
    res: dict[str, Any] = {
        "config": vars(args), "env": environment(), "graph_generation_s": time.perf_counter() - t0,
        "graph": {"nodes": {t: int(data[t].num_nodes) for t in data.node_types},
                  "edges": int(sum(data[e].edge_index.size(1) for e in data.edge_types))},
        "batches_per_epoch": math.ceil(train_idx.numel() / args.batch_size),
        "note": "epoch_s = median batch time x batches_per_epoch (extrapolated from the timed batches)",
        "models": {},
    }  # fmt: skip
    earlier = Path(args.out) / f"{NAME}.json"
    res["model_runs_utc"] = {}  # when each model in the file ran (a merged file holds models of several runs)
    if args.merge and earlier.exists():
        before = json.loads(earlier.read_text())
        kept = before.get("models", {})
        res["models"] = {m: r for m, r in kept.items() if m not in args.models.split(",")}
        res["model_runs_utc"] = {
            m: t for m, t in before.get("model_runs_utc", {}).items() if m in res["models"]
        }
        same = ("scale", "hidden", "heads", "batch_size", "fanouts")
        for m, r in res["models"].items():
            differ = {k: (r.get("config", {}).get(k), vars(args)[k]) for k in same
                      if r.get("config", {}).get(k) != vars(args)[k]}  # fmt: skip
            if differ:
                raise SystemExit(
                    f"--merge: {earlier} holds {m} run with other settings {differ} (theirs, this run's); "
                    "run every model with the same settings, or write to another --out"
                )
    in_ch = {target: data[target].x.size(1)}
    workers = [int(w) for w in args.pyg_workers.split(",") if w != ""]
    classes = int(data[target].y.max()) + 1
    for model_name in args.models.split(","):

        def model_for(seed: int, layers: str = "dsx", model_name: str = model_name) -> torch.nn.Module:
            """The model at ``seed``'s initial weights; ``layers="pyg"``: its PyG twin (same parameters)."""
            torch.manual_seed(seed)
            return HeteroClassifier(model_name, meta, in_ch, args.hidden, classes, heads=args.heads,
                                    num_layers=len(fanouts), layers=layers)  # fmt: skip

        model0 = model_for(0)
        out = res["models"][model_name] = {"config": vars(args), "runs": {}}
        res["model_runs_utc"][model_name] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        pipes: list[_Pipeline] = []
        # PyG first: its workers fork before dsx registers host memory with CUDA
        for w in workers:
            name = f"pyg_w{w}"
            try:
                from torch_geometric.loader import NeighborLoader as PygLoader

                loader = PygLoader(data, num_neighbors=fanouts, input_nodes=(target, train_idx),
                                   batch_size=args.batch_size, shuffle=True, num_workers=w,
                                   persistent_workers=w > 0)  # fmt: skip
                twin = model_for(0, layers="pyg")
                twin.load_state_dict(model0.state_dict())
                pipe = _Pipeline(name, loader, twin, dev, target)
                pipe.next_batch()  # starts the workers now; PyG without pyg-lib / torch-sparse fails here
                pipes.append(pipe)
            except Exception as exc:
                out["runs"][name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                print(model_name, name, out["runs"][name], flush=True)
        for name, placement in (("dsx_host", "host"), ("dsx_gpu", "gpu")):
            model = copy.deepcopy(model0).to(dev)
            prep = rg.PrepareGraph(model) if args.prepare_graph == "loader" else None
            loader = dsx.direct.HeteroNeighborLoader(data, fanouts, (target, train_idx),
                                                     batch_size=args.batch_size, shuffle=True, device=dev,
                                                     feature_placement=placement, prefetch=2,
                                                     transform=prep)  # fmt: skip
            pipes.append(_Pipeline(name, loader, model, dev, target))
        times: dict[str, list[float]] = {p.name: [] for p in pipes}
        drained: dict[str, list[int]] = {p.name: [] for p in pipes}
        for p in pipes:  # the PyG workers started above fill their queues: none is timed against that work
            p.quiesce()
        for rep in range(args.repeats):
            for p in pipes:
                try:
                    times[p.name].append(p.time_batches(args.warmup, args.batches))
                    drained[p.name].append(p.drained)
                except torch.OutOfMemoryError as exc:
                    out["runs"][p.name] = {"error": f"OutOfMemoryError: {exc}"[:300]}
                    pipes = [q for q in pipes if q is not p]
                    torch.cuda.empty_cache()
                print(
                    model_name,
                    rep,
                    p.name,
                    f"{1e3 * times[p.name][-1]:.1f} ms" if times[p.name] else "",
                    flush=True,
                )
        for name, ts in times.items():
            if ts and name not in out["runs"]:
                med = statistics.median(ts)
                out["runs"][name] = {"batch_ms": 1e3 * med, "batch_ms_min": 1e3 * min(ts),
                                     "batch_ms_max": 1e3 * max(ts), "batch_ms_all": [1e3 * t for t in ts],
                                     "untimed_batches": drained[name],
                                     "epoch_s": med * res["batches_per_epoch"]}  # fmt: skip
        by = {p.name: p for p in pipes}
        if args.breakdown:
            out["breakdown_ms"] = {p.name: p.stages(args.breakdown) for p in pipes}
            traces = Path(args.trace_dir or tempfile.mkdtemp(prefix="bench_hetero_traces_")) / model_name
            out["trace"] = {p.name: _trace(p, 3, traces) for p in pipes if p.name.startswith("dsx")}
            for p in pipes:  # (after the trace, which continues the warm pipeline)
                if p.name.startswith("dsx"):
                    out["breakdown_ms"][p.name].update(p.alone(args.breakdown))
            print(model_name, "breakdown", out["breakdown_ms"], out["trace"], flush=True)
        if "dsx_gpu" in by:
            out["prep_ms"] = _prep_ms(by["dsx_gpu"], max(10, args.batches))
            out["prep_share_of_batch"] = out["prep_ms"] / out["runs"]["dsx_gpu"]["batch_ms"]
        pyg = {k: r["epoch_s"] for k, r in out["runs"].items() if k.startswith("pyg") and "epoch_s" in r}
        best = min(pyg, key=pyg.get) if pyg else None
        host, gpu = out["runs"].get("dsx_host", {}), out["runs"].get("dsx_gpu", {})
        out["summary"] = {
            "best_pyg": best,
            "speedup_host_vs_best_pyg": pyg[best] / host["epoch_s"] if best and "epoch_s" in host else None,
            "speedup_gpu_vs_best_pyg": pyg[best] / gpu["epoch_s"] if best and "epoch_s" in gpu else None,
            "host_over_gpu": host["epoch_s"] / gpu["epoch_s"]
            if "epoch_s" in host and "epoch_s" in gpu
            else None,
        }
        for p in [q for q in pipes if q.name not in ("dsx_gpu", best)]:  # free their memory for learning
            if p.name.startswith("dsx"):
                p.loader.close()
            pipes.remove(p)
            by.pop(p.name)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if args.learn_steps and "dsx_gpu" in by:
            out["learning"] = _same_learning(by, best, model_for, data, fanouts, val_idx, target, args)
        print(model_name, out["summary"], f"{time.perf_counter() - t0:.0f} s", flush=True)
        res["models"] = {m: res["models"][m] for m in sorted(res["models"], key=list(MODELS).index)}
        write_json(res, args.out, NAME)  # after every model: a run cut short keeps the models it finished
        for p in pipes:
            if p.name.startswith("dsx"):
                p.loader.close()
        del pipes, by
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return res


def plot(res: dict[str, Any], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(res["models"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names = sorted({k for m in models for k, r in res["models"][m]["runs"].items() if "batch_ms" in r})
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        xs, ys, lo, hi = [], [], [], []
        for j, m in enumerate(models):
            r = res["models"][m]["runs"].get(name, {})
            if "epoch_s" in r:
                s = r["epoch_s"] / r["batch_ms"]
                xs.append(j + i * width)
                ys.append(r["epoch_s"])
                lo.append(max(0.0, r["epoch_s"] - r["batch_ms_min"] * s))
                hi.append(max(0.0, r["batch_ms_max"] * s - r["epoch_s"]))
        axes[0].bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=name)
    axes[0].set_xticks([j + 0.4 - width / 2 for j in range(len(models))], models)
    axes[0].set_ylabel("epoch time, s (median of repeats; bars: min..max)")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    axes[0].set_title(f"ogbn-mag-shaped graph x{res['config']['scale']}, fanouts {res['config']['fanouts']}")
    for m in models:
        learning = res["models"][m].get("learning", {})
        for name, rs in learning.get("runs", {}).items():
            if not rs:
                continue
            curves = torch.tensor([r["losses"] for r in rs])
            acc = learning["val_acc"][name]
            (line,) = axes[1].plot(curves.mean(0), label=f"{m} {name} (val acc {acc['mean']:.3f}, "
                                   f"{acc['min']:.3f}..{acc['max']:.3f})")  # fmt: skip
            axes[1].fill_between(range(curves.size(1)), curves.min(0).values, curves.max(0).values,
                                 color=line.get_color(), alpha=0.2)  # fmt: skip
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("training loss")
    axes[1].set_title("same initial weights: mean loss over seeds (band: min..max)")
    axes[1].legend(fontsize=8)
    save_png(fig, out, NAME)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    res = run(args)
    write_json(res, args.out, NAME)
    plot(res, args.out)
    return res


if __name__ == "__main__":
    main()
