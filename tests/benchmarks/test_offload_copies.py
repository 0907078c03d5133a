"""benchmarks/bench_offload.py's ``none_copies``: the hide-only plan's bytes moved without dsx, each way, on
every training step and only then; its byte count comes from the same invocation's hide-only run."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import matplotlib
import pytest
import torch

from benchmarks import bench_offload
from benchmarks._common import write_section

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _section(out: Path, name: str) -> dict:
    """The section ``name`` of the bench_offload.json in ``out``."""
    return json.loads((out / "bench_offload.json").read_text())["sections"][name]


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def test_background_copies_go_out_in_forward_and_back_in_backward() -> None:
    model = _model()
    copies = bench_offload._BackgroundCopies(model, torch.device("cpu"), nbytes=3 << 20, chunks=2)
    assert copies.per_step_gb == 2 * (2 << 20) / 1e9  # per chunk: 1.5 MiB rounded up to 2 MiB
    assert copies.src.float().std() > 0  # random bytes, not zeros
    x = torch.randn(8, 16)
    for h in copies.host:
        h.zero_()
    copies.dst.zero_()
    out = model(x)
    assert all(torch.equal(h, copies.src) for h in copies.host)  # out as the forward started
    assert not copies.dst.any()  # nothing back before the backward
    out.square().mean().backward()
    assert torch.equal(copies.dst, copies.src)  # back as it started

    for h in copies.host:
        h.zero_()
    with torch.no_grad():  # an evaluation forward has no backward: it moves nothing
        model(x)
    assert not any(h.any() for h in copies.host)
    copies.remove()
    model(x).sum().backward()
    assert not any(h.any() for h in copies.host)  # removed: the model trains without them


def test_zero_bytes_copy_nothing() -> None:
    model = _model()
    copies = bench_offload._BackgroundCopies(model, torch.device("cpu"), nbytes=0)
    assert copies.per_step_gb == 0 and copies.src.numel() == 0
    model(torch.randn(2, 16)).sum().backward()
    copies.remove()


def test_bytes_come_from_the_hide_only_run_at_the_same_micro_batch() -> None:
    def hide(mb: int, written: list[float]) -> dict:
        return {"config": "dsx_auto_hide", "micro_batch": mb,
                "telemetry": {"written_gb_per_measured_step": written}}  # fmt: skip

    results = [
        {"config": "none", "micro_batch": 8},
        {"config": "dsx_auto_hide", "micro_batch": 8, "error": "OOM"},
        hide(4, [1.0, 1.0, 1.0]),
        hide(8, [4.7, 5.1, 4.9, 9.0]),
    ]
    assert bench_offload._hide_written_gb(results, 8) == 5.0  # the median of the measured steps
    assert bench_offload._hide_written_gb(results, 4) == 1.0
    assert bench_offload._hide_written_gb(results, 16) is None
    assert bench_offload._hide_written_gb(results[:2], 8) is None


def test_ssd_runs_report_the_tier_rates_beside_the_drive_rates(tmp_path) -> None:
    """An SSD-only config's run carries the drive's own rates, measured beside it in the same directory,
    and the JSON sets the tier's rates while it had work (real files) against them, both ways."""
    import statistics

    # (posix: the auto backend would build DeepSpeed's async_io op where libaio-dev is installed, minutes on CI)
    bench_offload.main(["--quick", "--in-process", "--configs", "dsx_ssd", "--repeats", "2", "--ssd-dir",
                        str(tmp_path), "--out", str(tmp_path), "--section", "ssd", "--io-backend", "posix"])  # fmt: skip
    saved = _section(tmp_path, "ssd")
    runs = [r for r in saved["results"] if r["config"] == "dsx_ssd"]
    assert len(runs) == 2 and all("error" not in r for r in runs), runs
    assert [r["ssd_io_backend"] for r in runs] == ["posix", "posix"]  # the file the tier opened
    entry = saved["ratios"]["ssd_tier_vs_drive"]["dsx_ssd"]
    assert entry["runs"] == 2
    for way, tier in (("write", "ssd"), ("read", "ssd_read")):
        assert [r["drive_GBps"][way] for r in runs] == entry[f"drive_{way}_GBps"]
        assert all(g > 0 for g in entry[f"drive_{way}_GBps"])
        rates = [r["telemetry"]["GBps_by_tier"][tier] for r in runs]
        assert rates == entry[f"tier_{way}_GBps"] and all(g > 0 for g in rates)
        want = statistics.median(rates) / statistics.median(entry[f"drive_{way}_GBps"])
        assert entry[f"{way}_fraction"] == pytest.approx(want)


