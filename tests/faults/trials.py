"""The fault harness's parts: the two jobs and their clean baselines, the sentinel "other job", one trial, and
the classification of its end. ``python -m tests.faults`` draws the trials and tallies them.

A trial launches a job through the deepspeed launcher (2 CPU ranks, gloo) with ``DSX_FAULT`` set, the
injector loaded into each rank by ``site/sitecustomize.py`` (:mod:`dsx.testing.faults`); a ``sigkill`` trial's
kill comes from here. Its end is classified as one of :data:`OUTCOMES`:

``equal``        exit 0, the final-parameter digest and every per-step loss bitwise equal to the clean run's
``clear_error``  a non-zero exit whose output names the cause (:data:`CLEAR`, per fault kind)
``unclear``      a non-zero exit that does not (a raw unrelated traceback)
``wrong``        exit 0 but the digest or a loss differs (or the job wrote no results)
``leak``         after the "next start" (the cleanup a new job runs first) a file, run directory or segment
                 of the trial is left in the SSD, nvme or shared-memory directory, or the sentinel of another
                 job in those directories was removed or changed, or ``dsx clean-shm`` would keep a DeepSpeed
                 all-reduce buffer the ended job left
``hang``         the job outlived the trial's timeout (then killed)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsx.runtime.process import scan_deepspeed_shm
from dsx.testing.faults import ENV, LOG_ENV, FaultSpec
from tests.harness import REPO, free_port, launcher_env, shm_buffers

__all__ = [
    "ALLOWED",
    "CLEAR",
    "JOBS",
    "OUTCOMES",
    "Baseline",
    "Dirs",
    "Job",
    "Kill",
    "Owners",
    "Run",
    "Trial",
    "baseline",
    "classify",
    "run_job",
    "run_trial",
]

SITE = Path(__file__).resolve().parent / "site"
OUTCOMES = ("equal", "clear_error", "unclear", "wrong", "leak", "hang")

# What a clear error looks like, per fault kind: dsx's own message naming the file and offset, the checksum
# failure naming layer, tier, file and offset, the shared-memory error naming the directory and errno, and the
# launcher's report of a rank killed by a signal.
# (When the survivor's own failure reaches the launcher first, the launcher reports that one: gloo's error
# saying the peer is gone names the cause then, and in dsx's own exchanges dsx's error says so for it; gloo
# words a peer gone mid-read "Connection reset by peer ... a remote worker hanging", which does not.)
_KILLED = [
    r"exits with return code = -9",
    r"Connection closed by peer \S+\. This is typically caused by a remote worker crashing",
    r"dsx: [^\n]+ failed on rank \d+ of \d+: another rank has ended or lost its connection",
]
CLEAR: dict[str, list[str]] = {
    "io_error": [r"dsx posix (?:read|write) failed: Input/output error \(path=\S+, offset=\d+, size=\d+\)"],
    "short_read": [
        r"dsx posix read failed: Input/output error \(path=\S+, offset=\d+, size=\d+\)",
        r"dsx posix short read: \d+ of \d+ bytes \(path=\S+, offset=\d+\)",
    ],
    "enospc": [r"dsx posix write failed: No space left on device \(path=\S+, offset=\d+, size=\d+\)"],
    "slow_io": [],
    "corrupt": [
        r"OffloadIntegrityError: dsx activation offload: checksum mismatch reading back layer \d+ tensor "
        r"[^\n]+? \(\d+ bytes\) from the ssd tier \(\S+ offset \d+\)"
    ],
    "sigkill": _KILLED,
    "shm_enospc": [
        r"SharedMemoryError: rank \d+ could not create the shared segment: SharedMemoryError: shared memory "
        r"directory \S+ has [^\n]* GiB free[^\n]*No space left on device"
    ],
    "sigkill_setup": _KILLED,
}
# The outcomes each kind may end in once its fault fired (a fault that never fired may only end ``equal``).
ALLOWED: dict[str, frozenset[str]] = {
    "io_error": frozenset({"clear_error"}),
    "short_read": frozenset({"equal", "clear_error"}),  # dsx retries a short count; 0 bytes is end of file
    "enospc": frozenset({"equal"}),  # the layer falls back to the host tier and training goes on
    "slow_io": frozenset({"equal"}),
    "corrupt": frozenset({"clear_error"}),  # verify is on for the SSD tier by default
    "sigkill": frozenset({"clear_error"}),
    "shm_enospc": frozenset({"clear_error"}),
    "sigkill_setup": frozenset({"clear_error"}),
}


# ------------------------------------------------------------------------------------------------ jobs
@dataclass(frozen=True)
class Job:
    """One job the harness runs: the script, its arguments, and the fault kinds tried on it."""

    name: str
    script: str
    args: tuple[str, ...]
    kinds: tuple[str, ...]

    def config(self, dirs: Dirs, offload: dict[str, Any] | None = None) -> dict[str, Any]:
        """The DeepSpeed config of one run in ``dirs`` (``offload``: changes to the activation_offload section)."""
        if self.name == "gpt":
            section = {
                "enabled": True, "tiers": ["host", "ssd"], "ssd_path": str(dirs.ssd), "policy": "offload_all",
                "io_backend": "posix", "host_pool_gb": 8 / 1024, "min_tensor_bytes": 4096, **(offload or {}),
            }  # fmt: skip
            return {
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 1,
                "gradient_clipping": 1.0,
                "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "betas": [0.9, 0.95], "weight_decay": 0.01}},
                # stage 2 keeps nvme-offloaded optimizer state in host memory (no libaio needed), under nvme_path
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(dirs.nvme)}},
                "steps_per_print": 1000000,
                "dsx": {"activation_offload": section, "scheduler": {"bandwidth_probe_mb": 1}},
            }  # fmt: skip
        return {
            "train_micro_batch_size_per_gpu": 64,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 0.003, "torch_adam": True}},
            "zero_optimization": {"stage": 0},
            "steps_per_print": 1000000,
            "dsx": {"unified": {"enabled": True, "shared": "on", "shared_memory_dir": str(dirs.shm),
                                "prefetch_batches": 1}},
        }  # fmt: skip


JOBS: dict[str, Job] = {
    "gpt": Job(
        "gpt",
        "examples/gpt/train.py",
        tuple(
            "--layers 2 --hidden 64 --heads 2 --seq-len 64 --steps 6 --loader torch --no-progress --seed 7".split()
        ),
        ("io_error", "short_read", "enospc", "slow_io", "corrupt", "sigkill"),
    ),
    "sage": Job(
        "sage",
        "examples/gnn/train_sage.py",
        tuple(
            "--nodes 2000 --edges 20000 --features 16 --hidden 32 --fanouts 5,5 --epochs 1 --max-batches 4 "
            "--no-progress --seed 3".split()
        ),
        ("shm_enospc", "sigkill_setup", "sigkill"),
    ),
}


@dataclass
class Dirs:
    """One run's directories: SSD tier, nvme_path, shared memory (under /dev/shm), fault logs, job output."""

    root: Path
    shm: Path

    @classmethod
    def make(cls, work: Path, shm_work: Path, name: str) -> Dirs:
        d = cls(work / name, shm_work / name)
        for p in (d.ssd, d.nvme, d.shm, d.faults):
            p.mkdir(parents=True, exist_ok=True)
        return d

    @property
    def ssd(self) -> Path:
        return self.root / "ssd"

    @property
    def nvme(self) -> Path:
        return self.root / "nvme"

    @property
    def faults(self) -> Path:
        return self.root / "faults"

    @property
    def log(self) -> Path:
        return self.root / "log.json"

    @property
    def output(self) -> Path:
        return self.root / "output.txt"

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)


