"""Process lifetime: liveness of other ranks' processes, gathering from every rank, a clean distributed exit,
and the shared-memory buffers DeepSpeed's CPU backend leaves behind."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "LOCK_GRACE_S",
    "PeerLostError",
    "ShmFinding",
    "all_gather",
    "collective",
    "deepspeed_launcher",
    "deepspeed_shm_buffer",
    "exit_distributed",
    "free_port",
    "hold_deepspeed_shm",
    "is_locked",
    "judge",
    "owner_gone",
    "owner_record",
    "owner_tag",
    "parse_owner_tag",
    "pid_alive",
    "rank_and_world",
    "release_deepspeed_shm",
    "release_deepspeed_shm_at_exit",
    "scan_deepspeed_shm",
    "sees_every_process",
    "shm_prefix",
    "single_process_env",
    "stale_deepspeed_shm_buffers",
]

SHM_DIR = Path("/dev/shm")


class PeerLostError(RuntimeError):
    """An exchange among the ranks failed on this rank: another rank has ended or lost its connection."""


# what the backends' errors about a peer carry (gloo names its source path; NCCL itself)
_BACKEND_MARKS = ("gloo", "NCCL", "nccl", "Connection closed", "Connection reset", "Socket", "socket")


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Around one collective call: a backend failure becomes :class:`PeerLostError` naming ``what``.

    gloo reports a peer that died as a socket error ("Connection reset by peer"), which does not say that
    the rank to read about is another one; the launcher may report this rank's failure before the dead one's.
    """
    import torch
    import torch.distributed as dist

    try:
        yield
    except RuntimeError as e:
        # only the backend's own failures (gloo raises plain RuntimeErrors naming itself); an out-of-memory or
        # any other local error is this rank's and goes up unchanged
        if isinstance(e, torch.OutOfMemoryError) or not (
            isinstance(e, dist.DistError) or any(m in str(e) for m in _BACKEND_MARKS)
        ):
            raise
        where = f" on rank {dist.get_rank()} of {dist.get_world_size()}" if dist.is_initialized() else ""
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PeerLostError(
            f"dsx: {what} failed{where}: another rank has ended or lost its connection; its own output says "
            f"why (the launcher reports a rank killed by a signal as 'exits with return code = -N'). "
            f"The backend said: {first}"
        ) from e


