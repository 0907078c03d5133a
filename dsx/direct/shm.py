"""One copy per node: a host tensor placed in shared memory and mapped by every local rank.

The node's leader (its lowest global rank) creates a file in ``shared_memory_dir`` (``/dev/shm`` by
default), reserves its pages with ``posix_fallocate`` (so that a full tmpfs fails here with a clear message
rather than with SIGBUS on first touch), copies the data in and publishes the path; the other local ranks map
the same file. As soon as every local rank holds its mapping the leader unlinks the file: the pages then
live exactly as long as some process maps them, so a rank killed by SIGKILL leaves nothing behind.

Ownership: the file is created exclusively, readable by its user only (0600), named per user and job, and
its name carries its creator's :func:`~dsx.runtime.process.owner_tag` (pid, start time, boot id, pid
namespace); the leader holds a lock on it until the unlink. A leader killed before the unlink leaves the
file; :func:`sweep_stale` removes it at the next start once
:func:`~dsx.runtime.process.owner_gone` proves its creator dead. A file whose creator ran in another pid
namespace or machine (containers sharing ``/dev/shm``) cannot be judged from here and is kept.

Collective: every rank of the default process group must call :func:`share_tensor` in the same order.
"""

from __future__ import annotations

import fcntl
import math
import os
import re
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dsx.direct.gather import padded_row_stride, row_bytes_of, rows_contiguous, strided_rows
from dsx.runtime.process import ShmFinding, all_gather, collective, judge, owner_tag, parse_owner_tag

__all__ = [
    "NodeGroup",
    "SharedMemoryError",
    "check_space",
    "local_group",
    "scan_segments",
    "share_tensor",
    "shm_space_message",
    "sweep_stale",
]

PREFIX = "dsx-ut-"


def _user_prefix() -> str:
    """The start of this user's segment names (another user's files are never judged or touched)."""
    return f"{PREFIX}u{os.getuid()}-"


class SharedMemoryError(RuntimeError):
    """The shared segment cannot be created (directory too small, not writable) or a peer failed."""


@dataclass(frozen=True)
class NodeGroup:
    """The ranks of the default process group that share this node's memory."""

    ranks: tuple[int, ...]  # global ranks on this node, ascending
    rank: int  # this process's global rank

    @property
    def leader(self) -> int:
        return self.ranks[0]

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader


def _node_key() -> str:
    # Two launcher "nodes" may run on one machine (``--no_ssh --node_rank``): the node rank the launcher
    # exports is part of the key, so they do not share a segment they did not agree on.
    node = os.environ.get("CROSS_RANK", os.environ.get("GROUP_RANK", ""))
    return f"{socket.gethostname()}/{node}"


def local_group() -> NodeGroup:
    """The ranks on this node (collective over the default process group; one object all-gather)."""
    if not _distributed():
        return NodeGroup(ranks=(0,), rank=0)
    keys = all_gather(_node_key(), "finding the ranks on this node")
    mine = _node_key()
    ranks = tuple(r for r, k in enumerate(keys) if k == mine)
    return NodeGroup(ranks=ranks, rank=dist.get_rank())


def shm_space_message(directory: str, needed: int, free: int, total: int) -> str:
    """The error text for a shared-memory directory that cannot hold ``needed`` bytes."""
    gib = 1 << 30
    return (
        f"shared memory directory {directory} has {free / gib:.2f} GiB free of {total / gib:.2f} GiB, "
        f"but the unified tensor needs {needed / gib:.2f} GiB ({needed} bytes). Fix: give the container more "
        f"shared memory (docker run --shm-size={max(1, math.ceil(2 * needed / gib))}g, or mount a larger tmpfs), "
        "or point dsx.unified.shared_memory_dir at a tmpfs/hugetlbfs with room, or use shared='off' "
        "(one copy per rank)."
    )


def _space_message(directory: str, needed: int) -> str:
    st = os.statvfs(directory)
    return shm_space_message(directory, needed, st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)