def test_every_run_that_wrote_to_the_drive_measures_it(tmp_path, monkeypatch) -> None:
    """Not only the SSD-only configs: a run whose measured steps wrote to the SSD tier gets the drive's rates
    measured beside it (a real file) and its tier rates set against them; a run that wrote nothing there is not
    probed. (On the CPU a budget plan moves nothing, so the runs are real and their telemetry says the drive was
    written, as a GPU run's whose plan puts layers on the SSD does.)"""
    real = bench_offload._guarded

    def wrote_to_the_drive(name, args, ssd, budget):
        res = real(name, args, ssd, budget)
        if name == "dsx_auto_budget":
            tel = res["telemetry"]
            tel["bytes_by_tier"].update(ssd=4e9, ssd_read=4e9)
            tel["GBps_by_tier"].update(ssd=2.0, ssd_read=1.5)
        return res

    monkeypatch.setattr(bench_offload, "_guarded", wrote_to_the_drive)
    out = bench_offload.main(["--quick", "--in-process", "--configs", "dsx_auto_budget", "dsx_auto_budget_host",
                              "--ssd-gb", "0.5", "--auto-budget-gb", "0.0001", "--io-backend", "posix",
                              "--ssd-dir", str(tmp_path), "--out", str(tmp_path)])  # fmt: skip
    rows = {r["config"]: r for r in out["results"]}
    assert (
        rows["dsx_auto_budget"]["drive_GBps"]["write"] > 0
        and "drive_GBps" not in rows["dsx_auto_budget_host"]
    )
    entry = out["ratios"]["ssd_tier_vs_drive"]
    assert set(entry) == {"dsx_auto_budget"} and entry["dsx_auto_budget"]["tier_read_GBps"] == [1.5]
    assert entry["dsx_auto_budget"]["read_fraction"] == pytest.approx(
        1.5 / rows["dsx_auto_budget"]["drive_GBps"]["read"]
    )


def test_a_drive_that_cannot_be_measured_is_recorded_and_left_out(tmp_path) -> None:
    missing = bench_offload._drive_rates(str(tmp_path / "gone"), 4)
    assert "not a writable directory" in missing["error"] and "write" not in missing
    ok = {"write": 2.0, "read": 1.0}
    rows = [
        {"config": "dsx_ssd", "drive_GBps": ok, "telemetry": {"GBps_by_tier": {"ssd": 3.0, "ssd_read": 1.5}}},
        {
            "config": "dsx_ssd",
            "drive_GBps": missing,
            "telemetry": {"GBps_by_tier": {"ssd": 9.0, "ssd_read": 9.0}},
        },
        {"config": "dsx_ssd", "drive_GBps": ok, "telemetry": {"GBps_by_tier": {"ssd": 1.0}}},  # no read back
    ]
    entry = bench_offload._tier_vs_drive(rows)["dsx_ssd"]
    assert entry["runs"] == 2
    assert entry["tier_write_GBps"] == [3.0, 1.0] and entry["write_fraction"] == 2.0 / 2.0
    assert (
        entry["tier_read_GBps"] == [1.5]
        and entry["drive_read_GBps"] == [1.0]
        and entry["read_fraction"] == 1.5
    )


def test_the_longest_sequence_and_the_speed_at_the_best_peers() -> None:
    """Capacity over sequence lengths: per config the longest that trained (an error row, out of memory,
    does not count), and each dsx config's tokens/s at the longest the best peer trained, against the peer's, and
    at every length both trained."""
    rows = [
        {"config": "none@seq8", "seq_len": 8, "tokens_per_s": 100.0},
        {"config": "none@seq16", "seq_len": 16, "error": "CUDA out of memory"},
        {"config": "recompute@seq16", "seq_len": 16, "tokens_per_s": 80.0},
        {"config": "recompute@seq32", "seq_len": 32, "tokens_per_s": 70.0},
        {"config": "ds_cpu_ckpt@seq32", "seq_len": 32, "tokens_per_s": 60.0},
        {"config": "dsx_auto_budget@seq32", "seq_len": 32, "tokens_per_s": 91.0},
        {"config": "dsx_auto_budget@seq64", "seq_len": 64, "tokens_per_s": 84.0},
        {"config": "dsx_auto_budget@seq16", "seq_len": 16, "tokens_per_s": 120.0},
        {"config": "dsx_auto_budget@seq128", "seq_len": 128, "error": "timed out after 300 s"},
        {"config": "recompute@mb2", "micro_batch": 2, "tokens_per_s": 1e9},  # another sweep's row
    ]
    out = bench_offload._largest(rows, "seq_len", "seq")
    # (no offload's longest is a limit: a longer one did not fit; the others' are only the longest they were
    # given, or, out of time at a longer one, the longest known)
    assert out["largest"] == {"none": {"seq_len": 8, "tokens_per_s": 100.0, "limit_found": True},
                              "recompute": {"seq_len": 32, "tokens_per_s": 70.0, "limit_found": False},
                              "ds_cpu_ckpt": {"seq_len": 32, "tokens_per_s": 60.0, "limit_found": False},
                              "dsx_auto_budget": {"seq_len": 64, "tokens_per_s": 84.0, "limit_found": False,
                                                  "failed_otherwise_at": 128}}  # fmt: skip
    plan_error = {"config": "dsx_auto_budget@seq128", "seq_len": 128,
                  "error": "PlanError: memory_budget_gb=70.0 cannot be met: the most frugal plan found keeps 80 GiB"}  # fmt: skip
    # the host's out-of-memory killer
    killed = {**plan_error, "error": "child exited -9 without a result", "returncode": -9}
    for row in (plan_error, killed):
        assert bench_offload._largest([*rows[:-2], row], "seq_len", "seq")["largest"]["dsx_auto_budget"] == {
            "seq_len": 64, "tokens_per_s": 84.0, "limit_found": True}  # fmt: skip
    # recompute and cpu_checkpointing both reach 32: the faster of the two is the peer
    at = out["at_best_peer"]
    assert at["peer"] == "recompute" and at["seq_len"] == 32 and at["peer_tokens_per_s"] == 70.0
    assert at["dsx_auto_budget_vs_peer_tokens_per_s"] == 91.0 / 70.0
    # and at every length both trained (64: the peer did not train it)
    assert at["dsx_auto_budget_vs_peer_tokens_per_s_by_seq_len"] == {"16": 120.0 / 80.0, "32": 91.0 / 70.0}
    assert out["dsx_auto_budget_vs_none_tokens_per_s"] == 84.0 / 100.0


