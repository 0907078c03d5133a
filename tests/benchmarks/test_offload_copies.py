"""benchmarks/bench_offload.py's ``none_copies``: the hide-only plan's bytes moved without dsx, each way, on
every training step and only then; its byte count comes from the same invocation's hide-only run."""

from __future__ import annotations

import torch

from benchmarks import bench_offload


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
    import json
    import statistics

    import pytest

    # (posix: the auto backend would build DeepSpeed's async_io op where libaio-dev is installed, minutes on CI)
    bench_offload.main(["--quick", "--in-process", "--configs", "dsx_ssd", "--repeats", "2", "--ssd-dir",
                        str(tmp_path), "--out", str(tmp_path), "--name", "ssd", "--io-backend", "posix"])  # fmt: skip
    saved = json.loads((tmp_path / "ssd.json").read_text())
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
