"""benchmarks/_common.py: the environment record, CLI flags, strict JSON and an Agg PNG, on real files."""

from __future__ import annotations

import argparse
import json
import math

import torch

from benchmarks._common import add_common_args, environment, save_png, versions, write_json


def test_common_args_defaults_and_flags() -> None:
    p = add_common_args(argparse.ArgumentParser())
    a = p.parse_args([])
    assert a.out == "benchmarks/results" and a.quick is False
    b = p.parse_args(["--out", "/x/y", "--quick"])
    assert b.out == "/x/y" and b.quick is True


def test_environment_names_device_versions_date() -> None:
    env = environment()
    assert env["versions"]["torch"] == torch.__version__
    assert env["device"] and env["date_utc"].endswith("+00:00")
    assert env["versions"]["python"].count(".") == 2
    assert versions()["deepspeed"] is not None and env["cpu_count"] >= 1


def test_write_json_is_strict_and_carries_env(tmp_path) -> None:
    g = torch.Generator().manual_seed(7)
    figures = torch.rand(5, generator=g) + 0.5
    path = write_json(
        {"config": {"n": 5}, "figures": {"gbps": figures, "bad": math.nan}}, tmp_path / "o", "b"
    )
    data = json.loads(path.read_text())  # strict parser would choke on NaN
    assert path.name == "b.json" and "NaN" not in path.read_text()
    assert data["figures"]["bad"] is None
    assert data["figures"]["gbps"] == [float(x) for x in figures]  # tensor -> list, values kept exactly
    assert data["env"]["device"] and data["config"] == {"n": 5}


def test_save_png_writes_a_png(tmp_path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot(torch.rand(10).tolist())
    path = save_png(fig, tmp_path, "plot")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
    assert fig.number not in plt.get_fignums(), "the figure must be closed"
