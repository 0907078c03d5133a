"""The fault injector (dsx.testing.faults) in one process: each kind does what the harness relies on, at dsx's
seams only, and nothing happens without DSX_FAULT."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dsx.direct import shm
from dsx.offload.io import PosixBackend
from dsx.testing import faults
from dsx.testing.faults import FaultSpec
from tests.faults.trials import SITE, Dirs, Owners, _touched, next_start, plant_sentinels
from tests.harness import REPO, launcher_env


@pytest.fixture
def restore_seams(monkeypatch) -> None:
    """Whatever an installed injector patches goes back after the test (monkeypatch records the originals)."""
    for name in ("_pwrite", "_pread", "_preadv"):
        monkeypatch.setattr(PosixBackend, name, PosixBackend.__dict__[name])
    monkeypatch.setattr(shm, "_fallocate", shm._fallocate)
    monkeypatch.setattr(shm, "_setup_point", shm._setup_point)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))


def _backend(tmp_path: Path, size: int = 3 * 4096) -> PosixBackend:
    path = tmp_path / "activations.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    return PosixBackend(str(path), fd)


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for f in log.glob("*.jsonl") for line in f.read_text().splitlines()]


def test_spec_round_trips_and_names_what_is_wrong() -> None:
    spec = FaultSpec.parse("kind=io_error, op=read,nth=3,rank=1,seed=7")
    assert spec == FaultSpec("io_error", op="read", nth=3, rank=1, seed=7)
    assert FaultSpec.parse(str(spec)) == spec
    for bad, words in [("op=read", "no kind"), ("kind=melt", "kind='melt'"), ("kind=io_error,nth=x", "nth"),
                       ("kind=io_error,when=3", "when=3"), ("kind=sigkill_setup,at=never", "at='never'")]:  # fmt: skip
        with pytest.raises(ValueError, match="DSX_FAULT") as err:
            FaultSpec.parse(bad)
        assert words in str(err.value)
    assert faults.install_from_env({}) is None


def test_io_error_names_file_and_offset_and_fires_once(tmp_path, restore_seams) -> None:
    faults.install(FaultSpec("io_error", op="write", nth=2), str(tmp_path))
    io = _backend(tmp_path)
    buf = torch.ones(4096, dtype=torch.uint8)
    io.pwrite(buf, 0).result()
    with pytest.raises(
        OSError, match=r"dsx posix write failed: Input/output error \(path=\S+, offset=4096"
    ) as err:
        io.pwrite(buf, 4096).result()
    assert err.value.errno == errno.EIO
    io.pwrite(buf, 8192).result()
    io.close()
    [hit] = [r for r in _records(tmp_path) if r["event"] == "injected"]
    assert hit["what"] == "io_error" and hit["offset"] == 4096


def test_a_short_read_is_retried(tmp_path, restore_seams) -> None:
    faults.install(FaultSpec("short_read", nth=1, keep=4096), str(tmp_path))
    io = _backend(tmp_path)
    data = torch.randint(0, 256, (3 * 4096,), dtype=torch.uint8)
    io.pwrite(data, 0).result()
    out = torch.zeros_like(data)
    assert io.pread(out, 0).result() == data.numel()
    assert torch.equal(out, data)  # the loop asked again for what the short count left
    [hit] = [r for r in _records(tmp_path) if r["event"] == "injected"]
    assert (hit["asked"], hit["returned"]) == (3 * 4096, 4096)
    io.close()


def test_a_read_of_zero_bytes_is_an_end_of_file(tmp_path, restore_seams) -> None:
    faults.install(FaultSpec("short_read", nth=1, keep=0))
    io = _backend(tmp_path)
    with pytest.raises(OSError, match=r"dsx posix read failed: Input/output error \(path=\S+, offset=0"):
        io.pread(torch.zeros(4096, dtype=torch.uint8), 0).result()
    io.close()


def test_enospc_and_corrupt_act_on_the_real_file(tmp_path, restore_seams) -> None:
    faults.install(FaultSpec("corrupt", nth=1, nbytes=4, seed=3), str(tmp_path))
    io = _backend(tmp_path)
    data = torch.randint(0, 256, (2 * 4096,), dtype=torch.uint8)
    io.pwrite(data, 4096).result()
    on_disk = torch.frombuffer(bytearray(Path(io.path).read_bytes()[4096 : 3 * 4096]), dtype=torch.uint8)
    changed = (on_disk != data).nonzero().flatten().tolist()
    [hit] = [r for r in _records(tmp_path) if r["event"] == "injected"]
    assert changed == list(range(hit["offset"] - 4096, hit["offset"] - 4096 + 4))
    assert changed[0] < 4096  # below size - 4 KiB: inside the tensor's bytes whatever its padding
    io.close()


def test_enospc_keeps_its_errno(tmp_path, restore_seams) -> None:
    faults.install(FaultSpec("enospc", nth=1))
    io = _backend(tmp_path)
    with pytest.raises(OSError, match="No space left on device") as err:
        io.pwrite(torch.ones(4096, dtype=torch.uint8), 0).result()
    assert err.value.errno == errno.ENOSPC  # what the SSD tier falls back to the host tier on
    io.close()


def test_shm_enospc_is_a_shared_memory_error_that_leaves_nothing(tmp_path, restore_seams) -> None:
    faults.install(FaultSpec("shm_enospc"))
    with pytest.raises(shm.SharedMemoryError, match=r"shared memory directory .*No space left on device"):
        shm.share_tensor(torch.arange(10.0), str(tmp_path), name="feat")
    assert list(tmp_path.iterdir()) == []


def _python(code: str, extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = launcher_env(extra)
    env["PYTHONPATH"] = f"{SITE}{os.pathsep}{env['PYTHONPATH']}"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)


def test_sitecustomize_patches_at_import_only_when_asked(tmp_path) -> None:
    code = ("import sys; import dsx.testing.faults; early = 'torch' in sys.modules; "
            "from dsx.offload.io import PosixBackend; print(early, PosixBackend._pwrite.__qualname__)")  # fmt: skip
    armed = _python(code, {"DSX_FAULT": "kind=slow_io,ms=1"})
    assert armed.returncode == 0, armed.stderr
    assert armed.stdout.split() == ["False", "Injector.patch_io.<locals>._pwrite"]  # nothing imported early
    plain = _python(code, {})
    assert plain.stdout.split() == ["False", "PosixBackend._pwrite"]


def test_a_leader_killed_inside_the_setup_leaves_a_segment_the_next_start_removes(tmp_path) -> None:
    code = (
        f"import torch; from dsx.direct import shm; shm.share_tensor(torch.arange(10.0), {str(tmp_path)!r})"
    )
    res = _python(code, {"DSX_FAULT": "kind=sigkill_setup,at=filled", "DSX_FAULT_LOG": str(tmp_path)})
    assert res.returncode == -9, res.stderr
    [left] = [p for p in tmp_path.iterdir() if p.name.startswith(shm.PREFIX)]
    assert left.stat().st_size == 40  # created and filled, never unlinked
    assert shm.sweep_stale(str(tmp_path)) == [left.name]


def test_sentinels_survive_the_next_start_while_their_owners_hold_them(tmp_path) -> None:
    """The harness's "other job" must look alive to the cleanup as a running dsx job does (a lock on its run
    record and segments), or every trial would count its removal as a leak; released, the same files go."""
    owners = Owners()
    try:
        dirs = Dirs.make(tmp_path, tmp_path / "shm", "t")
        planted = plant_sentinels(dirs, owners)
        old = time.time() - 3600  # past the grace an unlocked record gets, without waiting for it
        for p in [*dirs.ssd.glob("*/*"), *dirs.shm.iterdir()]:
            os.utime(p, (old, old))
        next_start(dirs)
        assert planted and not _touched(planted)
        owners.release()
        next_start(dirs)
        assert sorted(_touched(planted)) == sorted(planted)
    finally:
        owners.close()
