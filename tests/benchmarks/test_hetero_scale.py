"""bench_hetero_scale.py on CPU ranks (gloo): the example under the deepspeed launcher on 1 and 2 ranks gives a
JSON with every job's summary, each rank count's median and the epoch-rate ratio, and a PNG; a job that fails
is recorded with its log, not lost (the real runs are on the GPU machines)."""

from __future__ import annotations

import json
import re

from tests.harness import load_example

TINY = ["--scale", "0.002", "--classes", "8", "--features", "16", "--graph-layout", "csr", "--epochs", "1",
        "--max-batches", "2", "--split", "0.5,0.1,0.0"]  # fmt: skip


def test_jobs_on_one_and_two_ranks_and_a_failing_one(tmp_path) -> None:
    mod = load_example("benchmarks/bench_hetero_scale.py")
    res = mod.main(
        ["--out", str(tmp_path), "--name", "scale", "--gpus", "1,2", "--repeats", "1", "--", *TINY]
    )
    saved = json.loads((tmp_path / "scale.json").read_text())
    assert (tmp_path / "scale.png").stat().st_size > 0 and saved["runs"].keys() == {"1", "2"}
    for n in ("1", "2"):
        run = saved["runs"][n]
        assert run["failed"] == 0 and run["epoch_s"] > 0 and run["jobs"][0]["world_size"] == int(n)
        assert run["jobs"][0]["graph_layout"] == "csr" and 0 <= run["val_acc"][0] <= 1
    assert res["epoch_rate_over_1_rank"]["2"] == saved["runs"]["1"]["epoch_s"] / saved["runs"]["2"]["epoch_s"]
    assert saved["graph"]["edges"]["paper__cites__paper"] == int(5_416_271 * 0.002)
    assert saved["config"]["example_args"] == TINY
    bad = mod.main(["--out", str(tmp_path), "--name", "bad", "--gpus", "1", "--repeats", "1", "--",
                    *TINY, "--split", "0.9,0.9,0"])  # fmt: skip
    job = bad["runs"]["1"]["jobs"][0]
    assert bad["runs"]["1"]["failed"] == 1 and bad["runs"]["1"]["epoch_s"] is None
    assert "exit status" in job["error"] and "split" in job["log_tail"]
    assert (tmp_path / "bad.png").stat().st_size > 0


def test_a_job_past_its_timeout_is_stopped_with_its_ranks(tmp_path) -> None:
    import subprocess

    mod = load_example("benchmarks/bench_hetero_scale.py")
    res = mod.main(["--out", str(tmp_path), "--name", "slow", "--gpus", "2", "--repeats", "1", "--timeout", "20",
                    "--", *TINY, "--epochs", "1000"])  # fmt: skip
    job = res["runs"]["2"]["jobs"][0]
    assert job["error"] == "timed out after 20 s" and res["runs"]["2"]["failed"] == 1
    assert re.search(r"epoch \d+: loss", job["log_tail"])  # the ranks were training when the timeout came
    left = subprocess.run(["pgrep", "-g", str(job["pgid"])], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"processes of the job left running: {left.stdout}"