def test_a_sequence_sweep_runs_every_length_and_names_its_rows(tmp_path) -> None:
    """Real engines on the CPU: rows per length, named config@seqN, with the length they ran at; a dsx
    budget config without a measured recompute peak at that length says so."""

    bench_offload.main(["--quick", "--in-process", "--configs", "none", "recompute", "dsx_auto_budget",
                        "--seq-lens", "16,32", "recompute=32", "--out", str(tmp_path), "--section", "cap"])  # fmt: skip
    saved = _section(tmp_path, "cap")
    rows = {r["config"]: r for r in saved["results"]}
    assert set(rows) == {"none@seq16", "none@seq32", "recompute@seq32", "dsx_auto_budget@seq16",
                         "dsx_auto_budget@seq32"}, sorted(rows)  # fmt: skip
    for name in ("none@seq16", "none@seq32", "recompute@seq32"):
        r = rows[name]
        assert "error" not in r and r["seq_len"] == int(name.rsplit("seq", 1)[1]), r
        assert r["tokens_per_s"] == r["micro_batch"] * r["seq_len"] / r["step_s"]
    assert "sequence 16" in rows["dsx_auto_budget@seq16"]["error"]  # recompute ran at 32 only
    assert saved["ratios"]["longest_sequence"]["largest"]["none"]["seq_len"] == 32
    assert (tmp_path / "bench_offload.png").stat().st_size > 0


def test_a_length_sweep_draws_throughput_against_length_with_each_first_failure(monkeypatch) -> None:
    rows = [{"config": f"recompute@seq{n}", "seq_len": n, "tokens_per_s": 9e3 - n / 100, "step_s": 1.0,
             "activation_peak_gb": 1.0, "step_s_runs": [1.0]} for n in (1000, 2000)]  # fmt: skip
    rows += [{"config": "none@seq1000", "seq_len": 1000, "tokens_per_s": 1e4, "step_s": 1.0,
              "activation_peak_gb": 2.0, "step_s_runs": [1.0]},
             {"config": "none@seq2000", "seq_len": 2000, "error": "OutOfMemoryError: CUDA out of memory"},
             {"config": "recompute@seq3000", "seq_len": 3000, "error": "timed out after 300 s"}]  # fmt: skip
    drawn = []
    real = bench_offload._draw_lengths
    monkeypatch.setattr(bench_offload, "_draw_lengths", lambda *a: drawn.append(a[3]) or real(*a))
    fig = plt.figure()
    bench_offload._draw(fig, "lengths", {"results": rows, "config": {"seq_lens": ["1000,2000,3000"]}})
    assert len(fig.axes) == 1 and drawn == ["lengths: GPT, lengths swept"]  # (what the config records)
    # one length only: the strategies' chart
    fig = plt.figure()
    bench_offload._draw(fig, "one", {"results": rows[:1]})
    assert len(fig.axes) == 2 and len(drawn) == 1
    # nothing trained: the panel says so
    fig = plt.figure()
    bench_offload._draw(fig, "none", {"results": rows[-1:]})
    assert not fig.axes and fig.get_suptitle().endswith("no config trained")
    plt.close("all")


