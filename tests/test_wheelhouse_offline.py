"""The offline wheelhouse pair end to end: build dsx's wheel, install it with no index into a fresh venv
that reuses the system stack (--system-site-packages), and import dsx from outside the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheelhouse_only_project_installs_offline_and_imports(tmp_path: Path) -> None:
    house, venv = tmp_path / "house", tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    build = subprocess.run(["bash", str(REPO / "launch/wheelhouse_build.sh"), "--out", str(house), "--only-project"],
                           env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    wheels = list(house.glob("dsx-*.whl"))
    assert len(wheels) == 1, sorted(p.name for p in house.iterdir())
    # No index and no proxy: any attempt to reach the network fails instead of silently downloading.
    env |= {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "https_proxy": "http://127.0.0.1:9",
            "http_proxy": "http://127.0.0.1:9", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"}  # fmt: skip
    # --system-site-packages exposes the *base* interpreter's packages; when the stack itself lives in a venv
    # (as in CI: /work/venv, or a cluster image's venv) a .pth line makes it visible too, which is what an
    # image-provided torch looks like to the new venv.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, env=env)
    # The stack is linked entry by entry, leaving out dsx itself (installed editable in the dev environment),
    # so that the dsx the venv imports can only be the one from the wheelhouse.
    stack = tmp_path / "stack"
    stack.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().startswith(("dsx", "__editable__")):
            (stack / entry.name).symlink_to(entry)
    (next((venv / "lib").glob("python3*/site-packages")) / "_stack.pth").write_text(f"{stack}\n")
    inst = subprocess.run(["bash", str(REPO / "launch/wheelhouse_install.sh"), str(house), "--venv", str(venv),
                           "--system-site-packages", "--no-deps"], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert inst.returncode == 0, inst.stdout + inst.stderr
    # From outside the tree (cwd = tmp_path, no PYTHONPATH): dsx must come from the new venv, with its deps
    # (torch, deepspeed, pydantic) from the system site-packages the venv was told to see.
    code = "import dsx, deepspeed, sys; print(dsx.__file__); print(sys.prefix)"
    env["DS_ACCELERATOR"] = "cpu"
    check = subprocess.run([str(venv / "bin/python"), "-c", code], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    origin, prefix = check.stdout.strip().splitlines()[-2:]
    assert origin.startswith(str(venv)) and Path(prefix) == venv, check.stdout
    assert not origin.startswith(str(REPO))
