"""Multi-rank test harness: real processes through the deepspeed launcher (gloo on CPU, NCCL on GPUs)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["REPO", "LaunchResult", "free_port", "launch", "launch_local_multinode", "launcher_env"]

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (bind to 0, read, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LaunchResult:
    cmd: list[str]
    returncode: int
    output: str

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
    env.setdefault("OMP_NUM_THREADS", "1")  # two ranks on two cores: no oversubscription
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


def _deepspeed_cmd() -> list[str]:
    exe = shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or shutil.which("deepspeed")
    return [exe] if exe else [sys.executable, "-m", "deepspeed.launcher.runner"]


def launch(
    script: str | Path,
    args: list[str],
    nprocs: int = 2,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> LaunchResult:
    """Run ``deepspeed --num_gpus/--num_accelerators N script args`` on this machine and capture the output."""
    import torch

    n_flag = "--num_gpus" if torch.cuda.is_available() else "--num_accelerators"
    cmd = [*_deepspeed_cmd(), n_flag, str(nprocs), "--master_port", str(free_port()), str(script), *args]
    return _run(cmd, timeout, launcher_env(env))


def launch_local_multinode(
    nodes: int, script: str | Path, args: list[str], timeout: float = 600, env: dict[str, str] | None = None
) -> LaunchResult:
    """``launch/local_multinode.sh``: N launcher "nodes" with one rank each, on this machine."""
    cmd = ["bash", str(REPO / "launch" / "local_multinode.sh"), str(nodes), str(script), *args]
    return _run(cmd, timeout, launcher_env({"MASTER_PORT": str(free_port()), **(env or {})}))


def _run(cmd: list[str], timeout: float, env: dict[str, str]) -> LaunchResult:
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
            start_new_session=True,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return LaunchResult(cmd, -9, out + f"\n[harness] timed out after {timeout} s")
    return LaunchResult(cmd, proc.returncode, proc.stdout)