def test_a_length_sweep_marks_each_config_once_where_it_first_failed() -> None:
    """A longer length that failed in another part is not a second limit; two configs failing at one length get
    labels side by side, not on top of each other."""
    ok = {"tokens_per_s": 1e4, "step_s": 1.0, "activation_peak_gb": 1.0, "step_s_runs": [1.0]}
    oom = {"error": "OutOfMemoryError: CUDA out of memory"}
    rows = [{"config": f"{c}@seq1000", "seq_len": 1000, **ok} for c in ("recompute", "none", "dsx")]
    rows += [{"config": f"{c}@seq{n}", "seq_len": n, **oom} for c, n in
             (("recompute", 4000), ("recompute", 3000), ("none", 2000), ("dsx", 2000))]  # fmt: skip
    fig = plt.figure()
    bench_offload._draw(fig, "lengths", {"results": rows})
    texts = fig.axes[0].texts
    assert Counter(t.get_text() for t in texts) == Counter(
        {"recompute: out of memory": 1, "none: out of memory": 1, "dsx: out of memory": 1}
    )
    marks = {t.get_text(): (t.xy[0], t.xyann[0]) for t in texts}
    assert marks["recompute: out of memory"][0] == 3000
    assert marks["none: out of memory"][0] == marks["dsx: out of memory"][0] == 2000
    assert marks["none: out of memory"][1] != marks["dsx: out of memory"][1]
    plt.close(fig)


def test_a_capped_host_pool_runs_with_the_ssd_tier_and_without(tmp_path) -> None:
    """--ssd-gb sizes the SSD tier apart from the host pool; dsx_auto_budget_host plans over the host tier
    alone, so that the two rows side by side say what the SSD adds beside a capped pool. Real engines and a
    real SSD file on the CPU."""
    out = bench_offload.main(["--quick", "--in-process", "--configs", "dsx_auto_budget", "dsx_auto_budget_host",
                              "--ssd-gb", "0.5", "--auto-budget-gb", "0.0001", "--io-backend", "posix",
                              "--out", str(tmp_path)])  # fmt: skip
    rows = {r["config"]: r for r in out["results"]}
    assert set(rows) == {"dsx_auto_budget", "dsx_auto_budget_host"} and not any(
        "error" in r for r in rows.values()
    )
    both = rows["dsx_auto_budget"]["plan"]["bound"]["tier_capacity_bytes"]
    host = rows["dsx_auto_budget_host"]["plan"]["bound"]["tier_capacity_bytes"]
    assert set(both) == {"host", "ssd"} and set(host) == {"host"}
    assert both["ssd"] > 1.5 * both["host"]  # --ssd-gb 0.5 beside --quick's 0.25 GB pool
    assert out["config"]["ssd_gb"] == 0.5


def test_dsx_profiled_with_its_inputs_on_the_host_trains_as_a_capacity_config(tmp_path, caplog) -> None:
    """dsx_auto_budget_hp: policy auto under a budget, profiled with the layers' inputs on the host
    (profile_mode "recompute+host"); asked for by name, fitted to the card like dsx_auto_budget. A real engine
    on the CPU."""
    section = bench_offload._section("dsx_auto_budget_hp_sel", str(tmp_path), 1.0, 1.0, 1.0, "Attention")
    assert section["profile_mode"] == "recompute+host" and section["recompute_modules"] == ["Attention"]
    assert section["tiers"] == ["host", "ssd"]
    host_only = bench_offload._section(
        "dsx_auto_budget_host_hp_sel", str(tmp_path), 1.0, 1.0, 1.0, "Attention"
    )
    assert host_only["profile_mode"] == "recompute+host" and host_only["tiers"] == ["host"]
    assert {"dsx_auto_budget_host_hp", "dsx_auto_budget_host_hp_sel"} <= set(bench_offload.NEEDS_BUDGET)
    assert (
        "dsx_auto_budget_hp" in bench_offload.NEEDS_BUDGET
        and "dsx_auto_budget_hp" not in bench_offload.CONFIGS
    )
    caplog.set_level(logging.WARNING, logger="dsx.offload")
    out = bench_offload.main(["--quick", "--in-process", "--configs", "dsx_auto_budget_hp", "--auto-budget-gb",
                              "0.0001", "--io-backend", "posix", "--out", str(tmp_path)])  # fmt: skip
    (row,) = out["results"]
    assert "error" not in row, row
    assert "profiled with every layer recomputed, its inputs on the host" in caplog.text


def test_merged_repeats_keep_the_earlier_rows_and_the_capacity_takes_their_median(tmp_path) -> None:
    """--merge-repeat: interleaved rounds too long for one job run one a part; each part's rows join the earlier
    ones of the same name instead of replacing them, and the longest-sequence figures take the median."""

    common = ["--quick", "--in-process", "--configs", "none", "--seq-lens", "16", "--out", str(tmp_path),
              "--section", "r"]  # fmt: skip
    bench_offload.main(common)
    for _ in range(2):
        bench_offload.main([*common, "--merge", "--merge-repeat"])
    saved = _section(tmp_path, "r")
    rows = [r for r in saved["results"] if r["config"] == "none@seq16"]
    assert [r["part"] for r in rows] == [0, 1, 2]
    assert not any(p.get("superseded") for p in saved["parts"])
    tps = sorted(r["tokens_per_s"] for r in rows)
    assert saved["ratios"]["longest_sequence"]["largest"]["none"]["tokens_per_s"] == tps[1]
    bench_offload.main([*common, "--merge"])  # without it, a part replaces them
    saved = _section(tmp_path, "r")
    assert [r["part"] for r in saved["results"] if r["config"] == "none@seq16"] == [3]


