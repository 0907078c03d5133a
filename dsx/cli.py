"""The ``dsx`` command: ``dsx report``, ``dsx build-ops``, ``dsx trace``, ``dsx clean-shm`` (see ``dsx --help``)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable

__all__ = ["main"]


def _report(p: argparse.ArgumentParser) -> None:
    p.add_argument("--io", metavar="PATH", help="also measure write/read bandwidth of a file in PATH")
    p.add_argument("--io-mb", type=int, default=256, help="size of that file (MB)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _build_ops(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true")


def _trace(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace JSON written by the scheduler (dsx.scheduler.trace_path)")
    p.add_argument("-o", "--output", default=None, help="PNG path (default: the trace's path, .png)")
    p.add_argument("--steps", metavar="A:B", default=None, help="only steps A <= step < B")


def _clean_shm(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    p.add_argument(
        "--min-age", type=float, default=60.0, metavar="S", help="leave files younger than S seconds"
    )


# name -> (help, argument setup, "module:function" taking the parsed args and returning an exit code).
# Modules are imported only when their command runs, so a missing optional part breaks only that command.
_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], str]] = {
    "report": ("what this machine supports and what dsx will use", _report, "dsx.report:main"),
    "build-ops": (
        "build dsx's CUDA ops ahead of time (DeepSpeed OpBuilder)",
        _build_ops,
        "dsx.ops:cli_build",
    ),
    "trace": ("draw a scheduler trace as a timeline PNG", _trace, "dsx.runtime.timeline:cli"),
    "clean-shm": (
        "remove the /dev/shm all-reduce buffers that DeepSpeed CPU jobs left behind (66 MiB a rank)",
        _clean_shm,
        "dsx.runtime.process:cli_clean_shm",
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_, setup, _) in _COMMANDS.items():
        setup(sub.add_parser(name, help=help_))
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if _has_cuda() else "cpu")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    module, func = _COMMANDS[args.command][2].split(":")
    return int(getattr(importlib.import_module(module), func)(args) or 0)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
