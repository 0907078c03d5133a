"""The first-run op build notice: one line naming what compiles while the op is not cached, none once it is."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from dsx.ops import notice
from tests.harness import REPO

CONFIGS = REPO / "configs"


@pytest.fixture
def ext_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh torch extension cache, and a process that has announced nothing yet."""
    root = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(notice, "_announced", set())
    return root


def _config(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def _cache(root: Path, *names: str) -> None:
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / f"{name}.so").write_bytes(b"")


def test_fresh_cache_prints_one_line(ext_dir: Path) -> None:
    out = io.StringIO()
    line = notice.announce_builds(_config("gpt_offload_cpu.json"), stream=out)
    assert line is not None and out.getvalue() == line + "\n"
    assert "cpu_adam" in line and "offload_optimizer to cpu" in line and str(ext_dir) in line
    assert "waits" in line and "min" in line  # why the start waits, and about how long
    # said once per process, however often the engine asks
    assert notice.announce_builds(_config("gpt_offload_cpu.json"), stream=out) is None
    assert out.getvalue().count("\n") == 1


def test_cached_ops_print_nothing(ext_dir: Path) -> None:
    _cache(ext_dir, "cpu_adam", "deepspeed_shm_comm")
    out = io.StringIO()
    assert notice.announce_builds(_config("gpt_offload_cpu.json"), stream=out) is None
    assert out.getvalue() == ""


def test_a_cache_built_by_another_torch_is_rebuilt(ext_dir: Path) -> None:
    """Another venv's build of the op: torch's ninja recompiles it here (new include paths), so say so."""
    import torch

    _cache(ext_dir, "cpu_adam", "deepspeed_shm_comm")
    ours = Path(torch.__file__).parent / "include"
    (ext_dir / "deepspeed_shm_comm" / "build.ninja").write_text(f"cflags = -isystem {ours}\n")
    (ext_dir / "cpu_adam" / "build.ninja").write_text(
        "cflags = -isystem /elsewhere/site-packages/torch/include\n"
    )
    assert [b.name for b in notice.pending_builds(_config("gpt_offload_cpu.json"))] == ["cpu_adam"]


def test_what_each_config_builds(ext_dir: Path) -> None:
    _cache(ext_dir, "deepspeed_shm_comm")  # leave the CPU all-reduce op out of the comparisons
    names = lambda cfg: [b.name for b in notice.pending_builds(cfg)]  # noqa: E731
    assert names(_config("gpt_zero2.json")) == []
    assert names(_config("gpt_offload_cpu.json")) == ["cpu_adam"]
    nvme = _config("gpt_offload_nvme.json")
    assert names(nvme) == ["cpu_adam", "async_io"]  # ZeRO-3 swaps the optimizer state through async_io
    nvme["zero_optimization"]["stage"] = 2  # stages 1 and 2 treat nvme as cpu
    assert names(nvme) == ["cpu_adam"]
    torch_adam = _config("gpt_offload_cpu.json")
    torch_adam["optimizer"]["params"]["torch_adam"] = True
    assert names(torch_adam) == []
    # the gather kernel is CUDA only
    assert names({"dsx": {"unified": {"enabled": True}}}) == []


def test_cpu_all_reduce_op_before_the_process_group(ext_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # (an engine built earlier in this test process may have started a process group)
    monkeypatch.setattr(notice, "_dist_initialized", lambda: False)
    out = io.StringIO()
    line = notice.announce_comm_build(stream=out)
    assert line is not None and "deepspeed_shm_comm" in line and out.getvalue() == line + "\n"


def test_other_local_ranks_stay_quiet(ext_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    out = io.StringIO()
    assert notice.announce_builds(_config("gpt_offload_cpu.json"), stream=out) is not None
    assert out.getvalue() == ""


def test_default_root_matches_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr("torch.utils.cpp_extension.get_default_build_root", lambda: str(tmp_path))
    assert Path(_get_build_directory("probe", verbose=False)) == notice.extensions_root() / "probe"


def test_an_old_build_lock_is_named_with_what_to_do(ext_dir: Path) -> None:
    """torch's JIT load waits while ``<cache>/<op>/lock`` exists; a build that died leaves it. The notice names a
    lock older than any build takes (a real file, aged), and says nothing of a young one (a build that runs)."""
    import os
    import time

    lock = ext_dir / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    young = notice.announce_builds(_config("gpt_offload_cpu.json"), stream=io.StringIO())
    assert young is not None and "build lock" not in young
    notice._announced.clear()
    old = time.time() - notice.STALE_LOCK_S - 120
    os.utime(lock, (old, old))
    line = notice.announce_builds(_config("gpt_offload_cpu.json"), stream=io.StringIO())
    assert line is not None and f"cpu_adam's build lock {lock} is 12 min old" in line, line
    assert "remove it" in line and "deepspeed_shm_comm's build lock" not in line


def test_a_cached_op_counts_as_built_only_past_its_probe(
    ext_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed runs an op's compatibility probe before it looks in torch's cache: a cached build whose probe
    fails does not load, so it is not built; one that passes is (a real file in the cache, no build file)."""
    from dsx.ops.cache import is_built

    assert not is_built("cpu_adagrad", compatible=True)  # nothing cached
    so = ext_dir / "cpu_adagrad" / "cpu_adagrad.so"
    so.parent.mkdir(parents=True)
    so.write_bytes(b"\x7fELF")
    assert is_built("cpu_adagrad", compatible=True)
    assert not is_built("cpu_adagrad", compatible=False)
    # prebuilt into DeepSpeed: it loads, whatever the probe says, cached or not
    monkeypatch.setattr("dsx.ops.cache.is_prebuilt", lambda name: name == "cpu_adagrad")
    assert is_built("cpu_adagrad", compatible=False)
    so.unlink()
    assert is_built("cpu_adagrad", compatible=False)
    monkeypatch.setattr("dsx.ops.cache.is_prebuilt", lambda name: False)
    assert not is_built("cpu_adagrad", compatible=True)