def test_a_merge_takes_no_ssd_size_as_the_pools(tmp_path) -> None:
    """A file written without --ssd-gb had an SSD tier the pool's size: a part that names that size merges, one
    with another size is refused."""

    common = ["--quick", "--in-process", "--configs", "none", "--out", str(tmp_path), "--section", "s"]
    bench_offload.main(common)
    bench_offload.main([*common, "--merge", "--ssd-gb", "0.25"])  # --quick's pool: the same setting
    assert len(_section(tmp_path, "s")["parts"]) == 2
    with pytest.raises(SystemExit, match=r"other settings \{'ssd_gb': \(0.25, 0.5\)\}"):
        bench_offload.main([*common, "--merge", "--ssd-gb", "0.5"])


def _out_of_memory_from(monkeypatch: pytest.MonkeyPatch, config: str, seq: int) -> None:
    """Make ``config`` run out of memory at sequence ``seq`` and longer, as on a GPU too small for it."""
    real = bench_offload.run_one

    def run_one(name, args, ssd, budget):
        if name == config and args.seq_len >= seq:
            raise torch.OutOfMemoryError(f"CUDA out of memory at sequence {args.seq_len}")
        return real(name, args, ssd, budget)

    monkeypatch.setattr(bench_offload, "run_one", run_one)


def test_a_size_past_one_that_failed_is_not_run_in_that_round(tmp_path, monkeypatch) -> None:
    """A capacity sweep stops a config at its first failure: its longer sequences, the slowest runs, are recorded
    as not run (in each round), while the other configs run every length; the longest it trained is then a
    limit found, and another config's longest only the longest it was given."""

    _out_of_memory_from(monkeypatch, "recompute", 16)
    bench_offload.main(["--quick", "--in-process", "--configs", "none", "recompute", "--seq-lens", "8,16,32",
                        "--repeats", "2", "--out", str(tmp_path), "--section", "stop"])  # fmt: skip
    saved = _section(tmp_path, "stop")
    by: dict[str, list] = {}
    for r in saved["results"]:
        by.setdefault(r["config"], []).append(r)
    assert {c: len(v) for c, v in by.items()} == dict.fromkeys(
        ["none@seq8", "none@seq16", "none@seq32", "recompute@seq8", "recompute@seq16", "recompute@seq32"], 2
    )
    assert all(
        "error" not in r for c in ("none@seq8", "none@seq16", "none@seq32", "recompute@seq8") for r in by[c]
    )
    assert all("out of memory at sequence 16" in r["error"] for r in by["recompute@seq16"])
    assert all(r["error"] == "not run: failed at sequence 16, micro-batch 2 in this round" and r["not_run"]
               for r in by["recompute@seq32"]), by["recompute@seq32"]  # fmt: skip
    largest = saved["ratios"]["longest_sequence"]["largest"]
    assert largest["recompute"]["seq_len"] == 8 and largest["recompute"]["limit_found"]
    assert largest["none"]["seq_len"] == 32 and not largest["none"]["limit_found"]


def test_a_merged_part_that_did_not_run_a_size_keeps_the_earlier_measurement(tmp_path, monkeypatch) -> None:
    """--merge with a failure: a size the new part ran and failed replaces the earlier rows (it is the newer
    measurement); a size it did not run leaves the earlier rows as they were."""

    common = ["--quick", "--in-process", "--configs", "recompute", "--seq-lens", "8,16", "--out", str(tmp_path),
              "--section", "part"]  # fmt: skip
    bench_offload.main(common)
    _out_of_memory_from(monkeypatch, "recompute", 8)
    bench_offload.main([*common, "--merge"])
    rows = _section(tmp_path, "part")["results"]
    at8 = [r for r in rows if r["config"] == "recompute@seq8"]
    at16 = [r for r in rows if r["config"] == "recompute@seq16"]
    assert len(at8) == 1 and "out of memory" in at8[0]["error"]
    assert [("error" in r, r["part"]) for r in at16] == [(False, 0), (True, 1)] and at16[1]["not_run"]


def test_capacity_settings_that_cannot_hold_are_refused_before_any_run(capsys) -> None:
    for argv, says in [
        (["--fit-budget", "--auto-budget-gb", "1", "--gpu-memory-gb", "85"], "give one"),
        (["--fit-budget"], "--fit-budget fills --gpu-memory-gb"),
        (["--fit-budget", "--gpu-memory-gb", "85", "--budget-scales", "1", "1.5"], "no --budget-scales"),
        (["--gpu-memory-gb", "0"], "--gpu-memory-gb must be > 0"),
        (["--fit-reserve-gb", "-1"], "--fit-reserve-gb must be >= 0"),
        (["--memory-history-from", "start"], "give --memory-history DIR too"),
        (["--merge-repeat"], "give --merge too"),
    ]:
        with pytest.raises(SystemExit):
            bench_offload.main(["--quick", *argv])
        assert says in capsys.readouterr().err, argv


