"""Scheduler telemetry out of the process: DeepSpeed's CSV monitor, the Chrome trace, ``dsx trace``."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

import dsx
from dsx.cli import main as dsx_main
from dsx.runtime.timeline import load_timeline
from dsx.runtime.trace import rank_path
from tests.harness import REPO, launch
from tests.offload._offload_models import TinyGPT

STEPS, INTERVAL = 5, 2
MICRO = 2


def _config(tmp: Path, **scheduler) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": scheduler.pop("accum", 1),
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "csv_monitor": {"enabled": True, "output_path": str(tmp / "csv"), "job_name": "job"},
        "dsx": {"scheduler": {"enabled": True, "io_workers": 2, "log_interval": INTERVAL, **scheduler}},
    }


def _train(engine, micro_steps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(micro_steps):
        loss = engine(torch.randint(0, 64, (MICRO, 16), generator=gen)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()


@pytest.fixture(scope="module")
def offload_run(tmp_path_factory) -> dict:
    """TinyGPT with every layer's activations offloaded to the host tier: real transfers and stalls."""
    tmp = tmp_path_factory.mktemp("trace")
    cfg = _config(tmp, trace_path=str(tmp / "trace.json"))
    cfg["dsx"]["activation_offload"] = {"enabled": True, "tiers": ["host"], "policy": "offload_all",
                                        "host_pool_gb": 0.05, "min_tensor_bytes": 0}  # fmt: skip
    torch.manual_seed(0)
    model = TinyGPT()
    engine, _, _, _ = dsx.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    _train(engine, STEPS)
    rt = dsx.runtime_of(engine)
    ended = rt.scheduler.telemetry.steps
    summary = rt.scheduler.telemetry.summary()
    rt.close()
    return {
        "csv": tmp / "csv" / "job",
        "trace": tmp / "trace.json",
        "ended": ended,
        "tmp": tmp,
        "summary": summary,
    }


def _csv(path: Path) -> list[tuple[int, float]]:
    with path.open() as f:
        rows = list(csv.reader(f))
    assert rows[0][0] == "step", rows[0]
    return [(int(s), float(v)) for s, v in rows[1:]]


def test_offload_ends_each_step_once(offload_run) -> None:
    # dsx's one engine.step wrapper ends the scheduler's step after each optimizer step, once, with offload on
    assert offload_run["ended"] == STEPS


