"""`dsx report`: a table or JSON, every optional part reported, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.harness import REPO, launcher_env


def _dsx(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dsx.cli", *args], cwd=REPO, env=launcher_env(), capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip


def test_report_table() -> None:
    out = _dsx("report")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    for item in ("torch", "deepspeed", "triton", "kvikio", "libaio", "nvidia-dali", "torch-geometric",
                 "megatron-core", "/dev/shm", "locked-memory limit", "activation offload I/O", "unified gather"):  # fmt: skip
        assert item in out.stdout, item


def test_report_json_with_io(tmp_path) -> None:
    out = _dsx("report", "--io", str(tmp_path), "--io-mb", "8", "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    items = {r["item"]: r["value"] for r in rep["rows"]}
    assert items["version"] and "GPUs" in items
    assert rep["io"]["write_GBps"] > 0 and rep["io"]["read_GBps"] > 0 and rep["io"]["bytes"] >= 8 << 20
    assert not list(tmp_path.iterdir()), "the probe file must be removed"


def test_report_bad_io_path(tmp_path) -> None:
    out = _dsx("report", "--io", str(tmp_path / "missing"))
    assert out.returncode == 2
    assert "not an existing directory" in out.stdout and "Traceback" not in out.stdout + out.stderr
