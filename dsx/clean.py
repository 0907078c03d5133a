"""``dsx clean-shm``: what dsx and DeepSpeed left in shared memory, and (``--remove``) its removal.

Two kinds of files: dsx's unified-tensor segments (``dsx-ut-u<uid>-...``) that a node leader killed during
setup left behind, and DeepSpeed's CPU all-reduce buffers (66 MiB a rank) that every CPU job leaves, because
DeepSpeed never unlinks them. Only files proven stale are removed; every other one is listed with the
reason it is kept (in use, young, or made where this machine cannot tell whether its owner runs).
"""

from __future__ import annotations

import argparse

from dsx.direct.shm import scan_segments
from dsx.runtime.process import ShmFinding, scan_deepspeed_shm

__all__ = ["findings", "main"]


def findings(directory: str, min_age_s: float) -> list[ShmFinding]:
    """Every dsx segment in ``directory`` and DeepSpeed buffer in ``/dev/shm`` of this user, judged."""
    return scan_segments(directory, min_age_s) + scan_deepspeed_shm(min_age_s)


def main(args: argparse.Namespace) -> int:
    found = findings(args.dir, args.min_age)
    stale = [f for f in found if f.stale]
    freed = removed = 0
    for f in found:
        if not f.stale:
            print(f"kept     {f.path}: {f.reason}")
            continue
        if args.remove:
            try:
                f.path.unlink()
            except FileNotFoundError:
                continue  # removed meanwhile (another sweep)
            except OSError as exc:
                print(f"FAILED   {f.path}: {exc}")
                continue
            removed, freed = removed + 1, freed + f.nbytes
            print(f"removed  {f.path}: {f.reason}")
        else:
            print(f"stale    {f.path}: {f.reason}")
    kept = len(found) - len(stale)
    if args.remove:
        print(f"removed {removed} stale file(s), freed {freed / 2**20:.0f} MiB; kept {kept}")
    else:
        total = sum(f.nbytes for f in stale)
        print(f"{len(stale)} stale file(s), {total / 2**20:.0f} MiB; kept {kept}"
              + ("; run with --remove to remove them" if stale else ""))  # fmt: skip
    return 0