def test_a_fit_budget_fills_the_capped_gpu_past_the_static_memory() -> None:
    """--fit-budget: the cap less the least a row measured of weights, gradients and optimizer state (at the same
    micro-batch; an error row measured nothing) less the reserve; or a reason, never a guess."""
    import argparse

    args = argparse.Namespace(gpu_memory_gb=85.0, fit_reserve_gb=2.0)
    static = {"weights": 3.5, "gradients_and_optimizer_state": 4.5}
    rows = [
        {"config": "none@seq8", "micro_batch": 1, "error": "CUDA out of memory", "peak_breakdown_gb": None},
        {"config": "recompute@seq8", "micro_batch": 2, "peak_breakdown_gb": {**static, "weights": 9.0}},
        {"config": "recompute@seq8", "micro_batch": 1, "peak_breakdown_gb": static},
    ]
    assert bench_offload._fit_budget_gb(rows, args, 1) == pytest.approx(85.0 - 8.0 - 2.0)
    assert "micro-batch 4" in bench_offload._fit_budget_gb(rows, args, 4)
    small = argparse.Namespace(gpu_memory_gb=9, fit_reserve_gb=2)
    assert "no room" in bench_offload._fit_budget_gb(rows, small, 1)
    assert "--gpu-memory-gb" in bench_offload._fit_budget_gb(rows, argparse.Namespace(gpu_memory_gb=None), 1)
    # a strategy that keeps more between steps (cpu_checkpointing's staging) does not shrink the budget
    rows.append(
        {"config": "ds_cpu_ckpt@seq8", "micro_batch": 1, "peak_breakdown_gb": {**static, "weights": 4.6}}
    )
    assert bench_offload._fit_budget_gb(rows[::-1], args, 1) == pytest.approx(85.0 - 8.0 - 2.0)


def test_a_run_merged_into_an_earlier_file_keeps_its_rows_and_replaces_same_named_ones(tmp_path) -> None:
    """--merge: a sweep in parts. The second part's rows join the first's; a row it runs again replaces the
    earlier one; the file records both parts; a part with other model or step settings is refused."""

    common = ["--quick", "--in-process", "--out", str(tmp_path), "--section", "m"]
    bench_offload.main([*common, "--configs", "none", "recompute"])
    first = _section(tmp_path, "m")
    bench_offload.main([*common, "--configs", "none", "--merge"])
    saved = _section(tmp_path, "m")
    assert sorted(r["config"] for r in saved["results"]) == ["none", "recompute"]
    by = {r["config"]: r for r in saved["results"]}
    assert by["recompute"] == next(r for r in first["results"] if r["config"] == "recompute")
    assert by["none"]["measured_window_unix"] != first["results"][0]["measured_window_unix"]
    assert [p["configs"] for p in saved["parts"]] == [["none", "recompute"], ["none"]]
    assert all(p["device"] == first["env"]["device"] for p in saved["parts"])  # which machine ran each part
    with pytest.raises(SystemExit, match=r"--merge: .* other settings \{'adam': \('foreach', 'fused'\)\}"):
        bench_offload.main([*common, "--configs", "none", "--merge", "--adam", "fused"])
    assert _section(tmp_path, "m") == saved  # the refused part changed nothing
    assert {r["config"]: r["part"] for r in saved["results"]} == {"none": 1, "recompute": 0}
    # a part none of whose rows is left is marked superseded
    bench_offload.main([*common, "--configs", "recompute", "--merge"])
    parts = _section(tmp_path, "m")["parts"]
    assert [bool(p.get("superseded")) for p in parts] == [True, False, False], parts
    # another shape is a section of its own: a run of it, merged or not, leaves this one as it was
    kept = _section(tmp_path, "m")
    bench_offload.main(
        ["--quick", "--in-process", "--out", str(tmp_path), "--section", "other", "--configs", "none"]
    )
    assert _section(tmp_path, "m") == kept and _section(tmp_path, "other")["results"][0]["config"] == "none"
    assert list(json.loads((tmp_path / "bench_offload.json").read_text())["sections"]) == ["m", "other"]