def all_gather(obj: Any, what: str = "an exchange among the ranks") -> list[Any]:
    """``obj`` from every rank, in rank order; ``[obj]`` without a process group. A collective call; a
    backend failure raises :class:`PeerLostError` naming ``what``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    with collective(what):
        dist.all_gather_object(out, obj)
    return out


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size: the process group's, or the launcher's ``RANK`` and
    ``WORLD_SIZE`` before the group exists (rank 0 of 1 without a launcher)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)


def shm_prefix() -> str:
    """The start of the names of this user's DeepSpeed CPU all-reduce buffers in ``SHM_DIR``."""
    return f"deepspeed_allreduce_buffer_{os.getuid()}_"


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this machine (signal 0; a process we may not signal still counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot, /proc/<pid>/stat field 22): tells a reused pid apart."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: count from the last ')'
        return int(stat[stat.rindex(")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def owner_record() -> dict[str, Any]:
    """Who this process is, for a file that outlives it: pid, its start time, host name, boot id, pid
    namespace. :func:`owner_gone` reads it back in another process, maybe on another machine."""
    pid = os.getpid()
    return {"pid": pid, "start": _start_ticks(pid), "host": socket.gethostname(),
            "boot": _read("/proc/sys/kernel/random/boot_id"), "pidns": _pid_namespace()}  # fmt: skip


def owner_gone(record: dict[str, Any]) -> bool | None:
    """Whether the process an :func:`owner_record` describes has ended: True, False, or None when this process
    cannot tell (it ran on another machine, or in another container's pid namespace, where its pid means
    nothing here). A directory on a drive that several machines or containers share is judged only by those
    that can.
    """
    boot = _read("/proc/sys/kernel/random/boot_id")
    if record.get("boot") and boot and record["boot"] != boot:
        # this machine since rebooted (its owner is gone), or another machine
        return True if record.get("host") == socket.gethostname() else None
    ns = _pid_namespace()
    if record.get("pidns") and ns and record["pidns"] != ns:
        return None
    pid = int(record["pid"])
    if not pid_alive(pid):
        return True
    start = record.get("start")
    now = _start_ticks(pid)
    return start is not None and now is not None and now != start  # a live pid, reused by another process


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (bind to 0, read, close)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_launcher() -> list[str]:
    """The ``deepspeed`` launcher's command: the script beside this Python (its virtual environment's), else
    the one on ``PATH``, else the module it runs."""
    exe = shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or shutil.which("deepspeed")
    return [exe] if exe else [sys.executable, "-m", "deepspeed.launcher.runner"]


def single_process_env() -> bool:
    """Without a launcher (plain ``python train.py``), make this process rank 0 of 1 on a free local port, so
    that DeepSpeed does not fall back to MPI discovery; whether it did anything (a launcher's or MPI's
    variables, or a process group already up, leave the environment as it is)."""
    import torch.distributed as dist

    if "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        return False
    if dist.is_available() and dist.is_initialized():
        return False
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    return True


_TAG = re.compile(r"p(?P<pid>\d+)-t(?P<start>\d+)-b(?P<boot>[0-9a-f]{32}|0)-n(?P<ns>\d+)")


def owner_tag() -> str:
    """:func:`owner_record` as a file-name part (``p<pid>-t<start>-b<boot id>-n<pid namespace>``), for files
    whose name must say who made them; :func:`parse_owner_tag` reads it back."""
    r = owner_record()
    boot = (r["boot"] or "").replace("-", "") or "0"
    ns = re.sub(r"\D", "", r["pidns"] or "") or "0"
    return f"p{r['pid']}-t{r['start'] or 0}-b{boot}-n{ns}"


def parse_owner_tag(text: str) -> dict[str, Any] | None:
    """The owner record in a name that carries an :func:`owner_tag`, or None. It has no host name: a file
    whose boot id is not this machine's is judged unknowable by :func:`owner_gone`."""
    m = _TAG.search(text)
    if m is None:
        return None
    b = m["boot"]
    boot = f"{b[:8]}-{b[8:12]}-{b[12:16]}-{b[16:20]}-{b[20:]}" if b != "0" else None
    return {"pid": int(m["pid"]), "start": int(m["start"]) or None, "boot": boot,
            "pidns": f"pid:[{m['ns']}]" if m["ns"] != "0" else None, "host": None}  # fmt: skip


def exit_distributed() -> None:
    """Wait for every rank, then tear the process group down before the interpreter exits.

    A rank that leaves while a peer still runs collectives (rank 0 writing its log, say) lets gloo's
    background threads be destroyed un-joined at exit, which aborts the process ("terminate called
    without an active exception", exit -6) and fails the launcher. Entry points call this last.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        with collective("the barrier before the process group ends"):
            dist.barrier()
        release_deepspeed_shm()  # every peer is past its setup (the barrier): the name is no longer needed
        dist.destroy_process_group()


def deepspeed_shm_buffer(rank: int | None = None, port: str | None = None) -> Path:
    """Where DeepSpeed's CPU backend keeps rank ``rank``'s shared-memory all-reduce buffer.

    DeepSpeed's ``TorchBackend`` on the CPU accelerator, when every rank is on one machine (the launcher
    sets ``LOCAL_SIZE`` to the world size), creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>
    _<MASTER_PORT>_<rank>`` (66 MiB) in ``deepspeed.init_distributed``. Defaults: this process's ``RANK``
    and ``MASTER_PORT``.
    """
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    port = os.environ.get("MASTER_PORT", "") if port is None else port
    addr = os.environ.get("MASTER_ADDR", "")
    return SHM_DIR / f"{shm_prefix()}{addr}_{port}_{rank}"


def release_deepspeed_shm() -> bool:
    """Unlink this rank's DeepSpeed CPU all-reduce buffer; whether there was one.

    DeepSpeed 0.19 never unlinks it, so every CPU job launched with ``deepspeed`` leaves 66 MiB a rank in
    ``/dev/shm`` (RAM-backed) until reboot: a machine that runs many jobs runs out of memory. Unlinking
    removes the name only; the ranks that mapped the buffer keep using it until they exit. Call it once
    every peer has mapped the buffer, that is after any collective following ``init_distributed``.
    """
    path = deepspeed_shm_buffer()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
        return True
    return False


def release_deepspeed_shm_at_exit() -> None:
    """Unlink this rank's DeepSpeed CPU all-reduce buffer when the interpreter exits.

    Idempotent: one hook however many engines a process builds (``unregister`` drops an earlier one).
    """
    atexit.unregister(release_deepspeed_shm)
    atexit.register(release_deepspeed_shm)
    hold_deepspeed_shm()


@dataclass(frozen=True)
class ShmFinding:
    """A file dsx or DeepSpeed left in shared memory, and whether it is proven stale (``reason`` says why it
    is, or why it is kept)."""

    path: Path
    nbytes: int
    stale: bool
    reason: str


def is_locked(path: str | os.PathLike[str]) -> bool:
    """Whether some process holds an advisory lock on ``path`` (``flock``; seen across pid namespaces and
    containers, unlike pids). False for a file that is gone or cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # (closing drops the lock this probe may have taken)
    return False


def _mapped_paths() -> dict[str, int]:
    """Every file mapped by a process visible here -> one such pid (``/proc/<pid>/maps``)."""
    mapped: dict[str, int] = {}
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or another user's process (which cannot map our 0600 files)
            continue
        for line in text.splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/"):
                mapped.setdefault(parts[5].removesuffix(" (deleted)"), int(maps.parent.name))
    return mapped


INIT_PID_NAMESPACE = "pid:[4026531836]"  # the kernel's initial pid namespace (PROC_PID_INIT_INO)


def sees_every_process() -> bool:
    """Whether this process runs in the initial pid namespace, where ``/proc`` lists every process of the
    machine, those of containers included (in a container's namespace, other containers are invisible)."""
    return _pid_namespace() == INIT_PID_NAMESPACE


# how long a file dsx locks may stand unlocked while its owner is still taking the lock (microseconds, in
# practice): older and unlocked on this machine, it has no owner, in whatever pid namespace
LOCK_GRACE_S = 10.0


def judge(
    owner: dict[str, Any] | None,
    path: str | os.PathLike[str],
    min_age_s: float = 0.0,
    locked_while_alive: bool = False,
) -> tuple[bool, str]:
    """Whether what ``path`` names (a file, or a directory whose owner record it is) is proven stale, and why or
    why not: the one liveness test for everything dsx leaves on shared storage.

    Kept: a file some process holds locked (seen from every container), one younger than ``min_age_s``, one
    without a usable owner record, one whose owner runs, and one whose owner ran in another pid namespace or
    machine (its pid means nothing here). Stale: its owner is proven ended; or, for what its owner holds
    locked as long as it lives (``locked_while_alive``: dsx's run directories and segments), no lock on it,
    made on this machine since its last boot (the kernel keeps locks across pid namespaces, not machines) and
    older than :data:`LOCK_GRACE_S`.
    """
    if is_locked(path):
        return False, "in use: its owner holds a lock on it"
    try:
        age = time.time() - os.stat(path).st_mtime
    except OSError:
        return False, "gone"
    if age < min_age_s:
        return False, f"younger than {min_age_s:g} s"
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int):
        return False, "no owner record: cannot tell whether its owner runs"
    boot = _read("/proc/sys/kernel/random/boot_id")
    if locked_while_alive and boot and owner.get("boot") == boot and age >= LOCK_GRACE_S:
        return True, f"its owner (pid {owner['pid']}) holds no lock on it: it has ended"
    gone = owner_gone(owner)
    if gone:
        return True, f"its owner (pid {owner['pid']}) has ended"
    if gone is None:
        return False, "made in another pid namespace or machine: cannot tell whether its owner runs"
    return False, f"its owner (pid {owner['pid']}) runs"


def scan_deepspeed_shm(min_age_s: float = 60.0) -> list[ShmFinding]:
    """This user's DeepSpeed CPU all-reduce buffers in ``/dev/shm``, each judged stale or kept.

    Kept: a buffer a visible process maps, one a dsx job holds (:func:`hold_deepspeed_shm`: a lock seen from
    every container sharing ``/dev/shm``), one younger than ``min_age_s`` (a rank maps its buffer a moment
    after creating it, and peers open it by name during setup). The rest is what jobs left behind: DeepSpeed
    never unlinks them, a killed rank cannot, and no job uses another job's buffer (each has its port).
    The rest is stale only where this process sees every process (the initial pid namespace): from inside a
    container, a job in another container sharing ``/dev/shm`` could map it unseen, so it is kept there."""
    mapped = _mapped_paths()
    everyone = sees_every_process()
    now = time.time()
    out = []
    for path in sorted(SHM_DIR.glob(f"{shm_prefix()}*")):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        if str(path) in mapped:
            out.append(ShmFinding(path, st.st_size, False, f"mapped by running process {mapped[str(path)]}"))
        elif is_locked(path):
            out.append(ShmFinding(path, st.st_size, False, "held by a running dsx job"))
        elif now - st.st_mtime < min_age_s:
            out.append(
                ShmFinding(path, st.st_size, False, f"younger than {min_age_s:g} s: a job may be starting")
            )
        elif not everyone:
            out.append(ShmFinding(path, st.st_size, False, "no process here maps it, but this runs in a container's "
                                  "pid namespace, where another container's job would be invisible"))  # fmt: skip
        else:
            out.append(ShmFinding(path, st.st_size, True, "no running process maps or holds it"))
    return out


def stale_deepspeed_shm_buffers(min_age_s: float = 60.0) -> list[Path]:
    """The buffers :func:`scan_deepspeed_shm` proves stale."""
    return [f.path for f in scan_deepspeed_shm(min_age_s) if f.stale]


_held: dict[str, int] = {}  # buffer -> the descriptor whose lock marks it as in use by this process


def hold_deepspeed_shm() -> None:
    """Hold a shared lock on this rank's DeepSpeed CPU all-reduce buffer while the process lives, so that
    ``dsx clean-shm`` run from another container sharing ``/dev/shm`` (where this pid is invisible) keeps it."""
    path = deepspeed_shm_buffer()
    if str(path) in _held:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # no buffer: not a CPU job on one machine
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # (blocks only while a sweep's probe holds it, a moment)
        _held[str(path)] = fd
    except OSError:
        os.close(fd)
