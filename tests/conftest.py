"""Markers: ``gpu`` / ``multigpu`` / ``async_io`` tests skip with a reason where the hardware or system part
is missing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest
import torch

_prebuild: dict[str, object] = {}


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: start no build for tests that will not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n = _gpus()
    if any(item.get_closest_marker("async_io") for item in items):
        from tests.harness import async_io_available

        aio_ok, aio_why = async_io_available()
        for item in items:
            if item.get_closest_marker("async_io") and not aio_ok:
                item.add_marker(pytest.mark.skip(reason=aio_why))
        if aio_ok:
            _start_async_io_build(config)
    for item in items:
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(
                pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs, found {n} (run on the GPU machine)")
            )
        elif "gpu" in item.keywords and n < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)"))


@pytest.fixture(scope="session", autouse=True)
def _single_rank_process() -> None:
    """In-process engines run as rank 0 of 1 (DeepSpeed would otherwise try MPI discovery).

    Launched ranks never inherit these: tests/harness.py removes them from the children's environment.
    """
    from tests.harness import free_port

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())


@pytest.fixture(scope="session", autouse=True)
def _no_async_io_where_skipped() -> Iterator[None]:
    """Under ``DSX_TESTS_SKIP_ASYNC_IO=1`` (.ci/run) the run covers the combination without libaio: in this
    process dsx's probe then says the async_io op is unavailable, so that an SSD tier's ``io_backend`` "auto"
    opens posix, as on a machine without libaio-dev, and no in-process test builds the op (minutes on a small
    runner) where the image has the library. Launched jobs are not covered: a test that launches one needing
    the op carries the ``async_io`` marker."""
    from tests.harness import SKIP_ASYNC_IO, async_io_available

    if os.environ.get(SKIP_ASYNC_IO) != "1":
        yield
        return
    from dsx.ops import aio

    unavailable = (False, async_io_available()[1])
    real = aio.async_io_status
    with pytest.MonkeyPatch.context() as mp:
        # the probe itself, which modules imported from now on take by name, and every module of dsx that
        # took it by name already
        mp.setattr(aio, "async_io_status", lambda: unavailable)
        for name, module in list(sys.modules.items()):
            if name.startswith("dsx.") and getattr(module, "async_io_status", None) is real:
                mp.setattr(module, "async_io_status", lambda: unavailable)
        yield


def _start_async_io_build(config: pytest.Config) -> None:
    """On a fresh machine DeepSpeed's async_io op takes minutes to compile, in whichever test first needs it.
    Start that build now, beside the tests that come first and at a lower priority than they; torch's build
    lock makes a test that needs the op before it is done wait for it, and load it after."""
    from dsx.ops.cache import extensions_root, is_cached

    if config.option.collectonly or is_cached("async_io"):
        return
    lock = extensions_root() / "async_io" / "lock"
    if lock.exists():  # another build runs, or a killed one left it: the tests that need the op wait on it
        print(f"\n{lock} exists: a build of the async_io op runs, or a killed one left it (then remove it)",
              file=sys.stderr)  # fmt: skip
        return
    code = "from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load(verbose=False)"
    with tempfile.NamedTemporaryFile("w", prefix="dsx-async-io-build-", suffix=".log", delete=False) as log:
        _prebuild["log"] = log.name
        _prebuild["proc"] = subprocess.Popen(
            [sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(10)
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    proc = _prebuild.get("proc")
    if not isinstance(proc, subprocess.Popen):
        return
    log = str(_prebuild["log"])
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        proc.wait()  # it had the same Ctrl-C: it stops and lets torch's build lock go
        return
    if proc.poll() is None:
        print(f"\nwaiting for the async_io op build started at collection (pid {proc.pid}, log {log})",
              file=sys.stderr)  # fmt: skip
    try:
        rc = proc.wait(timeout=1800)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # an interrupt, not a kill: torch lets its build lock go
        rc = proc.wait()
    if rc == 0:
        os.unlink(log)
    else:
        print(f"\nthe async_io op build started at collection failed: see {log}", file=sys.stderr)