def test_capacity_takes_the_median_over_repeats_and_keeps_other_tags_apart() -> None:
    rows = [
        {"config": "recompute@mb2@seq32", "micro_batch": 2, "seq_len": 32, "tokens_per_s": t} for t in (60, 70, 90)
    ] + [
        {"config": "dsx_auto_budget@mb2@seq32", "micro_batch": 2, "seq_len": 32, "tokens_per_s": t}
        for t in (75, 80, 200)
    ] + [
        {"config": "none@mb2@seq16", "micro_batch": 2, "seq_len": 16, "tokens_per_s": 100.0},
        {"config": "none_copies@mb2@seq64", "micro_batch": 2, "seq_len": 64, "tokens_per_s": 1.0},
        {"config": "recompute@mb4@seq16", "micro_batch": 4, "seq_len": 16, "tokens_per_s": 50.0},
    ]  # fmt: skip
    out = bench_offload._largest(rows, "seq_len", "seq")
    assert out["largest"]["recompute@mb2"] == {
        "seq_len": 32,
        "tokens_per_s": 70,
        "limit_found": False,
    }  # median
    assert out["largest"]["recompute@mb4"] == {"seq_len": 16, "tokens_per_s": 50.0, "limit_found": False}
    at = out["at_best_peer"]  # none_copies (a diagnostic) trained longer but is no peer
    assert at["peer"] == "recompute@mb2" and at["dsx_auto_budget@mb2_vs_peer_tokens_per_s"] == 80 / 70
    assert out["dsx_auto_budget@mb2_vs_none_tokens_per_s"] == 80 / 100.0


def test_merging_into_a_file_from_before_sizes_were_kept_per_row(tmp_path) -> None:
    """Rows written before each row carried its sequence length ran at the file's own (and files from before
    --vocab at 256): a budget relative to their recompute peak is found, not reported missing."""

    common = ["--quick", "--in-process", "--out", str(tmp_path), "--section", "old"]
    bench_offload.main([*common, "--configs", "recompute"])
    saved = _section(tmp_path, "old")
    for r in saved["results"]:
        del r["seq_len"]
        r["activation_peak_gb"] = 0.5  # (a GPU run's measured peak; the CPU measures none)
    del saved["parts"], saved["config"]["vocab"]  # (files from before either was recorded)
    write_section(saved, tmp_path, "bench_offload", "old")
    bench_offload.main([*common, "--configs", "dsx_auto_budget", "--budget-scales", "1.5", "--merge"])
    rows = {r["config"]: r for r in _section(tmp_path, "old")["results"]}
    assert rows["dsx_auto_budget@1.5x"].get("budget_gb") == pytest.approx(0.75), rows["dsx_auto_budget@1.5x"]


def test_a_real_vocabulary_trains(tmp_path) -> None:
    """--vocab gives the head its real size: the tokens are drawn from it and the loss starts near log(vocab)."""
    import math

    bench_offload.main(["--quick", "--in-process", "--configs", "none", "--vocab", "5000", "--out", str(tmp_path),
                        "--section", "v"])  # fmt: skip
    row = _section(tmp_path, "v")["results"][0]
    assert "error" not in row and abs(row["losses"][0] - math.log(5000)) < 1.0, row.get("losses")


@pytest.mark.gpu
def test_gpu_memory_cap_holds_the_process_to_it() -> None:
    # in a child: the cap is for the whole process, and the device is named as bench_offload names it (no index)
    import subprocess
    import sys
    import textwrap

    import torch

    # Everything on the device counts against the cap, this test's own process too (earlier GPU tests leave
    # it holding memory): the child gets 4 GB on top of what is in use when it starts.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    if free < 6e9:
        pytest.skip(f"the test needs 6 GB of the device free, {free / 1e9:.1f} GB are")
    cap_gb = (total - free) / 1e9 + 4.0
    code = textwrap.dedent(f"""
        import torch
        from benchmarks import bench_offload
        bench_offload._cap_device_memory(torch.device("cuda"), {cap_gb!r})
        a = torch.empty(2 * 10**9, dtype=torch.uint8, device="cuda")  # within the cap
        try:
            b = torch.empty(3 * 10**9, dtype=torch.uint8, device="cuda")  # 5 GB with the first: over it
        except torch.OutOfMemoryError:
            print("capped")
        """)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "capped" in out.stdout