def test_monitor_csv_rows_and_values(offload_run) -> None:
    d = offload_run["csv"]
    series = {k: _csv(d / f"dsx_{k}.csv") for k in ("compute_s", "transfer_s", "stall_s", "hook_s", "bytes_host", "bytes_host_read")}  # fmt: skip
    expected_steps = [MICRO * INTERVAL * (i + 1) for i in range(STEPS // INTERVAL)]  # global_samples
    for name, rows in series.items():
        assert [s for s, _ in rows] == expected_steps, name
    assert all(v > 0 for _, v in series["compute_s"])
    assert all(v >= 0 for _, v in series["stall_s"])
    assert all(v > 0 for _, v in series["transfer_s"])
    assert all(v > 0 for _, v in series["bytes_host"]) and all(v > 0 for _, v in series["bytes_host_read"])
    # DeepSpeed's own events land in the same folder: the dsx names sit beside them
    assert (d / "Train_Samples_lr.csv").is_file()


def test_trace_file_is_chrome_trace_with_lanes(offload_run) -> None:
    doc = json.loads(offload_run["trace"].read_text())
    events = doc["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    procs = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert procs == ["rank 0"] and doc["otherData"]["format"] == "dsx-trace"
    assert {"compute", "io:host", "io:host_read", "layers"} <= set(names.values())
    spans = [e for e in events if e["ph"] == "X"]
    steps = [e for e in spans if e["cat"] == "step"]
    assert [e["args"]["step"] for e in steps] == list(range(STEPS))
    assert all(names[e["tid"]] == "compute" for e in steps)
    by_lane = {lane: [e for e in spans if names[e["tid"]] == lane and e["cat"] != "step"] for lane in names.values()}  # fmt: skip
    assert by_lane["io:host"] and by_lane["io:host_read"]
    assert all(e["cat"] == "stall" for e in by_lane["compute"])
    # one host-side forward span per layer and step (offload_all: no recomputation)
    forwards = [e["name"] for e in by_lane["layers"]]
    layers = set(forwards)
    assert layers and all(name.startswith("forward ") for name in layers)
    assert len(forwards) == STEPS * len(layers), forwards
    assert all(e["dur"] >= 0 and 0 <= e["ts"] < 60e6 for e in spans)  # microseconds from the first step


def test_dsx_trace_draws_png(offload_run, capsys) -> None:
    png = offload_run["tmp"] / "timeline.png"
    assert dsx_main(["trace", str(offload_run["trace"]), "-o", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    out = capsys.readouterr().out
    assert f"steps 0..{STEPS - 1} ({STEPS})" in out
    for lane in ("compute", "io:host", "io:host_read"):
        assert any(line.startswith(f"{lane} ") and "% of wall" in line for line in out.splitlines()), out
    assert dsx_main(["trace", str(offload_run["trace"]), "-o", str(png), "--steps", "1:3"]) == 0
    assert "steps 1..2 (2)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "steps", "message"),
    [
        (None, None, "no such file"),
        ("not json", None, "not a JSON file"),
        ('{"traceEvents": []}', None, "not a dsx trace"),
        ("trace", "100:200", "no steps in that range; the trace holds steps 0..4"),
        ("trace", "one:two", "expected A:B"),
    ],
)
def test_dsx_trace_errors(offload_run, tmp_path, capsys, content, steps, message) -> None:
    path = offload_run["trace"] if content == "trace" else tmp_path / "t.json"
    if content not in (None, "trace"):
        path.write_text(content)
    argv = ["trace", str(path), "-o", str(tmp_path / "t.png"), *(["--steps", steps] if steps else [])]
    assert dsx_main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "t.png").exists()


def test_scheduler_alone_flushes_bounded_trace(tmp_path) -> None:
    """Only the scheduler enabled: one step per optimizer step (not per micro-step); the file is usable
    before close (a killed run) and holds the last ``trace_steps`` steps."""
    cfg = _config(tmp_path, accum=2, trace_path=str(tmp_path / "t.json"), trace_steps=3)
    model = TinyGPT()
    engine, _, _, _ = dsx.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rt = dsx.runtime_of(engine)
    _train(engine, 2 * 4)
    assert rt.scheduler.telemetry.steps == 4
    assert [s for s, *_ in load_timeline(tmp_path / "t.json").steps] == [1, 2, 3]  # flushed at step 4
    _train(engine, 2 * 3)
    rt.close()
    assert [s for s, *_ in load_timeline(tmp_path / "t.json").steps] == [4, 5, 6]
    assert len(_csv(tmp_path / "csv" / "job" / "dsx_stall_s.csv")) == 7 // INTERVAL
    assert engine.step.__func__ is type(engine).step  # close() gave engine.step back


class _TimedEvent:
    """A completed-or-not timing point with CUDA events' three calls (the telemetry's only contract)."""

    def __init__(self, ms: float, done: bool = True) -> None:
        self.ms, self.done = ms, done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, other: _TimedEvent) -> float:
        return other.ms - self.ms


def test_gpu_waits_resolve_into_their_step() -> None:
    """A device-side wait counts only when the data came after the stream reached it, and lands in the
    step that issued it even when the GPU finishes it after that step's end."""
    from dsx.runtime.telemetry import StepTelemetry

    tel = StepTelemetry()
    tel.add_gpu_wait(_TimedEvent(10.0), _TimedEvent(14.5), "unpack:layer3")  # 4.5 ms late
    tel.add_gpu_wait(_TimedEvent(20.0), _TimedEvent(12.0), "unpack:layer2")  # already there: no wait
    late = _TimedEvent(31.0, done=False)
    tel.add_gpu_wait(_TimedEvent(30.0), late, "gate:ssd")  # still running at the step's end
    tel.end_step()
    assert tel.history[0].gpu_wait_s == pytest.approx(4.5e-3)
    tel.add_gpu_wait(_TimedEvent(0.0), _TimedEvent(2.0), "unpack:layer1")
    tel.end_step()
    assert tel.history[1].gpu_wait_by == {"unpack": pytest.approx(2e-3)}
    assert tel.history[0].gpu_wait_by == {"unpack": pytest.approx(4.5e-3)}  # the late one not yet in
    summary = tel.summary()  # waits for what is still running
    assert late.done
    assert tel.history[0].gpu_wait_by == {"unpack": pytest.approx(4.5e-3), "gate": pytest.approx(1e-3)}
    assert summary["gpu_wait_by"] == {"unpack": pytest.approx(2e-3)}  # step 0 (warm-up) is left out
    assert summary["gpu_wait_s"] == pytest.approx(2e-3)
    # over every step, by kind (what the profiler leaves out of a warm-up step)
    assert tel.gpu_waited_s("unpack") == pytest.approx(6.5e-3) and tel.gpu_waited_s() == pytest.approx(7.5e-3)


def test_tier_busy_time_counts_overlapping_transfers_once() -> None:
    """A tier's rate is its bytes over the time at least one of its transfers ran: two overlapping writes
    take the drive for their union, not their sum."""
    from dsx.runtime.telemetry import StepTelemetry, union_s

    rng = torch.Generator().manual_seed(0)
    spans = [(float(a), float(a + b)) for a, b in torch.rand(40, 2, generator=rng).mul(10).tolist()]
    grid = torch.linspace(0, 20, 200_001)[:-1] + 5e-5  # midpoints of 1e-4 s cells
    covered = torch.zeros_like(grid, dtype=torch.bool)
    for t0, t1 in spans:
        covered |= (grid >= t0) & (grid < t1)
    assert union_s(spans) == pytest.approx(float(covered.sum()) * 1e-4, abs=1e-3)
    assert union_s([]) == 0.0

    tel = StepTelemetry()
    tel.end_step()  # step 0 (warm-up) is left out of the summary
    tel.add_transfer("ssd", 3 * 10**9, 0.0, 2.0)
    tel.add_transfer("ssd", 1 * 10**9, 1.0, 3.0)  # overlaps the first: the drive was busy 3 s, not 4
    tel.add_transfer("ssd_read", 2 * 10**9, 5.0, 6.0)
    tel.add_transfer("ssd_read", 2 * 10**9, 7.0, 8.0)  # apart: 2 s
    tel.end_step()
    assert tel.history[1].busy_by_tier == {"ssd": pytest.approx(3.0), "ssd_read": pytest.approx(2.0)}
    tel.add_transfer("ssd", 10**9, 10.0, 11.0)
    tel.end_step()
    summary = tel.summary()
    assert summary["busy_s_by_tier"] == {"ssd": pytest.approx(2.0), "ssd_read": pytest.approx(1.0)}
    assert summary["GBps_by_tier"] == {"ssd": pytest.approx(5 / 4), "ssd_read": pytest.approx(2.0)}


def test_offload_run_reports_the_host_tier_rate(offload_run) -> None:
    rt_summary = offload_run["summary"]
    assert rt_summary["busy_s_by_tier"]["host"] > 0
    # a real copy's rate: bytes moved over the time the tier's copies ran, above 1 MB/s even on a slow host
    assert rt_summary["GBps_by_tier"]["host"] > 1e-3
    assert rt_summary["busy_s_by_tier"]["host"] <= rt_summary["transfer_s"] + 1e-9


def test_offload_run_reports_its_hooks_host_time(offload_run) -> None:
    """Every layer moves: each step packs and unpacks, and the hooks' host time is part of the step's."""
    rt_summary = offload_run["summary"]
    assert rt_summary["hooks"] > 0
    assert 0 < rt_summary["hook_s"] < rt_summary["compute_s"] + rt_summary["stall_s"]


def test_hook_time_adds_up_per_step() -> None:
    from dsx.runtime.telemetry import StepTelemetry

    tel = StepTelemetry()
    tel.add_hook(1.0)  # step 0 (warm-up) is left out of the summary
    tel.end_step()
    for s in (2e-3, 3e-3, 5e-3):
        tel.add_hook(s)
    tel.end_step()
    tel.end_step()  # a step that moved nothing
    assert (tel.history[1].hook_s, tel.history[1].hooks) == (pytest.approx(1e-2), 3)
    assert tel.history[1].as_scalars()["hook_s"] == pytest.approx(1e-2)
    assert tel.summary()["hook_s"] == pytest.approx(5e-3) and tel.summary()["hooks"] == 1.5


def test_rank_path() -> None:
    assert rank_path("out/t.json", 0, 1) == Path("out/t.json")
    assert rank_path("out/t.json", 1, 2) == Path("out/t.rank1.json")
    assert rank_path("out/trace", 3, 4) == Path("out/trace.rank3")


@pytest.mark.slow
def test_gpt_trace_flag_two_ranks(tmp_path) -> None:
    """``--trace`` on the main job, launched on two ranks: one file per rank, ``.rank<r>`` before ``.json``."""
    trace = tmp_path / "gpt.json"
    launch(REPO / "examples/gpt/train.py", ["--deepspeed_config", str(REPO / "configs/gpt_zero2.json"),
           "--trace", str(trace), "--steps", "3", "--layers", "1", "--hidden", "32", "--heads", "2",
           "--seq-len", "32", "--eval-batches", "1", "--no-progress", "--loader", "torch", "--model", "torch"], 2).check()  # fmt: skip
    assert not trace.exists()
    for r in (0, 1):
        tl = load_timeline(tmp_path / f"gpt.rank{r}.json")
        assert tl.rank == r and [s for s, *_ in tl.steps] == [0, 1, 2]


def test_dsx_trace_points_at_the_rank_files_of_a_multi_rank_run(offload_run, tmp_path, capsys) -> None:
    for r in (0, 1):
        (tmp_path / f"trace.rank{r}.json").write_text(offload_run["trace"].read_text())
    assert dsx_main(["trace", str(tmp_path / "trace.json"), "-o", str(tmp_path / "t.png")]) == 2
    assert "a multi-rank run wrote trace.rank0.json, trace.rank1.json" in capsys.readouterr().err
    assert dsx_main(["trace", str(tmp_path / "trace.rank1.json"), "-o", str(tmp_path / "t.png")]) == 0
