"""The integrity checksum: the Triton kernel and the torch twin agree; corruptions a drive makes are caught."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dsx.offload.checksum import checksum
from tests.harness import REPO

SIZES = [0, 1, 3, 4, 5, 4095, 4096, 4097, 3 * 16384 + 2, (1 << 20) + 7]


def _bytes(n: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).to(
        device
    )


def test_the_triton_kernel_and_the_torch_twin_agree_under_the_interpreter() -> None:
    code = (
        "import torch\n"
        "from dsx.offload.checksum import checksum\n"
        "from tests.offload.test_checksum import SIZES, _bytes\n"
        "for n in SIZES:\n"
        "    b = _bytes(n, seed=n)\n"
        "    a, t = checksum(b, 'torch'), checksum(b, 'triton')\n"
        "    assert torch.equal(a, t), (n, a, t)\n"
        "print('agree')\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "agree" in r.stdout, r.stderr[-2000:]


def _changes(b: torch.Tensor) -> dict[str, torch.Tensor]:
    """Ways a drive, a file system or a page cache changes a buffer of 8 KiB and more."""
    w = b.clone().view(torch.int32)
    out = {}
    flip = b.clone()
    flip[100] ^= 0x10
    out["one bit"] = flip
    swap = w.clone()
    swap[3], swap[7] = w[7].item(), w[3].item()
    out["two words swapped in a page"] = swap.view(torch.uint8)
    comp = w.clone()
    comp[10] += 5
    comp[900] -= 5
    out["two changes that cancel in the sum"] = comp.view(torch.uint8)
    zero = b.clone()
    zero[4096:8192] = 0
    out["a page zeroed"] = zero
    stale = b.clone()
    stale[:4096] = _bytes(4096, seed=99)
    out["a page from elsewhere"] = stale
    shifted = b.clone()
    shifted[:4092] = b[4:4096]
    out["a page shifted by a word"] = shifted
    out["truncated"] = b[:-4].clone()
    return out


@pytest.mark.parametrize("n", [8192, 3 * 16384 + 4])
def test_corruptions_change_the_checksum(n: int) -> None:
    b = _bytes(n, seed=1)
    want = checksum(b)
    for what, changed in _changes(b).items():
        assert not torch.equal(checksum(changed), want), what


@pytest.mark.gpu
def test_gpu_kernel_matches_the_torch_twin_and_catches_corruptions() -> None:
    for n in [*SIZES, 64 << 20]:
        b = _bytes(n, seed=n, device="cuda")
        assert torch.equal(checksum(b, "triton").cpu(), checksum(b.cpu(), "torch")), n
    b = _bytes(8192, seed=1, device="cuda")
    want = checksum(b)
    for what, changed in _changes(b).items():
        assert not torch.equal(checksum(changed), want), what
