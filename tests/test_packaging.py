"""A non-editable install ships what the gather op's JIT build needs, and nothing that is not the package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.harness import REPO

# What a source checkout needs to build the wheel; tests/, benchmarks/ and examples/ go along so that the
# test sees them left out.
TREE = [
    "pyproject.toml",
    "setup.py",
    "README.md",
    "dsx",
    "csrc",
    "tests",
    "benchmarks",
    "examples",
    "configs",
]


def _setuptools_major() -> int:
    try:
        import setuptools
    except ImportError:
        return 0
    return int(setuptools.__version__.split(".")[0])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    if _setuptools_major() < 77:
        pytest.skip("setuptools >= 77 is needed to build without isolation (launch/setup_env.sh installs it)")
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "results", "*.so")
    for name in TREE:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        elif path.exists():
            shutil.copy2(path, src / name)
    out = src / "wheelhouse"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        cwd=src, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    (whl,) = out.glob("dsx-*.whl")
    return whl, res.stdout + res.stderr


@pytest.mark.slow
def test_wheel_ships_the_kernel_sources(wheel: tuple[Path, str]) -> None:
    whl, _ = wheel
    names = set(zipfile.ZipFile(whl).namelist())
    for src in ("unified_gather.cu", "unified_gather.cpp", "unified_gather.h"):
        assert f"dsx/csrc/{src}" in names, sorted(names)
    assert "dsx/ops/unified_gather.py" in names and "dsx/__init__.py" in names
    stray = sorted(
        n for n in names if n.split("/")[0] in ("tests", "benchmarks", "examples", "configs", "csrc")
    )
    assert not stray, stray
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert "License-Expression: Apache-2.0" in zipfile.ZipFile(whl).read(meta).decode()


@pytest.mark.slow
def test_wheel_build_has_no_deprecation_warnings(wheel: tuple[Path, str]) -> None:
    _, log = wheel
    assert "deprecat" not in log.lower(), log[-4000:]


@pytest.mark.slow
def test_installed_package_finds_its_kernel_sources(wheel: tuple[Path, str], tmp_path: Path) -> None:
    """Unpacked as pip installs it, ``csrc_dir()`` resolves inside the package, not to a checkout."""
    whl, _ = wheel
    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "from dsx.ops.unified_gather import UnifiedGatherBuilder, csrc_dir; "
        "print(csrc_dir()); print(*UnifiedGatherBuilder().sources())"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", probe, str(site)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert lines[-2] == str(site / "dsx" / "csrc"), res.stdout
    assert all(Path(s).is_file() and Path(s).is_relative_to(site) for s in lines[-1].split()), res.stdout
