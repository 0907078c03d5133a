"""benchmarks/_common.py: the environment record, CLI flags, strict JSON and an Agg PNG, on real files."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from benchmarks._common import (
    add_common_args,
    environment,
    read_sections,
    save_png,
    save_sections_png,
    versions,
    write_json,
    write_section,
)


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


def test_sections_are_written_one_at_a_time_and_keep_their_place(tmp_path) -> None:
    g = torch.Generator().manual_seed(3)
    a, b, a2 = ({"figures": (torch.rand(3, generator=g) + 0.5).tolist()} for _ in range(3))
    assert read_sections(tmp_path, "bench") == {}  # no file: no section
    write_section(a, tmp_path, "bench", "a")
    path, sections = write_section(b, tmp_path, "bench", "b")
    assert path == tmp_path / "bench.json" and list(sections) == ["a", "b"]
    _, sections = write_section(a2, tmp_path, "bench", "a")  # a rerun replaces its section, in its place
    assert list(sections) == ["a", "b"] and sections["a"]["figures"] == a2["figures"]
    assert sections["b"]["figures"] == b["figures"] and sections["a"]["env"]["device"]
    assert read_sections(tmp_path, "bench") == sections == json.loads(path.read_text())["sections"]
    with pytest.raises(ValueError, match="section name"):
        write_section(a, tmp_path, "bench", "a/b")


def test_a_file_of_another_kind_is_refused_and_left_as_it_was(tmp_path) -> None:
    path = tmp_path / "bench.json"
    for text in ('{"sections": {"a": ', '{"results": []}', '{"sections": {"a": 1}}', "[1]", "\xff"):
        path.write_text(text, encoding="latin-1")
        with pytest.raises(SystemExit, match=r"bench\.json is not a file of benchmark result sections"):
            write_section({"figures": [1.0]}, tmp_path, "bench", "a")
        assert path.read_text(encoding="latin-1") == text


def test_one_png_draws_every_section_a_panel_each(tmp_path) -> None:
    sections = {"a": {"y": torch.rand(4).tolist()}, "b": {"y": torch.rand(5).tolist()}}
    drawn = []

    def draw(panel, name, result) -> None:
        drawn.append(name)
        panel.subplots().plot(result["y"])
        panel.suptitle(name)

    path = save_sections_png(sections, draw, tmp_path, "bench", size=(4.0, 3.0), dpi=50)
    assert drawn == ["a", "b"] and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    assert Image.open(path).size == (200, 300)  # a panel each, one above the other


def test_a_write_cut_short_leaves_the_file_as_it_was(tmp_path, monkeypatch) -> None:
    """The file is written beside itself and moved over it: a run killed before the move (a suite's timeout)
    leaves every section as it was, not a file cut short."""
    import os

    path, _ = write_section({"figures": [1.0]}, tmp_path, "bench", "a")
    before = path.read_text()

    def killed(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_section({"figures": torch.rand(1000).tolist()}, tmp_path, "bench", "b")
    assert path.read_text() == before
