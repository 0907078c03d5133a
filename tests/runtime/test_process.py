"""dsx.runtime.process: a launched CPU job leaves no DeepSpeed shared-memory buffer behind; an exchange that
loses a rank says so."""

from __future__ import annotations

import json
import re

import pytest

from tests.faults.trials import CLEAR
from tests.harness import REPO, launch, remove_shm_buffers, shm_buffers

# the fault harness's pattern for a rank lost to a signal, which this message must meet
CLEAR_KILLED = re.compile(CLEAR["sigkill_setup"][-1])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exit", "engine"])
def test_launched_job_leaves_no_deepspeed_shm_buffer(mode: str, tmp_path) -> None:
    """DeepSpeed's CPU backend creates /dev/shm/deepspeed_allreduce_buffer_* (66 MiB a rank) and never
    unlinks it: without dsx's release, every launched test left them, and CI machines ran out of memory."""
    res = launch(REPO / "tests/runtime/_shm_worker.py", [str(tmp_path), mode], 2, clean_shm=False)
    try:
        res.check()
        seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        if not all(s["existed"] for s in seen):
            pytest.skip(f"DeepSpeed created no shared-memory all-reduce buffer here: {seen}")
        assert all(str(res.port) in s["path"] for s in seen), seen
        assert shm_buffers(res.port) == [], "the job's all-reduce buffers are still in /dev/shm"
    finally:
        remove_shm_buffers(res.port)


def test_clean_shm_lists_then_removes_only_stale_buffers(capsys) -> None:
    """Real files in /dev/shm: an old buffer nobody maps or holds is stale; a mapped one, one a dsx job holds
    (a lock, seen from any container) and a young one are kept, each with its reason."""
    import fcntl
    import mmap
    import os
    import time

    from dsx.cli import main
    from dsx.runtime.process import SHM_DIR, stale_deepspeed_shm_buffers

    if not SHM_DIR.is_dir():
        pytest.skip("no /dev/shm on this machine")
    tag = f"deepspeed_allreduce_buffer_{os.getuid()}_test.invalid_{os.getpid()}"
    old, mapped, young, held = (SHM_DIR / f"{tag}_{r}" for r in range(4))
    for p in (old, mapped, young, held):
        p.write_bytes(os.urandom(8192))
    hour_ago = time.time() - 3600
    for p in (old, mapped, held):
        os.utime(p, (hour_ago, hour_ago))
    holder = os.open(held, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)  # as hold_deepspeed_shm does in a dsx job
    try:
        with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 8192) as m:
            stale = stale_deepspeed_shm_buffers()
            assert old in stale and mapped not in stale and young not in stale and held not in stale, stale
            assert m[:8] == mapped.read_bytes()[:8]
            assert main(["clean-shm"]) == 0  # lists only
            out = capsys.readouterr().out
            assert all(p.exists() for p in (old, mapped, young, held))
            assert f"stale    {old}: no running process maps or holds it" in out
            assert f"kept     {mapped}: mapped by running process {os.getpid()}" in out
            assert f"kept     {held}: held by a running dsx job" in out
            assert f"kept     {young}: younger than 60 s" in out and "run with --remove" in out
            assert main(["clean-shm", "--remove"]) == 0
            assert not old.exists() and mapped.exists() and young.exists() and held.exists()
            assert f"removed  {old}" in capsys.readouterr().out
    finally:
        os.close(holder)
        for p in (old, mapped, young, held):
            p.unlink(missing_ok=True)


def test_from_a_containers_pid_namespace_an_unmapped_buffer_is_kept() -> None:
    """Run from a pid namespace other than the machine's first, /proc hides other containers' processes: a
    buffer no visible process maps could be another container's, so clean-shm keeps it and says why."""
    import os
    import shutil
    import subprocess
    import sys
    import time

    from dsx.runtime.process import SHM_DIR, sees_every_process

    unshare = shutil.which("unshare")
    if not SHM_DIR.is_dir() or unshare is None or not sees_every_process():
        pytest.skip("needs /dev/shm, unshare and the initial pid namespace")
    if subprocess.run([unshare, "--pid", "--fork", "--mount-proc", "true"]).returncode != 0:
        pytest.skip("cannot make a pid namespace here (unshare needs root)")
    old = SHM_DIR / f"deepspeed_allreduce_buffer_{os.getuid()}_test.invalid_{os.getpid()}_ns"
    old.write_bytes(os.urandom(4096))
    os.utime(old, (time.time() - 3600,) * 2)
    try:
        r = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", sys.executable, "-m", "dsx.cli",
                            "clean-shm", "--remove"], capture_output=True, text=True, timeout=120)  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        assert old.exists() and f"kept     {old}: " in r.stdout and "container's pid namespace" in r.stdout
    finally:
        old.unlink(missing_ok=True)


@pytest.mark.slow
def test_an_exchange_with_a_killed_rank_names_the_other_rank(tmp_path) -> None:
    """A rank SIGKILLed during setup: the survivor's gloo error ("Connection reset by peer") can reach the
    launcher first, and alone it does not say that the cause is another rank. dsx's exchange says so."""
    res = launch(REPO / "tests/runtime/_peer_lost_worker.py", [str(tmp_path)], 2, timeout=180)
    assert res.returncode != 0, res.output[-2000:]
    got = json.loads((tmp_path / "rank0.json").read_text())
    assert got["type"] == "PeerLostError", got
    assert got["message"].startswith(
        "dsx: the test's exchange failed on rank 0 of 2: another rank has ended or lost its connection"
    ), got
    assert "The backend said: " in got["message"], got
    assert CLEAR_KILLED.search(got["message"]), got


def test_only_the_backends_failures_become_a_lost_peer() -> None:
    """A rank's own error inside an exchange (out of memory, a bad object) is not blamed on another rank."""
    import torch

    from dsx.runtime.process import PeerLostError, collective

    for own in (
        torch.OutOfMemoryError("CUDA out of memory"),
        RuntimeError("shape mismatch"),
        ValueError("x"),
    ):
        with pytest.raises(type(own)) as got, collective("an exchange"):
            raise own
        assert got.value is own
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"
    )
    with pytest.raises(
        PeerLostError, match=r"^dsx: an exchange failed( on rank \d+ of \d+)?: another rank has ended"
    ) as got:
        with collective("an exchange"):
            raise gloo
    assert got.value.__cause__ is gloo and "Connection reset by peer" in str(got.value)
