"""bench_hetero_scale.py on CPU ranks (gloo): the example under the deepspeed launcher on 1 and 2 ranks gives a
JSON with every job's summary, each rank count's median and the epoch-rate ratio, and a PNG; a job that fails
is recorded with its log, not lost; models merge into their section, and a run of one section keeps the
file's others (the real runs are on the GPU machines)."""

from __future__ import annotations

import json
import re

import pytest

from tests.harness import load_example

TINY = ["--scale", "0.002", "--classes", "8", "--features", "16", "--graph-layout", "csr", "--epochs", "1",
        "--max-batches", "2", "--split", "0.5,0.1,0.0"]  # fmt: skip


def test_jobs_on_one_and_two_ranks_and_a_failing_one_merged_by_model(tmp_path, monkeypatch) -> None:
    mod = load_example("benchmarks/bench_hetero_scale.py")
    res = mod.main(["--out", str(tmp_path), "--gpus", "1,2", "--repeats", "1", "--", *TINY])
    saved = section(tmp_path)
    assert (tmp_path / "bench_hetero_scale.png").stat().st_size > 0 and saved["models"].keys() == {"rgcn"}
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
    bad = mod.main(["--out", str(tmp_path), "--gpus", "1", "--repeats", "1", "--merge",
                    "--", *bad_args])  # fmt: skip
    merged = section(tmp_path)
    assert list(merged["models"]) == ["rgcn", "rgat"] and merged["models"]["rgcn"] == rgcn
    rgat = merged["models"]["rgat"]
    assert rgat == bad["models"]["rgat"] and rgat["config"]["example_args"] == bad_args
    assert merged["config"]["example_args"] == bad_args and merged["config"]["merge"] is True
    job = rgat["runs"]["1"]["jobs"][0]
    assert rgat["runs"].keys() == {"1"} and rgat["runs"]["1"]["failed"] == 1
    assert rgat["runs"]["1"]["epoch_s"] is None
    assert "exit status" in job["error"] and "split" in job["log_tail"] and "graph" not in rgat
    assert (tmp_path / "bench_hetero_scale.png").stat().st_size > 0
    # a rerun of a model replaces its section alone, in its place; the job faked (a real one was run above),
    # as rgcn's 1-rank summary with another epoch time
    summary = {**rgcn["runs"]["1"]["jobs"][0], "model": "rgat", "epoch_s": 0.25}
    monkeypatch.setattr(mod, "_launch", lambda n, extra, timeout, cuda: {**summary, "world_size": n})
    mod.main(["--out", str(tmp_path), "--gpus", "1,2", "--repeats", "2", "--merge",
              "--", *TINY, "--model", "rgat"])  # fmt: skip
    again = section(tmp_path)
    assert list(again["models"]) == ["rgcn", "rgat"] and again["models"]["rgcn"] == rgcn
    rgat = again["models"]["rgat"]
    assert rgat["runs"].keys() == {"1", "2"} and rgat["config"]["repeats"] == 2
    assert [r["epoch_s"] for r in rgat["runs"].values()] == [0.25, 0.25] and rgat["graph"]["model"] == "rgat"
    assert rgat["epoch_rate_over_1_rank"] == {"2": 1.0}
    # another section leaves this one as it was, and the PNG draws both (the job faked as well)
    mod.main(["--out", str(tmp_path), "--section", "large", "--gpus", "1", "--repeats", "1", "--",
              *TINY, "--model", "hgt"])  # fmt: skip
    assert section(tmp_path) == again and section(tmp_path, "large")["models"].keys() == {"hgt"}
    drawn = []
    monkeypatch.setattr(mod, "draw", lambda panel, name, res: drawn.append(name))
    # without --merge the section holds this run's model alone, the other section kept
    mod.main(["--out", str(tmp_path), "--gpus", "1", "--repeats", "1", "--", *TINY, "--model", "hgt"])
    assert section(tmp_path)["models"].keys() == {"hgt"} and section(tmp_path, "large")["models"].keys() == {
        "hgt"
    }
    assert drawn == ["scale", "large"]


def section(out, name: str = "scale") -> dict:
    """The section ``name`` of bench_hetero_scale.json in ``out``."""
    return json.loads((out / "bench_hetero_scale.json").read_text())["sections"][name]


def test_merge_into_a_file_it_cannot_read_stops_before_any_job(tmp_path, monkeypatch) -> None:
    mod = load_example("benchmarks/bench_hetero_scale.py")

    def launch(*_: object) -> None:
        raise AssertionError("a job ran")

    monkeypatch.setattr(mod, "_launch", launch)
    path = tmp_path / "bench_hetero_scale.json"
    texts = ('{"sections": {"scale": ', "[1, 2]", '{"models": {}}', '{"sections": {"scale": 3}}', "\xff")
    for text in texts:
        path.write_text(text, encoding="latin-1")
        for merge in ([], ["--merge"]):  # (a run that would replace the section keeps the others)
            with pytest.raises(SystemExit, match=re.escape(str(path))):
                mod.main(["--out", str(tmp_path), "--gpus", "1", "--repeats", "1", *merge])
            assert path.read_text(encoding="latin-1") == text  # left as it was
    path.write_text('{"sections": {"scale": {"models": {"rgcn": 3}}}}')
    with pytest.raises(SystemExit, match=re.escape(str(path))):
        mod.main(["--out", str(tmp_path), "--gpus", "1", "--repeats", "1", "--merge"])
    with pytest.raises(
        SystemExit
    ):  # a name that cannot be a section's (argparse: "invalid section_name value")
        mod.main(["--out", str(tmp_path), "--section", "large.v2", "--gpus", "1", "--repeats", "1"])


def test_a_job_past_its_timeout_is_stopped_with_its_ranks(tmp_path) -> None:
    import subprocess

    from dsx.ops.prebuild import build_for_config

    mod = load_example("benchmarks/bench_hetero_scale.py")
    # the ranks' CPU all-reduce op is built first: on a fresh checkout its first build would use up the timeout
    build_for_config({}, verbose=False)
    # (30 s: two ranks starting on a loaded two-core machine took more than 20 to print their first epoch)
    res = mod.main(["--out", str(tmp_path), "--gpus", "2", "--repeats", "1", "--timeout", "30",
                    "--", *TINY, "--epochs", "1000"])  # fmt: skip
    run = res["models"]["rgcn"]["runs"]["2"]
    job = run["jobs"][0]
    assert job["error"] == "timed out after 30 s" and run["failed"] == 1
    assert re.search(r"epoch \d+: loss", job["log_tail"])  # the ranks were training when the timeout came
    left = subprocess.run(["pgrep", "-g", str(job["pgid"])], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"processes of the job left running: {left.stdout}"