# ------------------------------------------------------------------------------------- another job
# A stand-in rank of another job: prints its owner record and tag, then, as a live dsx rank does, holds a lock
# on each path it is sent (a run directory's owner record, a segment) until an empty line lets them go.
_HELPER = """
import fcntl, json, os, sys
from dsx.runtime.process import owner_record, owner_tag
print(json.dumps([owner_record(), owner_tag()]), flush=True)
held = []
for line in sys.stdin:
    reply = "ok"
    if line.strip():
        try:
            held.append(os.open(line.strip(), os.O_RDONLY))
            fcntl.flock(held[-1], fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            reply = repr(exc)
    else:
        for fd in held:
            os.close(fd)
        held.clear()
    print(reply, flush=True)
"""


class Owners:
    """Live processes standing for another job's ranks: one here, and one in another pid namespace (a
    container sharing the drive and /dev/shm) when ``unshare`` works. Their records name the sentinels."""

    def __init__(self) -> None:
        self._procs: dict[str, subprocess.Popen[str]] = {}
        self.records: dict[str, tuple[dict[str, Any], str]] = {}
        self.notes: list[str] = []
        env = launcher_env()
        self._start("here", [sys.executable, "-c", _HELPER], env)
        user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        if shutil.which("unshare"):
            self._start(
                "other_pidns", ["unshare", *user, "--pid", "--fork", sys.executable, "-c", _HELPER], env
            )
        if "other_pidns" not in self.records:
            self.notes.append("unshare unavailable: no sentinel owned from another pid namespace")

    def _start(self, label: str, cmd: list[str], env: dict[str, str]) -> None:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)  # fmt: skip
        line = proc.stdout.readline() if proc.stdout else ""
        if not line:
            proc.kill()
            proc.wait()
            return
        record, tag = json.loads(line)
        self._procs[label] = proc
        self.records[label] = (record, tag)

    def _say(self, label: str, line: str) -> None:
        proc = self._procs[label]
        proc.stdin.write(line + "\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        reply = (proc.stdout.readline() if proc.stdout else "").strip()
        if reply != "ok":
            raise RuntimeError(f"sentinel owner {label!r} could not lock {line!r}: {reply or 'it has ended'}")

    def hold(self, label: str, paths: list[Path]) -> None:
        """Owner ``label`` locks ``paths`` as a live rank locks its run directory's record and segments."""
        for path in paths:
            self._say(label, str(path))

    def release(self) -> None:
        """Every owner still running lets its locks go (the trial's directories are about to be removed)."""
        for label, proc in self._procs.items():
            if proc.poll() is None:
                with contextlib.suppress(OSError, RuntimeError):
                    self._say(label, "")

    def close(self) -> None:
        for proc in self._procs.values():
            with contextlib.suppress(OSError):
                proc.stdin.close()  # type: ignore[union-attr]  # its loop over stdin ends: it exits
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        h.update(str(f.relative_to(path.parent)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def plant_sentinels(dirs: Dirs, owners: Owners) -> dict[str, str]:
    """Another job's data in the trial's directories, owned by live processes that hold them locked as a
    running dsx rank does: a run directory in the SSD path and a segment in the shared-memory directory per
    owner. Path -> digest of its contents."""
    from dsx.direct.shm import _user_prefix
    from dsx.offload.store import OWNER, _prefix

    planted = {}
    for label, (record, tag) in owners.records.items():
        # named as dsx names its own, so that the next start's cleanup judges them
        run = dirs.ssd / f"{_prefix()}{record['pid']}-r0-sentinel{label.replace('_', '')}"
        run.mkdir(mode=0o700)
        (run / OWNER).write_text(json.dumps(record))
        (run / "activations.bin").write_bytes(os.urandom(8192))
        seg = dirs.shm / f"{_user_prefix()}{'f' * 16}-{tag}-r0-sentinel{label.replace('_', '')}"
        seg.write_bytes(os.urandom(4096))
        seg.chmod(0o600)
        owners.hold(label, [run / OWNER, seg])
        for p in (run, seg):
            planted[str(p)] = _digest(p)
    return planted


def _touched(planted: dict[str, str]) -> list[str]:
    return [p for p, d in planted.items() if not Path(p).exists() or _digest(Path(p)) != d]


def next_start(dirs: Dirs) -> dict[str, list[str]]:
    """What a new job does first on the same directories: remove the run directories and segments whose
    owners are proven dead (the SSD tier's and the shared-memory setup's own cleanup)."""
    from dsx.direct.shm import sweep_stale
    from dsx.offload.store import clean_stale_runs

    return {"ssd": clean_stale_runs(str(dirs.ssd)), "shm": sweep_stale(str(dirs.shm))}


def leftovers(dirs: Dirs, planted: dict[str, str]) -> list[str]:
    """Anything of the trial left in its directories: every entry of the SSD and shared-memory directories
    but the sentinels (only dsx writes there), and dsx's entries in nvme_path (DeepSpeed's are its own)."""
    keep = set(planted)
    out = [str(p) for d in (dirs.ssd, dirs.shm) for p in sorted(d.iterdir()) if str(p) not in keep]
    return out + [str(p) for p in sorted(dirs.nvme.rglob("dsx*"))]


# ------------------------------------------------------------------------------------------ one run
@dataclass
class Kill:
    """The harness's SIGKILL of one rank: ``delay`` seconds after the anchor (``launch``, or ``dsx``: the
    first file dsx makes in the trial's directories)."""

    rank: int
    anchor: str
    delay: float
    pid: int | None = None
    at_s: float | None = None  # when it was sent (seconds after launch); -1: the rank had ended first

    def evidence(self) -> dict[str, Any]:
        return {"rank": self.rank, "anchor": self.anchor, "delay_s": round(self.delay, 3), "pid": self.pid,
                "sent_at_s": None if self.at_s is None else round(self.at_s, 3)}  # fmt: skip


@dataclass
class Run:
    """What one launch left: exit status, output, the rank-0 log, the fault records, timings."""

    rc: int | None
    timed_out: bool
    wall_s: float
    output: str
    log: dict[str, Any] | None
    port: int
    records: list[dict[str, Any]]
    dsx_seen_s: float | None  # when the first dsx file appeared (seconds after launch)
    ranks_end_s: float | None  # when the last rank ended (seconds after launch)
    deepspeed_buffers_left: int = 0
    deepspeed_buffers_kept: list[str] = field(default_factory=list)  # of those, the ones clean-shm would keep

    def injected(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("event") == "injected"]

    def counts(self) -> dict[int, dict[str, int]]:
        """Per rank, the operations its injector counted (from the exit records)."""
        return {
            r["rank"]: r["counts"]
            for r in self.records
            if r.get("event") == "exit" and r.get("rank") is not None
        }


def _rank_pids(session: int, script: str) -> dict[int, int]:
    """Local rank -> pid of the launched ranks of the job in ``session`` found so far (their command lines)."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            args = Path(entry.path, "cmdline").read_bytes().split(b"\0")
            if os.getsid(int(entry.name)) != session:
                continue
        except OSError:
            continue
        if any(a.endswith(script.encode()) for a in args):
            for a in args:
                if a.startswith(b"--local_rank="):
                    found[int(a.split(b"=")[1])] = int(entry.name)
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (not gone, not a zombie waiting for its parent)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _dsx_active(dirs: Dirs, planted: dict[str, str]) -> bool:
    try:
        names = [str(p) for d in (dirs.ssd, dirs.shm) for p in d.iterdir()]
    except OSError:
        return False
    return any(n not in planted for n in names)


def _records(dirs: Dirs) -> list[dict[str, Any]]:
    out = []
    for f in sorted(dirs.faults.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def run_job(
    job: Job,
    dirs: Dirs,
    spec: FaultSpec,
    timeout: float,
    kill: Kill | None = None,
    planted: dict[str, str] | None = None,
    offload: dict[str, Any] | None = None,
) -> Run:
    """Launch ``job`` in ``dirs`` with ``spec`` injected (and ``kill`` sent from here); its :class:`Run`."""
    planted = planted or {}
    cfg = dirs.root / "config.json"
    cfg.write_text(json.dumps(job.config(dirs, offload)))
    port = free_port()
    env = launcher_env(
        {ENV: str(spec), LOG_ENV: str(dirs.faults), "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    )
    env["PYTHONPATH"] = f"{SITE}{os.pathsep}{env['PYTHONPATH']}"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_accelerators", "2", "--master_port", str(port),
           job.script, "--deepspeed_config", str(cfg), "--log-json", str(dirs.log), *job.args]  # fmt: skip
    dirs.log.unlink(missing_ok=True)
    t0 = time.monotonic()
    timed_out, dsx_seen, ranks_end = False, None, None
    pids: dict[int, int] = {}
    with open(dirs.output, "w") as out:
        # its own session: on a timeout the whole tree goes, not only the launcher
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while proc.poll() is None:
                now = time.monotonic() - t0
                if now > timeout:
                    timed_out = True
                    break
                if dsx_seen is None and _dsx_active(dirs, planted):
                    dsx_seen = now
                if len(pids) < 2:
                    pids.update(_rank_pids(proc.pid, job.script))
                elif ranks_end is None and not any(_running(p) for p in pids.values()):
                    ranks_end = now
                if kill is not None and kill.at_s is None:
                    _kill_step(kill, pids, now, dsx_seen)
                time.sleep(0.05)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # survivors of a failed job (and everything on a timeout)
            proc.wait()
    wall = time.monotonic() - t0
    # DeepSpeed's CPU all-reduce buffers a killed rank leaves: ``dsx clean-shm`` must judge them stale now
    left = shm_buffers(port)
    stale = {str(f.path) for f in scan_deepspeed_shm(min_age_s=0.0) if f.stale}
    kept = [str(p) for p in left if str(p) not in stale]
    for p in left:
        p.unlink(missing_ok=True)
    log = None
    if dirs.log.exists():
        with contextlib.suppress(ValueError):
            log = json.loads(dirs.log.read_text())
    return Run(
        rc=None if timed_out else proc.returncode, timed_out=timed_out, wall_s=wall,
        output=dirs.output.read_text(errors="replace"), log=log, port=port, records=_records(dirs),
        dsx_seen_s=dsx_seen, ranks_end_s=ranks_end, deepspeed_buffers_left=len(left), deepspeed_buffers_kept=kept,
    )  # fmt: skip


def _kill_step(kill: Kill, pids: dict[int, int], now: float, dsx_seen: float | None) -> None:
    kill.pid = pids.get(kill.rank)
    anchor = 0.0 if kill.anchor == "launch" else dsx_seen
    if kill.pid is None or anchor is None or now < anchor + kill.delay:
        return
    if not _running(kill.pid):  # the rank has ended already: a kill now would change nothing
        kill.at_s = -1.0
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(kill.pid, signal.SIGKILL)
        kill.at_s = now


# ------------------------------------------------------------------------------------ baseline, trial
def _losses(log: dict[str, Any]) -> list[float]:
    return list(log.get("losses") or [])  # both jobs log every step's loss (rank 0's)


def _summary(log: dict[str, Any]) -> dict[str, Any]:
    return log.get("summary", log)  # the GPT job nests its summary, the SAGE job writes it alone


@dataclass
class Baseline:
    """A clean run of one job: its losses and digest, the I/O each rank did, its timings."""

    job: str
    losses: list[float]
    digest: str
    counts: dict[int, dict[str, int]]
    wall_s: float
    dsx_seen_s: float | None
    ranks_end_s: float
    ssd_bytes_written: int | None

    def evidence(self) -> dict[str, Any]:
        return {"job": self.job, "steps": len(self.losses), "digest": self.digest, "counts": self.counts,
                "wall_s": round(self.wall_s, 2), "dsx_seen_s": self.dsx_seen_s, "ranks_end_s": self.ranks_end_s,
                "ssd_bytes_written_rank0": self.ssd_bytes_written}  # fmt: skip


def baseline(job: Job, work: Path, shm_work: Path, timeout: float, repeats: int = 1) -> Baseline:
    """Run ``job`` clean ``repeats`` times (the injector only counts); every run must agree bitwise."""
    runs = []
    for i in range(repeats):
        dirs = Dirs.make(work, shm_work, f"{job.name}-clean{i}")
        try:
            run = run_job(job, dirs, FaultSpec("none"), timeout)
        finally:
            dirs.remove()
        if run.rc != 0 or run.log is None:
            tail = "\n".join(run.output.splitlines()[-40:])
            raise RuntimeError(f"the clean {job.name} run failed (exit {run.rc}):\n{tail}")
        runs.append(run)
    first = runs[0]
    assert first.log is not None
    summary = _summary(first.log)
    # the timings a kill is drawn from: the fastest run's (a trial may run as fast), both from that one run
    fast = min(runs, key=lambda r: r.ranks_end_s or r.wall_s)
    out = Baseline(job.name, _losses(first.log), summary["param_digest"], first.counts(),
                   max(r.wall_s for r in runs), fast.dsx_seen_s, fast.ranks_end_s or fast.wall_s,
                   summary.get("dsx_ssd_bytes_written"))  # fmt: skip
    for r in runs[1:]:
        assert r.log is not None
        if _losses(r.log) != out.losses or _summary(r.log)["param_digest"] != out.digest:
            raise RuntimeError(f"two clean {job.name} runs differ: the job is not bitwise reproducible here")
    if job.name == "gpt" and not out.ssd_bytes_written:
        raise RuntimeError("the clean gpt run wrote nothing to the SSD tier: the trials would not test it")
    return out


@dataclass
class Trial:
    """One trial's record in the harness's JSON."""

    index: int
    job: str
    fault: str
    params: dict[str, Any]
    outcome: str = ""
    allowed: bool = False
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "job": self.job, "fault": self.fault, "params": self.params,
                "outcome": self.outcome, "allowed": self.allowed, "evidence": self.evidence}  # fmt: skip


def _clear_match(kind: str, output: str) -> str | None:
    for pattern in CLEAR.get(kind, []):
        m = re.search(pattern, output)
        if m:
            return m.group(0)
    return None


def classify(
    kind: str, run: Run, base: Baseline, job: Job, left: list[str], touched: list[str]
) -> tuple[str, dict[str, Any]]:
    """The outcome of one run (:data:`OUTCOMES`) and what it was judged on."""
    ev: dict[str, Any] = {
        "rc": run.rc,
        "wall_s": round(run.wall_s, 2),
        "leftovers": left,
        "sentinels_touched": touched,
    }
    if run.timed_out:
        return "hang", ev
    if left or touched:
        return "leak", ev
    if run.rc == 0:
        if run.log is None:
            ev["why"] = "exit 0 without the job's results"
            return "wrong", ev
        losses, digest = _losses(run.log), _summary(run.log).get("param_digest")
        ev["digest_equal"] = digest == base.digest
        ev["losses_equal"] = losses == base.losses
        if not (ev["digest_equal"] and ev["losses_equal"]):
            ev["losses"] = losses
            return "wrong", ev
        return "equal", ev
    matched = _clear_match(kind, run.output)
    if matched:
        ev["cause"] = matched
        return "clear_error", ev
    ev["output_tail"] = run.output.splitlines()[-25:]
    return "unclear", ev


def run_trial(
    trial: Trial,
    job: Job,
    base: Baseline,
    owners: Owners,
    work: Path,
    shm_work: Path,
    timeout: float,
    offload: dict[str, Any] | None = None,
    keep: bool = False,
) -> Trial:
    """Plant the other job's sentinels, run the fault, run the next start's cleanup, classify."""
    dirs = Dirs.make(work, shm_work, f"t{trial.index:04d}-{job.name}-{trial.fault}")
    try:
        planted = plant_sentinels(dirs, owners)
        params = dict(trial.params)
        kill = None
        if trial.fault == "sigkill":
            kill = Kill(params["rank"], params["anchor"], params["delay_s"])
            spec = FaultSpec("none")
        else:
            spec = FaultSpec(trial.fault, **params)
        run = run_job(job, dirs, spec, timeout, kill, planted, offload)
        cleaned = next_start(dirs)
        left, touched = leftovers(dirs, planted) + run.deepspeed_buffers_kept, _touched(planted)
        outcome, ev = classify(trial.fault, run, base, job, left, touched)
        fired = bool(run.injected()) if kill is None else kill.at_s is not None and kill.at_s >= 0
        allowed = outcome in ALLOWED[trial.fault] if fired else outcome == "equal"
        ev.update(
            spec=str(spec),
            fired=fired,
            injected=run.injected(),
            next_start_removed=cleaned,
            deepspeed_buffers_left=run.deepspeed_buffers_left,
            owners=sorted(owners.records),
        )
        if kill is not None:
            ev["kill"] = kill.evidence()
        if run.log is not None:
            ev["ssd_bytes_written_rank0"] = _summary(run.log).get("dsx_ssd_bytes_written")
        trial.outcome, trial.allowed, trial.evidence = outcome, allowed, ev
        if keep:
            trial.evidence["dir"] = str(dirs.root)
        return trial
    finally:
        try:
            owners.release()
        finally:
            if not keep:
                dirs.remove()
