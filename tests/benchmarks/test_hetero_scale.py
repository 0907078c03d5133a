"""bench_hetero_scale.py on CPU ranks (gloo): the example under the deepspeed launcher on 1 and 2 ranks gives a
JSON with every job's summary, each rank count's median and the epoch-rate ratio, and a PNG; a job that fails
is recorded with its log, not lost; models merge into one file by section, and a file of the one-model layout
is upgraded (the real runs are on the GPU machines)."""

from __future__ import annotations

import copy
import json
import re

import pytest

from tests.harness import load_example

TINY = ["--scale", "0.002", "--classes", "8", "--features", "16", "--graph-layout", "csr", "--epochs", "1",
        "--max-batches", "2", "--split", "0.5,0.1,0.0"]  # fmt: skip


def test_jobs_on_one_and_two_ranks_and_a_failing_one_merged_by_model(tmp_path, monkeypatch) -> None:
    mod = load_example("benchmarks/bench_hetero_scale.py")
    res = mod.main(
        ["--out", str(tmp_path), "--name", "scale", "--gpus", "1,2", "--repeats", "1", "--", *TINY]
    )
    saved = json.loads((tmp_path / "scale.json").read_text())
    assert (tmp_path / "scale.png").stat().st_size > 0 and saved["models"].keys() == {"rgcn"}
    rgcn = saved["models"]["rgcn"]  # no --model: the example's default
    assert rgcn["runs"].keys() == {"1", "2"}
    for n in ("1", "2"):
        run = rgcn["runs"][n]
        assert run["failed"] == 0 and run["epoch_s"] > 0 and run["jobs"][0]["world_size"] == int(n)
        assert run["jobs"][0]["graph_layout"] == "csr" and 0 <= run["val_acc"][0] <= 1
    rate = res["models"]["rgcn"]["epoch_rate_over_1_rank"]["2"]
    assert rate == rgcn["runs"]["1"]["epoch_s"] / rgcn["runs"]["2"]["epoch_s"]
    assert rgcn["graph"]["edges"]["paper__cites__paper"] == int(5_416_271 * 0.002)
    assert rgcn["graph"]["model"] == "rgcn" and rgcn["env"] == saved["env"]
    assert saved["config"]["example_args"] == rgcn["config"]["example_args"] == TINY
    # a failing job (a fast one), as another model merged into the same file: both sections kept
    bad_args = [*TINY, "--model", "rgat", "--split", "0.9,0.9,0"]
    bad = mod.main(["--out", str(tmp_path), "--name", "scale", "--gpus", "1", "--repeats", "1", "--merge",
                    "--", *bad_args])  # fmt: skip
    merged = json.loads((tmp_path / "scale.json").read_text())
    assert list(merged["models"]) == ["rgcn", "rgat"] and merged["models"]["rgcn"] == rgcn
    rgat = merged["models"]["rgat"]
    assert rgat == bad["models"]["rgat"] and rgat["config"]["example_args"] == bad_args
    assert merged["config"]["example_args"] == bad_args and merged["config"]["merge"] is True
    job = rgat["runs"]["1"]["jobs"][0]
    assert rgat["runs"].keys() == {"1"} and rgat["runs"]["1"]["failed"] == 1
    assert rgat["runs"]["1"]["epoch_s"] is None
    assert "exit status" in job["error"] and "split" in job["log_tail"] and "graph" not in rgat
    assert (tmp_path / "scale.png").stat().st_size > 0
    # a rerun of a model replaces its section alone, in its place; the job faked (a real one was run above),
    # as rgcn's 1-rank summary with another epoch time
    summary = {**rgcn["runs"]["1"]["jobs"][0], "model": "rgat", "epoch_s": 0.25}
    monkeypatch.setattr(mod, "_launch", lambda n, extra, timeout, cuda: {**summary, "world_size": n})
    mod.main(["--out", str(tmp_path), "--name", "scale", "--gpus", "1,2", "--repeats", "2", "--merge",
              "--", *TINY, "--model", "rgat"])  # fmt: skip
    again = json.loads((tmp_path / "scale.json").read_text())
    assert list(again["models"]) == ["rgcn", "rgat"] and again["models"]["rgcn"] == rgcn
    rgat = again["models"]["rgat"]
    assert rgat["runs"].keys() == {"1", "2"} and rgat["config"]["repeats"] == 2
    assert [r["epoch_s"] for r in rgat["runs"].values()] == [0.25, 0.25] and rgat["graph"]["model"] == "rgat"
    assert rgat["epoch_rate_over_1_rank"] == {"2": 1.0}
    # without --merge the file holds this run's model alone (the job faked as well)
    mod.main(["--out", str(tmp_path), "--name", "scale", "--gpus", "1", "--repeats", "1", "--",
              *TINY, "--model", "hgt"])  # fmt: skip
    assert json.loads((tmp_path / "scale.json").read_text())["models"].keys() == {"hgt"}


