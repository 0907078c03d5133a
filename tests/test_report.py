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


def test_report_names_torch_build_locks(tmp_path) -> None:
    """The locks torch's JIT load leaves in the extension cache (where a build that died leaves one, every later
    load of the op waits): none in an empty cache; one named with its op, path and age."""
    env = launcher_env()
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path)
    run = dict(cwd=REPO, env=env, capture_output=True, text=True, timeout=180)

    def locks() -> str:
        out = subprocess.run([sys.executable, "-m", "dsx.cli", "report", "--json"], **run)
        assert out.returncode == 0, out.stderr
        return {r["item"]: r["value"] for r in json.loads(out.stdout)["rows"]}["op build locks"]

    assert locks() == "none"
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "lock").touch()
    got = locks()
    assert (
        got.startswith(f"cpu_adam: lock 0 min old ({tmp_path / 'cpu_adam' / 'lock'})") and "remove" in got
    ), got


def test_report_bad_io_path(tmp_path) -> None:
    out = _dsx("report", "--io", str(tmp_path / "missing"))
    assert out.returncode == 2
    assert "not an existing directory" in out.stdout and "Traceback" not in out.stdout + out.stderr


def test_the_ops_row_agrees_with_deepspeeds_own_probe(tmp_path) -> None:
    """Each DeepSpeed op the report lists as jit or incompatible is what DeepSpeed's ``is_compatible`` says when
    called as a job calls it (in an empty extension cache, so that no op shows as built)."""
    env = {**launcher_env(), "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    script = """
import json
from deepspeed.ops.op_builder.all_ops import ALL_OPS
from dsx.report import collect
row = next(r["value"] for r in collect()["rows"] if r["item"] == "ops (compatible / built)")
states = dict(p.split(":") for p in row.split(", "))
print(json.dumps({n: [s, "jit" if ALL_OPS[n].is_compatible(verbose=False) else "incompatible"] for n, s in states.items()}))
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    states = json.loads(out.stdout.strip().splitlines()[-1])
    assert "async_io" in states and "cpu_adam" in states, states
    assert all(got == want for got, want in states.values()), states
