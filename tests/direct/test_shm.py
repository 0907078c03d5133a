"""Ownership of the shared segments: private, exclusive, locked while in use, removed only when proven dead."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsx.direct import shm
from dsx.runtime.process import is_locked, owner_tag, parse_owner_tag, pid_alive


def _name(tag: str, job: str = "0123abcd", uid: int | None = None) -> str:
    return f"{shm.PREFIX}u{os.getuid() if uid is None else uid}-{job}-{tag}-r0-feat"


def _dead_tag() -> str:
    """The owner tag of a process that has ended."""
    out = subprocess.run(
        [sys.executable, "-c", "from dsx.runtime.process import owner_tag; print(owner_tag())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.strip()


def test_a_segment_file_is_private_exclusive_and_locked_while_held(tmp_path) -> None:
    path, fd = shm._create(str(tmp_path / _name(owner_tag())))
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert is_locked(path)
        with pytest.raises(FileExistsError):  # a name someone else made is never reused
            shm._create(path)
    finally:
        os.close(fd)
    assert not is_locked(path)


def test_scan_proves_only_dead_creators_stale(tmp_path) -> None:
    mine = owner_tag()
    other_ns = parse_owner_tag(mine)
    elsewhere = mine.rsplit("-n", 1)[0] + "-n1"  # the same pid, but in another pid namespace
    assert other_ns is not None
    dead = tmp_path / _name(_dead_tag())
    live = tmp_path / _name(mine, job="live")
    foreign = tmp_path / _name(elsewhere, job="ns")
    other_user = tmp_path / _name(_dead_tag(), job="user", uid=os.getuid() + 12345)
    held_path, held_fd = shm._create(str(tmp_path / _name(_dead_tag(), job="held")))
    for p in (dead, live, foreign, other_user):
        p.write_bytes(b"x")
    unrelated = tmp_path / "unrelated"
    unrelated.write_bytes(b"x")
    try:
        found = {f.path.name: f for f in shm.scan_segments(str(tmp_path))}
        assert found[dead.name].stale and "has ended" in found[dead.name].reason
        assert not found[live.name].stale and "runs" in found[live.name].reason
        assert not found[foreign.name].stale and "another pid namespace" in found[foreign.name].reason
        assert not found[other_user.name].stale and "another user's" in found[other_user.name].reason
        assert not found[Path(held_path).name].stale and "in use" in found[Path(held_path).name].reason
        assert unrelated.name not in found
        assert shm.sweep_stale(str(tmp_path)) == [dead.name]
        assert sorted(os.listdir(tmp_path)) == sorted(
            [live.name, foreign.name, other_user.name, Path(held_path).name, unrelated.name]
        )
    finally:
        os.close(held_fd)


def _unshare() -> list[str]:
    exe = shutil.which("unshare")
    if exe is None or subprocess.run([exe, "--pid", "--fork", "--mount-proc", "true"]).returncode != 0:
        pytest.skip("cannot make a pid namespace here (unshare needs root)")
    return [exe, "--pid", "--fork", "--mount-proc", "--kill-child"]


def test_segments_made_in_another_pid_namespace_are_judged_by_their_lock(tmp_path) -> None:
    """As two containers sharing /dev/shm: the creator runs in its own pid namespace, under a pid that does
    not run here, so its pid tells nothing. While it holds its segment's lock the segment stays, however old;
    once the creator has ended (the lock went with it) the segment is stale."""
    ready = tmp_path / "ready"
    child = (
        "import os, sys, time\n"
        "from dsx.direct import shm\n"
        "from dsx.runtime.process import owner_tag\n"
        "name = f'{shm.PREFIX}u{os.getuid()}-feedbeef-{owner_tag()}-r0-feat'\n"
        f"path, fd = shm._create(os.path.join({str(tmp_path)!r}, name))  # created locked, as a leader does\n"
        f"open({str(ready)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    # a high pid inside the new namespace, which does not run in this one
    script = f'echo 99990 > /proc/sys/kernel/ns_last_pid 2>/dev/null; {sys.executable} -c "$0"'
    proc = subprocess.Popen([*_unshare(), "sh", "-c", script, child])
    try:
        deadline = time.time() + 30
        while not ready.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert ready.exists(), "the child did not create its segment"
        inner_pid = int(ready.read_text())
        (seg,) = [p for p in tmp_path.iterdir() if p.name.startswith(shm.PREFIX)]
        assert parse_owner_tag(seg.name)["pid"] == inner_pid and not pid_alive(
            inner_pid
        )  # (its pid: nothing)
        os.utime(seg, (time.time() - 3600,) * 2)  # old: only the lock can tell that it is in use
        assert shm.sweep_stale(str(tmp_path)) == [] and seg.exists()
        (finding,) = shm.scan_segments(str(tmp_path))
        assert "in use" in finding.reason
    finally:
        proc.kill()
        proc.wait()
    deadline = time.time() + 20  # (the namespace's processes go a moment after its first one)
    while is_locked(seg) and time.time() < deadline:
        time.sleep(0.05)
    # the creator is gone, and its lock with it: now proven stale, from this namespace
    assert shm.sweep_stale(str(tmp_path)) == [seg.name] and not seg.exists()


@pytest.mark.slow
def test_a_leader_whose_peer_node_failed_removes_its_segment(tmp_path) -> None:
    """Two launcher "nodes" of one rank each: node 0's leader makes its segment, node 1's fails. Both raise
    the same error, and node 0's segment (a whole feature table in shared memory) does not stay behind."""
    import json

    from tests.harness import REPO, launch_local_multinode

    out, shm_dir = tmp_path / "out", tmp_path / "shm"
    out.mkdir()
    shm_dir.mkdir()
    res = launch_local_multinode(2, REPO / "tests/direct/_shm_leaders_worker.py", [str(out), str(shm_dir)])
    res.check()
    errors = [json.loads((out / f"rank{r}.json").read_text())["error"] for r in range(2)]
    assert all(e and "rank 1 could not create the shared segment" in e for e in errors), errors
    assert list(shm_dir.iterdir()) == []