OLD = {  # a result of the one-model layout (runs at the top), as bench_hetero_scale.py wrote it before
    "config": {
        "out": "o",
        "quick": False,
        "name": "old",
        "gpus": "1,2",
        "repeats": 2,
        "timeout": 60.0,
        "example_args": ["--model", "hgt", "--scale", "3"],
    },
    "env": {"date_utc": "2030-01-02T03:04:05+00:00", "host": "h", "device": "GPU X", "cpu_count": 7},
    "runs": {
        "1": {
            "jobs": [{"epoch_s": 6.5}, {"epoch_s": 7.5}],
            "failed": 0,
            "epoch_s": 7.0,
            "epoch_s_min": 6.5,
            "epoch_s_max": 7.5,
            "val_acc": [0.61, 0.62],
            "peak_gpu_gb": 3.25,
        },
        "2": {
            "jobs": [{"epoch_s": 4.0}, {"epoch_s": 3.0}],
            "failed": 0,
            "epoch_s": 3.5,
            "epoch_s_min": 3.0,
            "epoch_s_max": 4.0,
            "val_acc": [0.63, 0.64],
            "peak_gpu_gb": 2.75,
        },
    },
    "epoch_rate_over_1_rank": {"2": 2.0},
    "graph": {
        "nodes": {"paper": 11},
        "edges": {"paper__cites__paper": 13},
        "feature_gb": {"paper": 0.5},
        "gpu_total_gb": 17.0,
        "generated_graph_gpu_gb": 1.5,
        "model": "hgt",
    },
    "features_over_gpu_memory": 0.5 / 17.0,
}


def test_upgrade_of_the_one_model_layout(tmp_path, monkeypatch) -> None:
    mod = load_example("benchmarks/bench_hetero_scale.py")
    old = copy.deepcopy(OLD)
    new = mod.upgrade(old)
    assert old == OLD  # the input is left as it was
    assert new == {"config": OLD["config"], "env": OLD["env"], "models": {"hgt": OLD}}
    assert mod.upgrade(copy.deepcopy(new)) == new  # the layout by model is kept as it is
    # every job failed (no graph): the model comes from the example's arguments, else the example's default
    failed = {k: v for k, v in OLD.items() if k not in ("graph", "features_over_gpu_memory")}
    assert mod.upgrade(failed)["models"].keys() == {"hgt"}
    failed["config"] = {**OLD["config"], "example_args": ["--scale", "3"]}
    assert mod.upgrade(failed)["models"].keys() == {"rgcn"}
    # --merge onto a file of that layout: its model's section kept beside this run's (the job faked)
    (tmp_path / "old.json").write_text(json.dumps(OLD))
    monkeypatch.setattr(
        mod, "_launch", lambda n, extra, timeout, cuda: {"error": "exit status 1", "log_tail": "x"}
    )
    mod.main(["--out", str(tmp_path), "--name", "old", "--gpus", "1", "--repeats", "1", "--merge", "--",
              "--model", "rgat"])  # fmt: skip
    saved = json.loads((tmp_path / "old.json").read_text())
    assert list(saved["models"]) == ["hgt", "rgat"] and saved["models"]["hgt"] == OLD
    assert saved["models"]["rgat"]["runs"]["1"]["failed"] == 1 and (tmp_path / "old.png").stat().st_size > 0


def test_merge_into_a_file_it_cannot_read_stops_before_any_job(tmp_path, monkeypatch) -> None:
    mod = load_example("benchmarks/bench_hetero_scale.py")

    def launch(*_: object) -> None:
        raise AssertionError("a job ran")

    monkeypatch.setattr(mod, "_launch", launch)
    path = tmp_path / "c.json"
    for text in ('{"models": {"rgcn": ', "[1, 2]", '{"figures": {}}', '{"models": {"rgcn": 3}}', "\xff"):
        path.write_text(text, encoding="latin-1")
        with pytest.raises(SystemExit, match=re.escape(str(path))):
            mod.main(["--out", str(tmp_path), "--name", "c", "--gpus", "1", "--repeats", "1", "--merge"])
        assert path.read_text(encoding="latin-1") == text  # left as it was


def test_a_job_past_its_timeout_is_stopped_with_its_ranks(tmp_path) -> None:
    import subprocess

    mod = load_example("benchmarks/bench_hetero_scale.py")
    # (30 s: two ranks starting on a loaded two-core machine took more than 20 to print their first epoch)
    res = mod.main(["--out", str(tmp_path), "--name", "slow", "--gpus", "2", "--repeats", "1", "--timeout", "30",
                    "--", *TINY, "--epochs", "1000"])  # fmt: skip
    run = res["models"]["rgcn"]["runs"]["2"]
    job = run["jobs"][0]
    assert job["error"] == "timed out after 30 s" and run["failed"] == 1
    assert re.search(r"epoch \d+: loss", job["log_tail"])  # the ranks were training when the timeout came
    left = subprocess.run(["pgrep", "-g", str(job["pgid"])], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"processes of the job left running: {left.stdout}"