def check_space(directory: str, needed: int) -> None:
    """Raise :class:`SharedMemoryError` if ``directory``'s file system has fewer than ``needed`` free bytes."""
    st = os.statvfs(directory)
    if needed > st.f_bavail * st.f_frsize:
        raise SharedMemoryError(_space_message(directory, needed))


def scan_segments(directory: str, min_age_s: float = 0.0) -> list[ShmFinding]:
    """This user's unified-tensor segments in ``directory``, each judged stale (its creator proven dead) or
    kept, with the reason. Segments younger than ``min_age_s`` are kept whatever their owner."""
    out: list[ShmFinding] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    for name in names:
        if not name.startswith(PREFIX):
            continue
        path = Path(directory, name)
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if not name.startswith(_user_prefix()):
            out.append(ShmFinding(path, size, False, "another user's: not judged here"))
            continue
        stale, why = judge(parse_owner_tag(name), path, min_age_s, locked_while_alive=True)
        out.append(ShmFinding(path, size, stale, why))
    return out


def sweep_stale(directory: str) -> list[str]:
    """Remove the segments :func:`scan_segments` proves stale (left by leaders that died before unlinking);
    the names removed."""
    removed = []
    for finding in scan_segments(directory):
        if finding.stale:
            try:
                finding.path.unlink()
                removed.append(finding.path.name)
            except OSError:
                pass  # another rank or node swept it first
    return removed


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _job_id() -> str:
    """A per-job id agreed through the process group (rank 0 draws it)."""
    obj = [uuid.uuid4().hex[:16]]
    if _distributed():
        with collective("agreeing on the job's shared-memory id"):
            dist.broadcast_object_list(obj, src=0)
    return str(obj[0])


def _all_ok(local_error: str | None) -> None:
    """Exchange errors: if any rank failed, every rank raises (nobody waits forever at a later barrier)."""
    bad = [
        (r, e)
        for r, e in enumerate(all_gather(local_error, "exchanging shared-memory setup errors"))
        if e is not None
    ]
    if bad:
        r, e = bad[0]
        raise SharedMemoryError(f"rank {r}: {e}")


