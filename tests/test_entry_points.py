"""Entry points as a user meets them: --help shows defaults, the main job runs without DALI, and a config error
prints its lines once, without a traceback, and exits non-zero (under the deepspeed launcher too)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsx import cli
from tests.harness import REPO, launch, launcher_env, load_example

EXAMPLES = [
    "examples/gpt/train.py",
    "examples/gnn/train_sage.py",
    "examples/rgnn/train_rgnn.py",
    "examples/rgnn/train_sampled.py",
]
BENCHMARKS = sorted(
    p.relative_to(REPO).as_posix()
    for p in (REPO / "benchmarks").glob("*.py")
    if not p.name.startswith("_") and "ArgumentParser(" in p.read_text()
)
TINY = ["--steps", "3", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len", "32", "--no-progress"]

# Runs a script with every ``nvidia.*`` module unimportable, as on a machine without DALI (CI installs it).
# torch is imported first: a CUDA build locates its nvidia libraries by path, not by import.
NO_NVIDIA = textwrap.dedent("""
    import importlib.abc, runpy, sys
    import torch

    class NoNvidia(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "nvidia" or name.startswith("nvidia."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoNvidia())
    import dsx.data.tokens
    assert not dsx.data.tokens.WITH_DALI and not dsx.data.tokens.dali_available()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
""")


def _python(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("script", EXAMPLES)
def test_example_help_shows_defaults(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = load_example(script, Path(script).stem + "_help")
    with pytest.raises(SystemExit) as exit_:
        module.parse_args(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert "(default: " in out, out


@pytest.mark.parametrize("command", ["", *cli._COMMANDS])
def test_dsx_command_help_shows_defaults(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"] if command else ["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    # the top level lists the commands; every command has at least one option with a default
    assert ("(default: " in out) if command else all(c in out for c in cli._COMMANDS), out


@pytest.mark.slow
@pytest.mark.parametrize("script", BENCHMARKS)
def test_benchmark_help_shows_defaults(script: str) -> None:
    res = _python([script, "--help"], timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "(default: " in res.stdout, res.stdout


def test_main_job_without_dali() -> None:
    """The main job's --help, and a short training with the loader left on auto, where nvidia.* is absent."""
    helped = _python(["-c", NO_NVIDIA, "examples/gpt/train.py", "--help"])
    assert helped.returncode == 0 and "(default: auto)" in helped.stdout, helped.stderr[-3000:]
    cfg = str(REPO / "configs" / "gpt_zero2.json")
    run = _python(["-c", NO_NVIDIA, "examples/gpt/train.py", "--deepspeed_config", cfg, *TINY])
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert "summary: steps 3" in run.stdout, run.stdout[-3000:]


def test_bad_json_exits_2_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_micro_batch_size_per_gpu": 8,,}')
    res = _python(["examples/gpt/train.py", "--deepspeed_config", str(bad), *TINY])
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.count("is not valid JSON") == 1 and "Traceback" not in res.stderr, res.stderr


def test_config_errors_are_recognised() -> None:
    from dsx.config import DsxConfigError, parse_dsx_config

    with pytest.raises(DsxConfigError) as bad_key:
        parse_dsx_config({"activation_offload": {"enabledd": True}})
    assert "unknown key" in (cli.config_error_message(bad_key.value) or "")
    try:
        json.loads("{,}")
    except json.JSONDecodeError as exc:
        assert "not valid JSON" in (cli.config_error_message(exc) or "")
    assert cli.config_error_message(RuntimeError("a crash, not a config error")) is None


@pytest.mark.slow
def test_config_error_under_the_launcher_prints_once(tmp_path: Path) -> None:
    """Two CPU ranks, a misspelt dsx key: one message (rank 0), no traceback, a failing exit status."""
    cfg = json.loads((REPO / "configs" / "gpt_zero2.json").read_text())
    cfg["dsx"] = {"activation_offload": {"enabledd": True}}
    path = tmp_path / "bad_key.json"
    path.write_text(json.dumps(cfg))
    res = launch(
        REPO / "examples/gpt/train.py", ["--deepspeed_config", str(path), *TINY], nprocs=2, timeout=300
    )
    assert res.returncode != 0, res.output[-3000:]
    assert res.output.count("dsx.activation_offload.enabledd: unknown key") == 1, res.output[-3000:]
    assert "Traceback" not in res.output, res.output[-3000:]
