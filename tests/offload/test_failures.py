"""Failure paths of activation offload: SSD full (real ENOSPC and quota), host pool full, crashed runs."""

from __future__ import annotations

import copy
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from dsx.config import ActivationOffloadConfig, SchedulerConfig
from dsx.offload import ActivationOffload
from dsx.offload.store import OWNER, RunDir, SsdFile, clean_stale_runs
from dsx.runtime.process import is_locked, owner_record, owner_tag, parse_owner_tag
from dsx.runtime.scheduler import Scheduler
from tests.offload._offload_models import OddModel


def _run(model, cfg, batches):
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(model, cfg, sched)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    grads = []
    try:
        for x in batches:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            off.end_step()
        history = list(sched.telemetry.history)
        demoted = set(off.mover.demoted)
    finally:
        off.close()
        sched.close()
    return grads, history, demoted


def _reference(model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    grads = []
    for x in batches:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


def _check_fallback(tmp_path, caplog, ssd_dir, capacity_gb, match):
    torch.manual_seed(3)
    ref = OddModel(layers=3)
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(4)
    batches = [torch.randn(16, 32, 48, generator=g) for _ in range(3)]  # ~200 KiB per saved tensor
    want = _reference(ref, batches)
    cfg = ActivationOffloadConfig(
        enabled=True,
        tiers=["host", "ssd"],
        ssd_path=str(ssd_dir),
        policy="offload_all",
        host_pool_gb=0.1,
        ssd_capacity_gb=capacity_gb,
        min_tensor_bytes=0,
        io_backend="posix",
        verify=True,
    )
    with caplog.at_level(logging.WARNING, logger="dsx.offload"):
        got, history, demoted = _run(model, cfg, batches)
    warnings = [r for r in caplog.records if "SSD" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert match in warnings[0].getMessage()
    assert demoted, "no layer fell back to the host tier"
    assert history[0].bytes_by_tier.get("ssd", 0) > 0, "the SSD was never written before it filled up"
    for gw, gg in zip(want, got):
        for a, b in zip(gw, gg):
            assert torch.isfinite(a).all() and torch.equal(a, b)


def test_ssd_quota_falls_back_to_host(tmp_path, caplog):
    (tmp_path / "ssd").mkdir()
    _check_fallback(tmp_path, caplog, tmp_path / "ssd", capacity_gb=1.5 / 1024, match="quota")


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(
            f"cannot mount a 1 MiB tmpfs to produce a real ENOSPC: {r.stderr.strip() or r.returncode}"
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_enospc_falls_back_to_host(tmp_path, caplog, small_tmpfs):
    _check_fallback(tmp_path, caplog, small_tmpfs, capacity_gb=1.0, match="No space left on device")


def test_host_pool_full_keeps_on_device(tmp_path, caplog):
    torch.manual_seed(5)
    ref = OddModel(layers=3)
    model = copy.deepcopy(ref)
    batches = [torch.randn(16, 32, 48) for _ in range(2)]
    want = _reference(ref, batches)
    cfg = ActivationOffloadConfig(
        enabled=True,
        tiers=["host"],
        policy="offload_all",
        host_pool_gb=1 / 1024,
        min_tensor_bytes=0,
        io_backend="posix",
    )
    with caplog.at_level(logging.WARNING, logger="dsx.offload"):
        got, history, _ = _run(model, cfg, batches)
    assert len([r for r in caplog.records if "host pool full" in r.getMessage()]) == 1
    assert history[0].bytes_by_tier.get("host", 0) > 0
    for gw, gg in zip(want, got):
        for a, b in zip(gw, gg):
            assert torch.isfinite(a).all() and torch.equal(a, b)


def test_run_dir_is_private_and_removed(tmp_path):
    d = RunDir(str(tmp_path), rank=3)
    assert os.stat(d.path).st_mode & 0o777 == 0o700
    assert os.path.basename(d.path).startswith(f"dsx-u{os.getuid()}-")  # named per user
    owner = os.path.join(d.path, OWNER)
    assert os.stat(owner).st_mode & 0o777 == 0o600 and is_locked(owner)  # held while the run lives
    ssd = SsdFile(d, 1 << 20, "posix")
    assert os.stat(ssd.path).st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):  # created exclusively: never a file someone else put there
        SsdFile(d, 1 << 20, "posix")
    ssd.close()
    d.remove()
    assert not os.path.exists(d.path)


def test_stale_runs_are_judged_only_where_their_owner_can_be(tmp_path):
    """A shared ssd_path: run dirs of other machines or other containers' pid namespaces stay, whatever their
    pid means here; dead owners, owners from before this machine rebooted and reused pids go; a run whose
    owner record is locked (its owner runs, in whatever namespace) stays; another user's is not looked at."""
    me = owner_record()
    dead = 2**22 + 12345  # above pid_max's default: no such process
    owners = {
        "dead": dict(me, pid=dead),
        "reused-pid": dict(me, start=(me["start"] or 0) + 1),  # this pid, started at another time
        "rebooted": dict(me, pid=dead, boot="an earlier boot"),
        "other-machine": dict(me, pid=dead, boot="another boot", host="another-host"),
        "other-container": dict(me, pid=dead, pidns="pid:[1]"),
        "locked": dict(me, pid=dead),  # a dead pid, but its owner record is held: in use
        "live": me,
    }
    prefix = f"dsx-u{os.getuid()}-"
    for name, rec in owners.items():
        os.mkdir(tmp_path / f"{prefix}{name}")
        (tmp_path / f"{prefix}{name}" / OWNER).write_text(json.dumps(rec))
    other_user = tmp_path / f"dsx-u{os.getuid() + 1}-dead"
    other_user.mkdir()
    (other_user / OWNER).write_text(json.dumps(owners["dead"]))
    holder = os.open(tmp_path / f"{prefix}locked" / OWNER, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)
    try:
        removed = sorted(os.path.basename(d) for d in clean_stale_runs(str(tmp_path)))
    finally:
        os.close(holder)
    # where /proc does not tell a start time, a boot id or a pid namespace, the pid alone decides
    want = ["dead", "rebooted"] + (["reused-pid"] if me["start"] is not None else [])
    want += [] if me["boot"] else ["other-machine"]
    want += [] if me["pidns"] else ["other-container"]
    assert removed == sorted(f"{prefix}{n}" for n in want)
    assert sorted(os.listdir(tmp_path)) == sorted(
        {f"{prefix}{n}" for n in owners if n not in want} | {other_user.name}
    )


def test_a_run_dir_killed_before_its_owner_record_is_judged_by_its_name(tmp_path):
    """A rank killed between making its run directory and writing its owner record (or half way through the
    write) leaves a directory whose record is missing or empty: its name says who made it, so the next start
    removes it once that process is proven ended, and keeps a live one's."""
    made = RunDir(str(tmp_path / "probe"), rank=0)
    assert parse_owner_tag(os.path.basename(made.path))["pid"] == os.getpid()
    made.remove()
    dead_tag = subprocess.run(
        [sys.executable, "-c", "from dsx.runtime.process import owner_tag; print(owner_tag())"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    prefix = f"dsx-u{os.getuid()}-"
    no_record = tmp_path / f"{prefix}{dead_tag}-r0-0badc0de"
    half_record = tmp_path / f"{prefix}{dead_tag}-r1-0badc0df"
    live = tmp_path / f"{prefix}{owner_tag()}-r2-0badc0e0"
    for d in (no_record, half_record, live):
        d.mkdir()
    (half_record / OWNER).write_text('{"pid": ')
    removed = sorted(os.path.basename(d) for d in clean_stale_runs(str(tmp_path)))
    assert removed == [no_record.name, half_record.name]
    assert live.is_dir()


@pytest.mark.slow
def test_sigkilled_rank_leftovers_removed_at_next_start(tmp_path):
    root = tmp_path / "ssd"
    root.mkdir()
    script = textwrap.dedent(f"""
        import sys, time, torch
        from dsx.config import ActivationOffloadConfig
        from dsx.offload import ActivationOffload
        from dsx.runtime.scheduler import Scheduler
        from tests.offload._offload_models import OddModel
        m = OddModel(layers=2)
        cfg = ActivationOffloadConfig(enabled=True, tiers=["ssd"], ssd_path={str(root)!r}, policy="offload_all",
                                      host_pool_gb=0.05, ssd_capacity_gb=0.05, min_tensor_bytes=0,
                                      io_backend="posix")
        off = ActivationOffload(m, cfg, Scheduler())
        y = m(torch.randn(4, 6, 48))   # mid-step: activations written, backward not run
        off.mover.drain()
        print(off.run_dir.path, flush=True)
        time.sleep(120)
    """)
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        run_dir = p.stdout.readline().strip()
        assert run_dir and os.path.getsize(os.path.join(run_dir, "activations.bin")) > 0
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert os.path.isdir(run_dir), "SIGKILL ran no cleanup, the leftover must still be there"
    fresh = RunDir(str(root), rank=0)
    try:
        assert not os.path.exists(run_dir)
        assert os.listdir(root) == [os.path.basename(fresh.path)]
    finally:
        fresh.remove()


def test_an_unlocked_old_run_from_another_container_on_this_machine_is_stale(tmp_path):
    """A live run holds a lock on its owner record, and the kernel shows that lock in every pid namespace: a
    record of this machine's boot, from another container, unlocked and older than the grace period has no
    owner. The same from another machine (another boot) cannot be judged by a lock here and stays; so does a
    malformed record."""
    me = owner_record()
    if not me["boot"]:
        pytest.skip("no boot id here")
    prefix = f"dsx-u{os.getuid()}-"
    hour_ago = time.time() - 3600
    cases = {
        "other-container-dead": dict(me, pidns="pid:[1]"),
        "other-machine": dict(me, boot="another boot", host="another-host", pidns="pid:[1]"),
        "no-pid": {"boot": me["boot"]},
    }
    for name, rec in cases.items():
        d = tmp_path / f"{prefix}{name}"
        d.mkdir()
        (d / OWNER).write_text(json.dumps(rec))
        os.utime(d / OWNER, (hour_ago, hour_ago))
    removed = sorted(os.path.basename(d) for d in clean_stale_runs(str(tmp_path)))
    assert removed == [f"{prefix}other-container-dead"]