def _create(path: str) -> tuple[str, int]:
    """Create the segment file: exclusively (never reuse a name someone else made), readable by this user
    only, and locked while this process holds the descriptor (so that no sweep takes a live segment, from
    any container). Returns (path, descriptor)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return path, fd


# Test seams (dsx.testing.faults replaces them; no-ops in a normal run): the reservation call, and a hook the
# leader passes at each named point of the setup, where a fault can stop it.
_fallocate = os.posix_fallocate


def _setup_point(point: str) -> None:
    """Reached by the node leader at ``"created"``, ``"filled"``, ``"published"`` and ``"before_unlink"``."""


def _map(path: str, nbytes: int) -> torch.Tensor:
    # MAP_SHARED mapping owned by the tensor's storage: it outlives the file's name and is unmapped when the
    # last tensor referring to it is freed.
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def share_tensor(
    tensor: torch.Tensor | None,
    shared_memory_dir: str = "/dev/shm",
    name: str | None = None,
    row_alignment: int = 0,
) -> tuple[torch.Tensor, NodeGroup]:
    """Return a tensor equal to ``tensor`` whose pages are shared by all ranks of this node.

    Parameters
    ----------
    tensor
        The data on the leader; other ranks may pass the same data or ``None`` (only the leader's copy is
        read; shape and dtype come from the leader).
    shared_memory_dir
        Where the segment file lives while ranks map it (a tmpfs: ``/dev/shm``).
    name
        Readable tag in the file name (for ``ls /dev/shm`` while the segment is being set up).
    row_alignment
        Read on the leader: rows start at multiples of this many bytes in the segment (0: packed). The result
        is then a view of the leading bytes of each padded row (see :func:`dsx.direct.gather.strided_rows`).

    Returns
    -------
    (shared, group)
        ``shared`` is a CPU tensor backed by the node's single copy (about ``tensor.nbytes`` of host memory
        per node, not per rank). Collective over the default process group.
    """
    group = local_group()
    job = _job_id()
    sweep_stale(shared_memory_dir)
    meta: list[object] = [None]
    error: str | None = None
    path = None
    base = None
    fd = -1
    if group.is_leader:
        try:
            if tensor is None:
                raise SharedMemoryError("the node leader must pass the tensor to share")
            if tensor.dim() and not rows_contiguous(tensor):
                raise SharedMemoryError(
                    "the tensor to share must have contiguous rows (call .contiguous() first)"
                )
            shape = tuple(tensor.shape)
            stride = padded_row_stride(row_bytes_of(shape, tensor.dtype), row_alignment) if shape else 0
            nbytes = shape[0] * stride if shape else tensor.element_size()
            check_space(shared_memory_dir, nbytes)
            tag = re.sub(r"[^A-Za-z0-9_.]", "_", name or "tensor")[:40]
            name_ = f"{_user_prefix()}{job}-{owner_tag()}-r{group.rank}-{tag}"
            path, fd = _create(os.path.join(shared_memory_dir, name_))
            _setup_point("created")
            try:
                # Reserve tmpfs pages now, not at first touch (at least one byte, so that it maps).
                _fallocate(fd, 0, max(nbytes, 1))
            except OSError as exc:
                raise SharedMemoryError(f"{_space_message(shared_memory_dir, nbytes)} ({exc})") from None
            base = _map(path, max(nbytes, 1))[:nbytes]
            if nbytes:
                _table(base, tensor.dtype, shape, stride).copy_(tensor)
            _setup_point("filled")
            meta = [(path, nbytes, tensor.dtype, shape, stride)]
        except Exception as exc:  # published to the other ranks, raised everywhere below
            error = f"{type(exc).__name__}: {exc}"
            if path is not None and os.path.exists(path):
                os.unlink(path)
            if fd >= 0:
                os.close(fd)
                fd = -1
    try:
        # Every rank learns every leader's error or path; a leader whose segment exists unlinks it below
        # whatever failed elsewhere (another node's leader, a peer's mapping, the exchange itself).
        metas = all_gather((error, meta[0]), "sharing a tensor's shared-memory segment")
        _, leader_meta = metas[group.leader]  # type: ignore[misc]
        bad = [(r, m[0]) for r, m in enumerate(metas) if m[0] is not None]  # type: ignore[index]
        if bad:
            r, e = bad[0]
            raise SharedMemoryError(f"rank {r} could not create the shared segment: {e}")
        path, nbytes, dtype, shape, stride = leader_meta  # type: ignore[misc]
        if group.is_leader:
            _setup_point("published")
        try:
            if not group.is_leader:
                base = _map(path, max(nbytes, 1))[:nbytes]
            error = None
        except Exception as exc:
            error = f"{type(exc).__name__}: could not map {path}: {exc}"
        _all_ok(error)  # all local ranks have mapped (or failed)
    finally:
        if group.is_leader and path is not None and os.path.exists(path):
            _setup_point("before_unlink")
            os.unlink(path)  # from here on the pages live only as long as the mappings
        if fd >= 0:
            os.close(fd)  # (drops the lock: the name it guarded is gone)
    # One more exchange so that, on every rank, unified() returns only once the name is gone.
    _all_ok(None)
    assert base is not None
    shared = _table(base, dtype, shape, stride) if nbytes else torch.empty(shape, dtype=dtype)
    return shared, group


def _table(base: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], stride: int) -> torch.Tensor:
    """The shared table in the segment's bytes: packed, or rows ``stride`` bytes apart."""
    if not shape or stride == row_bytes_of(shape, dtype):
        return base.view(dtype).view(shape)
    return strided_rows(base, dtype, shape, stride)
