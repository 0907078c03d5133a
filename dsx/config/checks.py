"""Checks the config's validators make against this machine: path lengths, directories, memory.

Their messages complete ``<key>: "<value>" ...`` (see :mod:`dsx.config.errors`).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["GIB", "MAX_GB", "check_creatable", "check_dir", "check_path_length", "physical_memory"]

GIB = 1 << 30
# Upper bound of every size in GB: more than any machine holds, and small enough that the byte counts derived
# from it stay exact integers far from any C integer's overflow.
MAX_GB = float(1 << 20)
# Room dsx's own names take below a directory it is given (run directory with its owner tag, rank file, owner
# record).
_NAME_ROOM = 128


def _limits(path: Path) -> tuple[int, int]:
    """(longest path, longest name) the filesystem holding ``path`` (or its nearest parent) allows."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return os.pathconf(probe, "PC_PATH_MAX"), os.pathconf(probe, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 4096, 255


def check_path_length(value: str, key: str) -> Path:
    """The path, once its length and every component's fit what the filesystem allows (the messages complete
    ``<key>: "<value>" ...``)."""
    path = Path(value).expanduser()
    size = len(os.fsencode(str(path.absolute())))
    # before any stat: a longer name or path fails every system call on Linux
    for part in path.parts:
        if len(os.fsencode(part)) > 255:
            raise ValueError(f"has a name of {len(os.fsencode(part))} bytes; names may have at most 255")
    if size + _NAME_ROOM > 4096:
        raise ValueError(
            f"is {size} bytes long; with the {_NAME_ROOM} bytes of names dsx adds below it, it must stay under "
            f"4096: point {key} at a shorter path"
        )
    path_max, name_max = _limits(path)
    if size + _NAME_ROOM > path_max:
        raise ValueError(
            f"is {size} bytes long; with the {_NAME_ROOM} bytes of names dsx adds below it, it must stay under "
            f"{path_max}: point {key} at a shorter path"
        )
    long = [p for p in path.parts if len(os.fsencode(p)) > name_max]
    if long:
        raise ValueError(
            f"has a name of {len(os.fsencode(long[0]))} bytes; this filesystem allows {name_max}"
        )
    return path


def check_dir(value: str | None, key: str) -> str | None:
    """A directory dsx writes into must exist and be writable at start-up, not at the first step.

    The messages complete ``<key>: "<value>" ...`` (see :func:`_format_errors`)."""
    if value is None:
        return None
    if not value.strip():
        raise ValueError(f"is empty: give {key} a directory")
    path = check_path_length(value, key)
    if not path.exists():
        raise ValueError(f"does not exist: create it, or point {key} at an existing directory")
    if not path.is_dir():
        raise ValueError(f"is not a directory: point {key} at a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(
            f"is not writable by this user (uid {os.getuid()}): change its permissions, or point {key} at a "
            "directory this user can write"
        )
    return str(path)


def check_creatable(value: str, key: str) -> None:
    """A file dsx creates, with the directories above it that do not exist yet: the nearest existing one must
    be a writable directory (the messages complete ``<key>: "<value>" ...``)."""
    parent = Path(value).expanduser().absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"is below {str(parent)!r}, which is not a directory: point {key} elsewhere")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(
            f"would be created below {str(parent)!r}, which this user (uid {os.getuid()}) cannot write: "
            f"change its permissions, or point {key} at a directory this user can write"
        )


def physical_memory() -> int:
    """Bytes of RAM on this machine (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0
