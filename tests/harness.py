"""Multi-rank test harness: real processes through the deepspeed launcher (gloo on CPU, NCCL on GPUs)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from dsx.runtime.process import deepspeed_launcher, free_port

__all__ = [
    "REPO",
    "LaunchResult",
    "async_io_available",
    "build_deepspeed_ops",
    "free_port",
    "launch",
    "launch_local_multinode",
    "launcher_env",
    "load_example",
    "needs_async_io",
    "remove_shm_buffers",
    "shm_buffers",
]

REPO = Path(__file__).resolve().parents[1]

# Tests that make DeepSpeed build its async_io op (ZeRO-3 offload to nvme, dsx's aio backend). The condition
# is evaluated at collection, and only when a collected test carries the marker (tests/conftest.py).
needs_async_io = pytest.mark.async_io


SKIP_ASYNC_IO = "DSX_TESTS_SKIP_ASYNC_IO"  # "1" (.ci/run): the run covers the combination without libaio


def async_io_available() -> tuple[bool, str]:
    """Whether DeepSpeed's async_io op can be used here, and if not why (the skip reason): dsx's own check,
    unless :data:`SKIP_ASYNC_IO` is set."""
    from dsx.ops.aio import async_io_status

    if os.environ.get(SKIP_ASYNC_IO) == "1":
        return False, f"{SKIP_ASYNC_IO}=1: this run covers the combination without libaio"
    ok, why = async_io_status()
    return ok, "" if ok else f"DeepSpeed's async_io op cannot be built here: {why}"


def load_example(relpath: str, name: str | None = None) -> ModuleType:
    """Import an example script (``examples/<...>.py``, not a package) as a module, for in-process tests."""
    path = REPO / relpath
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class LaunchResult:
    cmd: list[str]
    returncode: int
    output: str
    port: int | None = None  # the rendezvous port (MASTER_PORT) of the launched job

    def check(self) -> LaunchResult:
        """Raise with the command and the tail of every rank's output when the run failed."""
        if self.returncode != 0:
            tail = "\n".join(self.output.splitlines()[-80:])
            raise AssertionError(
                f"launch failed (exit {self.returncode}): {' '.join(self.cmd)}\n--- output tail ---\n{tail}"
            )
        return self


def launcher_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for launched ranks: the repo importable, CPU accelerator where there is no GPU."""
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(REPO)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # one thread a rank: jobs of two ranks, and two jobs at once on two cores
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # a test process's own single-rank settings must not leak into the ranks
    env.update(extra or {})
    return env


def build_deepspeed_ops(*builders: str) -> None:
    """JIT-build DeepSpeed ops (``"CPUAdamBuilder"``, ``"AsyncIOBuilder"``) here, before a launched job needs them.

    A rank that builds an op itself does so inside the launch's timeout, on cores its peers share; a build
    killed there leaves torch's build lock behind, and every later build of that op waits on it forever.
    Built in the test process (an exception releases the lock), the ranks load the op from the cache.
    Incompatible ops (no libaio, say) are left to the job, which reports them.
    """
    from deepspeed.accelerator import get_accelerator

    for name in builders:
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and builder.is_compatible(verbose=False):
            builder.load(verbose=False)


def launch(
    script: str | Path,
    args: list[str],
    nprocs: int = 2,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    clean_shm: bool = True,
) -> LaunchResult:
    """Run ``deepspeed --num_gpus/--num_accelerators N script args`` on this machine and capture the output.

    ``clean_shm``: afterwards remove the job's DeepSpeed CPU all-reduce buffers from ``/dev/shm``, which a
    rank that was killed (or a script that does not use dsx's exit) leaves behind, 66 MiB each.
    """
    import torch

    n_flag = "--num_gpus" if torch.cuda.is_available() else "--num_accelerators"
    port = free_port()
    cmd = [*deepspeed_launcher(), n_flag, str(nprocs), "--master_port", str(port), str(script), *args]
    try:
        res = _run(cmd, timeout, launcher_env(env))
    finally:
        if clean_shm:
            remove_shm_buffers(port)
    res.port = port
    return res


def shm_buffers(port: int) -> list[Path]:
    """DeepSpeed CPU all-reduce buffers in ``/dev/shm`` of the job whose rendezvous port was ``port``."""
    from dsx.runtime.process import SHM_DIR, shm_prefix

    return sorted(SHM_DIR.glob(f"{shm_prefix()}*_{port}_*"))


def remove_shm_buffers(port: int) -> None:
    for p in shm_buffers(port):
        p.unlink(missing_ok=True)


def launch_local_multinode(
    nodes: int, script: str | Path, args: list[str], timeout: float = 600, env: dict[str, str] | None = None
) -> LaunchResult:
    """``launch/local_multinode.sh``: N launcher "nodes" with one rank each, on this machine."""
    cmd = ["bash", str(REPO / "launch" / "local_multinode.sh"), str(nodes), str(script), *args]
    port = free_port()
    try:
        return _run(cmd, timeout, launcher_env({"MASTER_PORT": str(port), **(env or {})}))
    finally:
        remove_shm_buffers(port)


def _run(cmd: list[str], timeout: float, env: dict[str, str]) -> LaunchResult:
    """Run ``cmd`` in its own session; on timeout kill the whole session, not only the launcher.

    ``subprocess.run(timeout=)`` kills the direct child only: the ranks it started would live on as
    orphans (holding a DeepSpeed JIT build lock, a rendezvous port, the two CPU cores) and stall every
    later test.
    """
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return LaunchResult(cmd, -9, (out or "") + f"\n[harness] timed out after {timeout} s")
    finally:
        if proc.poll() is None:  # an exception (KeyboardInterrupt, pytest-timeout) left it running
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return LaunchResult(cmd, proc.returncode, out)
