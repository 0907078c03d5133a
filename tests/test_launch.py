"""launch/: every script parses, answers --help, refuses bad arguments; the offline wheelhouse really installs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.harness import REPO

SCRIPTS = [
    *sorted((REPO / "launch").glob("*.sh")),
    REPO / "launch" / "slurm.sbatch",
    REPO / "tests/run.sh",
    REPO / ".ci/run",
]


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


@pytest.mark.parametrize("name", ["quickstart.sh", "slurm.sbatch"])
def test_help_comes_before_any_setup(name: str, tmp_path) -> None:
    """quickstart.sh would build .venv and slurm.sbatch read SLURM's variables before the job: --help prints the
    usage and does neither (run from a copy, so that a setup would show as a .venv beside it)."""
    (tmp_path / "launch").mkdir()
    script = tmp_path / "launch" / name
    script.write_text((REPO / "launch" / name).read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and "launch/" + name in out.stdout, (out.stdout, out.stderr)
    assert not (tmp_path / ".venv").exists()


def test_setup_env_help() -> None:
    out = subprocess.run(
        ["bash", str(REPO / "launch/setup_env.sh"), "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "DSX_SKIP_DALI" in out.stdout, out.stderr


def test_run_sh_says_to_run_command_1_first(tmp_path) -> None:
    """README command 2 without command 1's tools: one line that says what to do, not a bash error."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": str(tmp_path / "no-python")}
    out = subprocess.run(["bash", str(REPO / "tests/run.sh")], env=env, capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stderr.strip().count("\n") == 0 and "README command 1" in out.stderr, out.stderr
