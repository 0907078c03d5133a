"""The ``dsx`` command: ``dsx report``, ``dsx build-ops``, ``dsx trace``, ``dsx clean-shm`` (see ``dsx --help``)."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import NoReturn

__all__ = ["config_error_message", "main", "run_entry_point"]

# Exit status of an entry point stopped by a bad config: argparse's for bad arguments, since both mean
# "fix what you gave me", not "the job crashed".
CONFIG_ERROR_EXIT = 2


def _report(p: argparse.ArgumentParser) -> None:
    p.add_argument("--io", metavar="PATH", help="also measure write/read bandwidth of a file in PATH")
    p.add_argument("--io-mb", type=int, default=256, help="size of that file (MB)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _build_ops(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="DS_CONFIG",
        help="instead, build every op a job with this DeepSpeed config compiles at its start and is not cached "
        "(DeepSpeed's CPU optimizer, async_io and CPU all-reduce; dsx's gather kernel where unified tensors are on "
        "a GPU)",
    )
    p.add_argument("--quiet", action="store_true", help="print only errors")


def _trace(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace JSON written by the scheduler (dsx.scheduler.trace_path)")
    p.add_argument("-o", "--output", default=None, help="PNG path (default: the trace's path, .png)")
    p.add_argument("--steps", metavar="A:B", default=None, help="only steps A <= step < B")


def _clean_shm(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--remove", action="store_true", help="remove the stale files (without it: only list them)"
    )
    p.add_argument(
        "--dir", default="/dev/shm", help="where dsx's segments live (dsx.unified.shared_memory_dir)"
    )
    p.add_argument(
        "--min-age", type=float, default=60.0, metavar="S", help="keep files younger than S seconds"
    )


# name -> (help, argument setup, "module:function" taking the parsed args and returning an exit code).
# Modules are imported only when their command runs, so a missing optional part breaks only that command.
_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], str]] = {
    "report": ("what this machine supports and what dsx will use", _report, "dsx.report:main"),
    "build-ops": (
        "build dsx's CUDA ops ahead of time (DeepSpeed OpBuilder); --config: every op a job would compile",
        _build_ops,
        "dsx.ops:cli_build",
    ),
    "trace": ("draw a scheduler trace as a timeline PNG", _trace, "dsx.runtime.timeline:cli"),
    "clean-shm": (
        "list (--remove: remove) the shared-memory files that dead dsx and DeepSpeed jobs left behind",
        _clean_shm,
        "dsx.clean:main",
    ),
}


def main(argv: list[str] | None = None) -> int:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="dsx", description=__doc__, formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_, setup, _) in _COMMANDS.items():
        setup(sub.add_parser(name, help=help_, description=help_, formatter_class=fmt))
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


def _deepspeed_config_models() -> set[str]:
    """Names of DeepSpeed's pydantic config models (empty when DeepSpeed was never imported: then none of
    its errors can be in flight, and importing it here would cost seconds)."""
    base = getattr(sys.modules.get("deepspeed.runtime.config_utils"), "DeepSpeedConfigModel", None)
    names: set[str] = set()
    todo = [base] if base is not None else []
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def config_error_message(exc: BaseException) -> str | None:
    """The user-facing lines of a config error, or None when ``exc`` is not one.

    Config errors are dsx's own (:class:`dsx.config.DsxConfigError`, which already names each bad key),
    DeepSpeed's ``DeepSpeedConfigError``, its pydantic validation errors, and JSON that does not parse.
    """
    from pydantic import ValidationError

    from dsx.config import DsxConfigError

    if isinstance(exc, DsxConfigError):
        return str(exc)
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid DeepSpeed config: not valid JSON: {exc}"
    ds_error = getattr(sys.modules.get("deepspeed.runtime.config"), "DeepSpeedConfigError", None)
    if ds_error is not None and isinstance(exc, ds_error):
        return f"invalid DeepSpeed config: {exc}"
    if isinstance(exc, ValidationError) and exc.title in _deepspeed_config_models():
        lines = [
            f"{'.'.join(map(str, e['loc'])) or '<top level>'}: {e['msg']}"
            for e in exc.errors(include_url=False)
        ]
        return f"invalid DeepSpeed config ({exc.title}):\n  " + "\n  ".join(lines)
    return None


def _exit_after_config_error(status: int) -> NoReturn:
    """Leave at once, without the interpreter's shutdown.

    A normal exit with a live gloo process group aborts in its background threads (exit -6 and a C++
    message instead of the status), and a barrier could wait forever on a rank that failed elsewhere.
    """
    from dsx.runtime.process import release_deepspeed_shm

    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            release_deepspeed_shm()  # os._exit skips the atexit hook that would unlink it
    except Exception:  # leaving anyway: the status matters more than the cleanup
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_entry_point(main: Callable[[], object]) -> None:
    """Run an example's ``main()`` under the deepspeed launcher or plain ``python``, then exit distributed.

    A config error prints its lines once (global rank 0; ``RANK`` unset counts as rank 0) to stderr,
    without a traceback, and every rank exits with status 2. Other ranks wait a moment first: the launcher
    kills every rank as soon as one fails, which could otherwise take rank 0 down before it has printed.
    Any other exception propagates with its traceback.
    """
    from dsx.runtime.process import exit_distributed, rank_and_world

    try:
        main()
    except Exception as exc:
        message = config_error_message(exc)
        if message is None:
            raise
        if rank_and_world()[0] == 0:
            print(f"error: {message}", file=sys.stderr, flush=True)
        else:
            time.sleep(3.0)
        _exit_after_config_error(CONFIG_ERROR_EXIT)
    exit_distributed()


if __name__ == "__main__":
    sys.exit(main())
