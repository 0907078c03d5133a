"""launch/: every script parses, answers --help, refuses bad arguments; the offline wheelhouse really installs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO

SCRIPTS = [*sorted((REPO / "launch").glob("*.sh")), REPO / "launch" / "slurm.sbatch"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize(
    "name",
    ["local_multinode.sh", "single_node.sh", "multinode_pdsh.sh", "multinode_nossh.sh", "wheelhouse_build.sh",
     "wheelhouse_install.sh"],
)  # fmt: skip
def test_help_and_missing_args(name: str) -> None:
    script = REPO / "launch" / name
    ok = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip(), ok.stderr
    bad = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert bad.returncode != 0


def test_nossh_requires_node_rank(tmp_path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=1\nb slots=1\n")
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK",)}
    out = subprocess.run(["bash", str(REPO / "launch/multinode_nossh.sh"), str(hostfile), "x.py"], env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode != 0 and "NODE_RANK" in out.stderr


@pytest.mark.slow
def test_offline_wheelhouse_roundtrip(tmp_path) -> None:
    house = tmp_path / "house"
    subprocess.run(["bash", str(REPO / "launch/wheelhouse_build.sh"), "--out", str(house), "--only-project"],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    assert list(house.glob("dsx-*.whl"))
    venv = tmp_path / "venv"
    # The install itself is offline (PIP_NO_INDEX).
    env = {**os.environ, "PIP_NO_INDEX": "1", "PYTHONPATH": ""}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "PIP_NO_INDEX": "1", "PYTHONPATH": "", "VIRTUAL_ENV": str(venv)}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    out = subprocess.run(["bash", str(REPO / "launch/wheelhouse_install.sh"), str(house), "--no-deps"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dsx 0.1.0 installed" in out.stdout
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert (site / "dsx" / "engine.py").is_file() and (site / "dsx" / "config.py").is_file()
    check = subprocess.run([str(venv / "bin/python"), "-c", "import importlib.util as u; print(u.find_spec('dsx').origin)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)  # fmt: skip
    assert check.returncode == 0 and str(venv) in check.stdout, check.stdout + check.stderr
