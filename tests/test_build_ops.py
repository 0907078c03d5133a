"""`dsx build-ops --config`: every op the config's job would compile at its start is in the cache afterwards (a
second run builds nothing); a missing or malformed config, or an op DeepSpeed cannot build here, is a clear
error and no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsx.ops.notice import pending_builds
from tests.harness import REPO, launcher_env

CONFIG = REPO / "configs" / "gpt_offload_cpu.json"  # ZeRO-2 with the optimizer on the CPU: cpu_adam


def _dsx(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dsx.cli", "build-ops", *args], cwd=REPO, env=env or launcher_env(),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_builds_what_the_config_needs_then_nothing() -> None:
    """In the extension cache the other tests share (the ops are theirs too: built once for all; a cold cache's
    first run builds them here, a warm one checks only that nothing is built again). Whatever the config's job
    would build before the run is built by it; after it, nothing is pending."""
    config = json.loads(CONFIG.read_text())
    before = {b.name for b in pending_builds(config)}
    first = _dsx("--config", str(CONFIG))
    assert first.returncode == 0, first.stderr
    assert "Traceback" not in first.stdout + first.stderr
    assert pending_builds(config) == [], "an op the config needs is still not cached"
    lines = [line for line in first.stdout.splitlines() if line.startswith(("built: ", "nothing to build"))]
    assert len(lines) == 1, first.stdout
    built = set(lines[0].removeprefix("built: ").split(", ")) if lines[0].startswith("built: ") else set()
    assert built <= before, (built, before)  # (a test beside this one may have built some meanwhile)
    second = _dsx("--config", str(CONFIG))
    assert second.returncode == 0, second.stderr
    assert "nothing to build" in second.stdout and "built:" not in second.stdout


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "no DeepSpeed config at"),
        ("{not json", "is not valid JSON"),
        (b"\xff\xfe{}", "is not valid JSON"),
        ("[1, 2]", "holds a JSON list"),
        ("dir", "cannot read the DeepSpeed config"),
    ],
)
def test_a_bad_config_is_a_clear_error(tmp_path: Path, content: str | bytes | None, message: str) -> None:
    path = tmp_path / "ds_config.json"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    out = _dsx("--config", str(path))
    assert out.returncode == 2 and message in out.stderr and str(path) in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_async_io_is_usable_only_where_deepspeed_loads_it() -> None:
    """dsx calls async_io usable only where DeepSpeed loads it: prebuilt, or past DeepSpeed's compatibility probe,
    which its JIT load runs before it looks in the extension cache. A cached build loads then without
    compiling; where dsx says no, the reason says what to install."""
    script = """
import sys
from deepspeed.ops.op_builder import AsyncIOBuilder
from dsx.ops.aio import async_io_status
from dsx.ops.cache import is_cached, is_prebuilt
ok, why = async_io_status()
print(ok, is_cached("async_io"), why)
if not ok:
    sys.exit(0 if "libaio" in why or "DeepSpeed" in why else 4)
if not (is_prebuilt("async_io") or AsyncIOBuilder().is_compatible(verbose=False)):
    sys.exit(5)  # DeepSpeed would refuse to load what dsx calls usable
if is_cached("async_io"):
    AsyncIOBuilder().load(verbose=False)  # a cached build: loads without compiling
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=launcher_env(), capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, (out.stdout, out.stderr[-2000:])


def test_async_io_without_libaio_says_what_to_install(tmp_path: Path) -> None:
    """A config that asks for DeepSpeed's aio backend by name on a machine without the libaio headers (in a
    fresh extension cache)."""
    env = launcher_env()
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "ext")
    probe = "import sys; from dsx.ops.aio import async_io_status; sys.exit(3 if async_io_status()[0] else 0)"
    usable = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert usable.returncode in (0, 3), usable.stderr
    if usable.returncode == 3:
        pytest.skip(
            "async_io can be built here (libaio-dev installed): the error path needs a machine without it"
        )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "dsx": {"activation_offload": {"enabled": True, "tiers": ["ssd"], "io_backend": "aio"}},
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    out = _dsx("--config", str(path), env=env)
    assert out.returncode == 1 and "cannot build async_io" in out.stderr and "libaio-dev" in out.stderr, (
        out.stdout,
        out.stderr,
    )


def test_the_gather_op_without_cuda_is_a_clear_error() -> None:
    """Plain `dsx build-ops` builds dsx's CUDA op: on a torch without CUDA, exit 1 with the reason."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA: the gather op builds here (a GPU test builds it)")
    out = _dsx()
    assert out.returncode == 1 and "dsx build-ops: dsx unified gather kernel unavailable" in out.stderr, (
        out.stderr
    )
    assert "Traceback" not in out.stderr
