"""The CUDA gather kernel's thread bodies, compiled by nvcc for the host and run on the CPU.

``csrc/unified_gather.cu`` writes each kernel as a ``__host__ __device__`` thread body; built with
``-DDSX_HOST_EMULATION`` it exports ``dsx_emulate_gather``, which runs every thread of the same launch
plan (vector width, lanes per row, bounded grid) one after another. Threads never synchronise, so this is
a valid schedule of the GPU kernel: the indexing, 128-byte alignment, dedup of sorted runs, un-permuting,
grid-stride and the bad-index flag are all checked here, on machines without a GPU.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"

pytestmark = pytest.mark.slow


class GatherArgs(ctypes.Structure):
    _fields_ = [
        ("table", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("index", ctypes.c_void_p),
        ("perm", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
        ("row_stride", ctypes.c_int64),
        ("num_rows", ctypes.c_int64),
        ("flag", ctypes.c_void_p),
        ("index_is_int64", ctypes.c_bool),
        ("dedup", ctypes.c_bool),
    ]


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: the host emulation of the CUDA kernel needs the CUDA toolkit")
    so = tmp_path_factory.mktemp("emu") / "ug_emu.so"
    cmd = [nvcc, "-shared", "-Xcompiler", "-fPIC", "-O1", "-std=c++17", "-arch=sm_90", "-DDSX_HOST_EMULATION",
           f"-I{CSRC}", str(CSRC / "unified_gather.cu"), "-o", str(so)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lib = ctypes.CDLL(str(so))
    lib.dsx_emulate_gather.argtypes = [
        ctypes.POINTER(GatherArgs),
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    lib.dsx_emulate_gather.restype = ctypes.c_int
    return lib


def _run(lib, table: torch.Tensor, idx: torch.Tensor, *, sort: bool, max_blocks: int = 0, naive: bool = False,
         out_offset: int = 0):  # fmt: skip
    """Emulated gather of byte table rows ``idx`` (``table`` may be the leading columns of a wider table);
    returns (out, flag, plan)."""
    rows, row_bytes = table.shape
    row_stride = table.stride(0)
    n = idx.numel()
    if sort:
        sidx, perm = torch.sort(idx)
        sidx = sidx.contiguous()
    else:
        sidx, perm = idx.contiguous(), None
    out_buf = torch.full((n * row_bytes + out_offset + 16,), 0xAB, dtype=torch.uint8)
    out = out_buf[out_offset : out_offset + n * row_bytes]
    flag = torch.zeros(2, dtype=torch.int64)
    plan = torch.zeros(4, dtype=torch.int64)
    a = GatherArgs(table.data_ptr(), out.data_ptr(), sidx.data_ptr(), perm.data_ptr() if perm is not None else None,
                   n, row_bytes, row_stride, rows, flag.data_ptr(), idx.dtype == torch.int64, sort)  # fmt: skip
    assert lib.dsx_emulate_gather(ctypes.byref(a), max_blocks, int(naive), plan.data_ptr()) == 0
    # nothing stored outside the output rows (wide loads read neighbouring bytes, they must not write them)
    assert bool((out_buf[:out_offset] == 0xAB).all()) and bool(
        (out_buf[out_offset + n * row_bytes :] == 0xAB).all()
    )
    return out.view(n, row_bytes), flag, plan.tolist()


def _byte_table(rows: int, row_bytes: int, offset: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (rows * row_bytes + 256,), generator=g, dtype=torch.uint8)
    return buf[offset : offset + rows * row_bytes].view(rows, row_bytes)


ROW_BYTES = [1, 3, 4, 5, 12, 16, 31, 64, 100, 128, 130, 256, 258, 300, 512, 1000, 1001, 2052, 4096]


@pytest.mark.parametrize("row_bytes", ROW_BYTES)
@pytest.mark.parametrize("offset", [0, 64, 4, 1])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_tuned_kernel_equals_index_select(emu, row_bytes, offset, index_dtype) -> None:
    rows = 257
    table = _byte_table(rows, row_bytes, offset, seed=row_bytes * 7 + offset)
    g = torch.Generator().manual_seed(row_bytes + offset)
    idx = torch.randint(0, rows, (600,), generator=g)
    idx[::9] = idx[4]  # a long run of one duplicate once sorted
    idx = idx.to(index_dtype)
    ref = table.index_select(0, idx.long())
    for sort in (True, False):
        for max_blocks in (0, 1, 3):  # unbounded, and grid-stride with very few blocks
            out, flag, plan = _run(emu, table, idx, sort=sort, max_blocks=max_blocks)
            assert flag.tolist() == [0, 0]
            assert torch.equal(out, ref), (sort, max_blocks, plan)
            if max_blocks:
                assert plan[2] <= max_blocks
    w, lanes, _, wide = plan
    assert row_bytes % w == 0 and table.data_ptr() % w == 0
    # rows of >= 256 bytes that cannot be accessed 16 bytes at a time are still loaded 16 bytes at a time
    assert wide == (row_bytes >= 256 and w < 16)
    load = 16 if wide else w
    if row_bytes >= 128:
        assert lanes * load >= 128 or lanes == 32  # an instruction covers a whole line when it can


@pytest.mark.parametrize(
    ("row_bytes", "row_stride"), [(300, 320), (1000, 1024), (300, 304), (12, 16), (512, 640)]
)
@pytest.mark.parametrize("offset", [0, 4])
def test_padded_rows_are_read_at_their_stride(emu, row_bytes, row_stride, offset) -> None:
    # the table is the leading row_bytes of rows row_stride apart; the padding between them holds a marker
    # byte, so a read at the wrong stride or a stored padding byte shows in the output
    rows = 200
    g = torch.Generator().manual_seed(row_bytes + row_stride + offset)
    buf = torch.full((rows * row_stride + offset + 64,), 0xCD, dtype=torch.uint8)
    wide = buf[offset : offset + rows * row_stride].view(rows, row_stride)
    wide[:, :row_bytes] = torch.randint(0, 256, (rows, row_bytes), generator=g, dtype=torch.uint8)
    table = wide[:, :row_bytes]
    idx = torch.randint(0, rows, (500,), generator=g)
    ref = table.index_select(0, idx)
    for sort in (True, False):
        out, flag, plan = _run(emu, table, idx, sort=sort)
        assert flag.tolist() == [0, 0] and torch.equal(out, ref), (sort, plan)
    assert plan[0] == next(
        w for w in (16, 8, 4, 2, 1) if row_bytes % w == 0 and row_stride % w == 0 and offset % w == 0
    )


@pytest.mark.parametrize("row_bytes", [4, 64, 130, 512, 4096])
def test_naive_kernel_equals_index_select(emu, row_bytes) -> None:
    table = _byte_table(300, row_bytes, 0, seed=row_bytes)
    idx = torch.randint(0, 300, (500,), generator=torch.Generator().manual_seed(1))
    out, flag, _ = _run(emu, table, idx, sort=False, naive=True)
    assert flag.tolist() == [0, 0] and torch.equal(out, table.index_select(0, idx))


def test_unaligned_output_falls_back_to_narrow_stores(emu) -> None:
    table = _byte_table(100, 512, 0, seed=3)
    idx = torch.randint(0, 100, (64,), generator=torch.Generator().manual_seed(2))
    out, _, plan = _run(emu, table, idx, sort=True, out_offset=2)
    # 2-byte stores; the loads stay 16 bytes wide from aligned addresses
    assert plan[0] == 2 and plan[3] == 1 and torch.equal(out, table.index_select(0, idx))


# The naive kernel takes ids in the order given, so it is run unsorted only.
@pytest.mark.parametrize(("sort", "naive"), [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("rb", [40, 300])  # 300: the wide-load kernel's path
def test_bad_ids_flagged_and_rows_zeroed(emu, sort, naive, rb) -> None:
    rows = 50
    table = _byte_table(rows, rb, 0, seed=9)
    idx = torch.tensor([3, 50, 7, -2, 50, 49, 0], dtype=torch.int64)
    out, flag, _ = _run(emu, table, idx, sort=sort, naive=naive)
    count, value = flag.tolist()
    assert count == 3 and value in (50, -2)
    good = torch.tensor([0, 2, 5, 6])
    assert torch.equal(out[good], table.index_select(0, idx[good]))
    assert torch.equal(out[torch.tensor([1, 3, 4])], torch.zeros(3, rb, dtype=torch.uint8))


def test_all_duplicates_and_single_row(emu) -> None:
    table = _byte_table(10, 256, 0, seed=4)
    idx = torch.full((1000,), 6, dtype=torch.int32)
    out, flag, _ = _run(emu, table, idx, sort=True, max_blocks=2)
    assert flag.tolist() == [0, 0] and torch.equal(out, table[6].expand(1000, 256))
    out1, _, _ = _run(emu, table, torch.tensor([9]), sort=True)
    assert torch.equal(out1[0], table[9])