def test_a_length_sweep_from_two_kinds_of_gpu_names_each_configs_and_a_host_kill() -> None:
    """Parts merged from two GPU kinds: each config's label says which its rows came from (one kind: no label
    says it); a child killed by SIGKILL (the kernel's out-of-memory killer) is marked as host memory, and its
    config's longest length is its limit; a config with no failure, or one that failed otherwise at a longer
    length (a timeout), has a longest length that is not its limit."""
    ok = {"tokens_per_s": 1e4, "step_s": 1.0, "activation_peak_gb": 1.0, "step_s_runs": [1.0]}
    parts = [{"device": "NVIDIA H100 80GB HBM3"}, {"device": "NVIDIA H200"}]
    rows = [{"config": "recompute@seq1000", "seq_len": 1000, "part": 0, **ok},
            {"config": "hooks@seq1000", "seq_len": 1000, "part": 1, **ok},
            {"config": "hooks@seq2000", "seq_len": 2000, "part": 1, "error": "child exited -9 without a result",
             "returncode": -9}]  # fmt: skip
    figs = []

    def draw(rows: list[dict], parts: list[dict]) -> None:
        figs.append(plt.figure())
        bench_offload._draw(figs[-1], "lengths", {"results": rows, "parts": parts})

    draw(rows, parts)
    labels = [t.get_text() for t in figs[0].axes[0].get_legend().get_texts()]
    assert labels == [
        "hooks (longest 1,000; H200)",
        "recompute (trained 1,000, its limit not found; H100)",
    ], labels
    assert [t.get_text() for t in figs[0].axes[0].texts] == ["hooks: killed (host memory)"]
    draw(rows, parts[:1] * 2)
    labels = [t.get_text() for t in figs[1].axes[0].get_legend().get_texts()]
    assert labels == ["hooks (longest 1,000)", "recompute (trained 1,000, its limit not found)"], labels
    # the kinds the plot names are the ratios' (one rule): a part without rows, or without a device, adds none
    more = [*parts, {}, {"device": "NVIDIA A100-SXM4-80GB"}]
    rows.append({"config": "none@seq500", "seq_len": 500, "part": 2, **ok})
    rows.append(
        {"config": "none@seq1000", "seq_len": 1000, "part": 2, "error": "child timed out after 120 s"}
    )
    assert bench_offload._part_kinds(rows, more) == {0: "H100", 1: "H200"}
    draw(rows, more)
    labels = [t.get_text() for t in figs[2].axes[0].get_legend().get_texts()]
    assert labels == ["hooks (longest 1,000; H200)", "none (trained 500, its limit not found)",
                      "recompute (trained 1,000, its limit not found; H100)"]  # fmt: skip
    # rows from before rows named their part are the first part's; one kind with rows: nothing named
    assert bench_offload._part_kinds([{"config": "none@seq8", "seq_len": 8}], more) == {}
    plt.close("all")


def test_a_file_whose_sections_cannot_be_kept_stops_the_run_before_its_first_config(
    tmp_path, monkeypatch
) -> None:
    """The result file of another layout, or a section name that cannot be one, stops bench_offload before
    any config runs (a capacity part's one config can take a whole GPU command), and the file is left as it
    was."""

    def run_one(*_: object) -> None:
        raise AssertionError("a config ran")

    monkeypatch.setattr(bench_offload, "_run_one", run_one)
    path = tmp_path / "bench_offload.json"
    path.write_text('{"results": []}')
    for merge in ([], ["--merge"]):
        with pytest.raises(SystemExit, match="is not a file of benchmark result sections"):
            bench_offload.main(
                ["--quick", "--in-process", "--configs", "none", "--out", str(tmp_path), *merge]
            )
        assert path.read_text() == '{"results": []}'
    path.unlink()
    with pytest.raises(SystemExit):  # (argparse: "invalid section_name value")
        bench_offload.main(["--quick", "--in-process", "--configs", "none", "--out", str(tmp_path),
                            "--section", "8b.v2"])  # fmt: skip
    assert not path.exists()


def test_no_capacity_ratio_compares_runs_of_two_gpu_kinds() -> None:
    """Parts from two GPU kinds: each config's longest names its kinds, and a ratio is given only where both
    sides ran on one kind (here dsx and the peer at 32 on the first; dsx's own longest and no offload's not)."""
    rows = [{"config": "none@seq8", "seq_len": 8, "tokens_per_s": 100.0, "part": 0},
            {"config": "recompute@seq32", "seq_len": 32, "tokens_per_s": 70.0, "part": 0},
            {"config": "dsx_auto_budget@seq32", "seq_len": 32, "tokens_per_s": 91.0, "part": 0},
            {"config": "dsx_auto_budget@seq64", "seq_len": 64, "tokens_per_s": 84.0, "part": 1}]  # fmt: skip
    out = bench_offload._largest(rows, "seq_len", "seq", {0: "H100", 1: "H200"})
    assert out["largest"]["dsx_auto_budget"]["gpus"] == ["H200"] and out["largest"]["none"]["gpus"] == [
        "H100"
    ]
    assert "dsx_auto_budget_vs_none_tokens_per_s" not in out and "recompute_vs_none_tokens_per_s" in out
    at = out["at_best_peer"]
    assert at["dsx_auto_budget_vs_peer_tokens_per_s"] == 91.0 / 70.0
    assert at["dsx_auto_budget_vs_peer_tokens_per_s_by_seq_len"] == {"32": 91.0 / 70.0}
    # the peer's own runs at 32 from both kinds: no ratio there
    mixed = [*rows, {"config": "recompute@seq32", "seq_len": 32, "tokens_per_s": 72.0, "part": 1}]
    at = bench_offload._largest(mixed, "seq_len", "seq", {0: "H100", 1: "H200"})["at_best_peer"]
    assert (
        "dsx_auto_budget_vs_peer_tokens_per_s" not in at
        and at["dsx_auto_budget_vs_peer_tokens_per_s_by_seq_len"] == {}
    )
    # one kind: as before, no "gpus"
    assert "gpus" not in bench_offload._largest(rows, "seq_len", "seq")["largest"]["none"]
