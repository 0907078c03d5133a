"""Process lifetime: liveness of other ranks' processes, gathering from every rank, a clean distributed exit,
and the shared-memory buffers DeepSpeed's CPU backend leaves behind."""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import time
from pathlib import Path
from typing import Any

__all__ = [
    "all_gather",
    "deepspeed_shm_buffer",
    "exit_distributed",
    "owner_gone",
    "owner_record",
    "pid_alive",
    "release_deepspeed_shm",
    "release_deepspeed_shm_at_exit",
    "shm_prefix",
    "single_process_env",
    "stale_deepspeed_shm_buffers",
]

SHM_DIR = Path("/dev/shm")


def all_gather(obj: Any) -> list[Any]:
    """``obj`` from every rank, in rank order; ``[obj]`` without a process group. A collective call."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


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


def single_process_env() -> bool:
    """Without a launcher (plain ``python train.py``), make this process rank 0 of 1 on a free local port, so
    that DeepSpeed does not fall back to MPI discovery; whether it did anything (a launcher's or MPI's
    variables, or a process group already up, leave the environment as it is)."""
    import torch.distributed as dist

    if "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        return False
    if dist.is_available() and dist.is_initialized():
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return True


def exit_distributed() -> None:
    """Wait for every rank, then tear the process group down before the interpreter exits.

    A rank that leaves while a peer still runs collectives (rank 0 writing its log, say) lets gloo's
    background threads be destroyed un-joined at exit, which aborts the process ("terminate called
    without an active exception", exit -6) and fails the launcher. Entry points call this last.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
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


def stale_deepspeed_shm_buffers(min_age_s: float = 60.0) -> list[Path]:
    """This user's DeepSpeed CPU all-reduce buffers in ``/dev/shm`` that no running process maps.

    They are what jobs left behind (DeepSpeed never unlinks them; a killed rank cannot): nothing can use
    them again, since a new job creates its own under its own port. Files younger than ``min_age_s`` are
    left out: a rank maps its buffer a moment after creating it, and peers open it by name during setup.
    """
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or another user's process (which cannot map our 0600 files)
            continue
        for line in text.splitlines():
            if "deepspeed_allreduce_buffer_" in line:
                mapped.add(line.split(maxsplit=5)[-1].removesuffix(" (deleted)"))
    now = time.time()
    out = []
    for path in SHM_DIR.glob(f"{shm_prefix()}*"):
        with contextlib.suppress(FileNotFoundError):
            if str(path) not in mapped and now - path.stat().st_mtime >= min_age_s:
                out.append(path)
    return sorted(out)


def cli_clean_shm(args: Any) -> int:
    """``dsx clean-shm``: remove (or, with ``--dry-run``, list) stale DeepSpeed all-reduce buffers."""
    stale = stale_deepspeed_shm_buffers(args.min_age)
    total = 0
    for path in stale:
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
            if not args.dry_run:
                path.unlink()
        print(("would remove " if args.dry_run else "removed ") + str(path))
    verb = "would free" if args.dry_run else "freed"
    print(f"{len(stale)} stale DeepSpeed shared-memory buffer(s), {verb} {total / 2**20:.0f} MiB")
    return 0
