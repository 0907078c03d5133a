"""dsx.unified on a GPU: the zero-copy kernel equals index_select for every row size, dtype and index type;
out-of-range indices raise (at once or deferred) and leave no sticky CUDA error; registration is counted."""

from __future__ import annotations

import pytest
import torch

import dsx
from dsx.config import UnifiedConfig
from dsx.direct import IndexOutOfRangeError, unified
from tests.direct.test_unified import _table, run_bench_gather_quick

ROW_BYTES = [4, 5, 12, 16, 31, 64, 100, 128, 130, 256, 300, 512, 1000, 1001, 1024, 2052, 4096]


def _gpu_table(rows: int, row_bytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, row_bytes), generator=g, dtype=torch.uint8)


@pytest.mark.gpu
def test_gpu_bench_gather_checks_every_method_against_its_own_table(tmp_path) -> None:
    """Every method the benchmark times on a GPU returns the rows ``index_select`` gives from the table it read:
    the one 64 bytes into the buffer (other bytes than the page-aligned table's) against its own rows."""
    tiny = (
        "--table-mb",
        "8",
        "--num-indices",
        "4096",
        "--row-bytes",
        "64",
        "516",
        "--repeats",
        "2",
        "--rounds",
        "1",
    )
    results = run_bench_gather_quick(tmp_path, (*tiny, "--sweep-sms", "4"))
    assert "dsx_sms4" in results[0]["correct"] and "dsx_queued_off64" in results[-1]["correct"]


@pytest.mark.gpu
def test_gpu_jit_build_of_the_op() -> None:
    from dsx.ops import UnifiedGatherBuilder, load_unified_gather

    assert UnifiedGatherBuilder().is_compatible(verbose=True)
    ext = load_unified_gather(verbose=True)
    assert hasattr(ext, "gather") and hasattr(ext, "naive_gather")


@pytest.mark.gpu
@pytest.mark.parametrize("row_bytes", ROW_BYTES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("sort", [True, False])
def test_gpu_kernel_equals_index_select(row_bytes, index_dtype, sort) -> None:
    t = _gpu_table(5003, row_bytes, row_bytes)
    ut = unified(t, shared="off", config=UnifiedConfig(backend="cuda", sort_indices=sort))
    assert ut.is_pinned
    g = torch.Generator().manual_seed(row_bytes + 1)
    idx = torch.randint(0, 5003, (20_000,), generator=g)
    idx[::5] = idx[3]  # a long run of one duplicate plus scattered ones
    ref = t.index_select(0, idx).cuda()
    got = ut.gather(idx.to(index_dtype).cuda())
    assert got.device.type == "cuda" and torch.equal(got, ref)
    assert ut.gather(torch.empty(0, dtype=index_dtype, device="cuda")).shape == (0, row_bytes)
    ut.close()


@pytest.mark.gpu
@pytest.mark.parametrize(("row_bytes", "align"), [(300, 32), (1000, 32), (258, 32), (12, 16), (300, 128)])
@pytest.mark.parametrize("sort", [True, False])
def test_gpu_padded_rows_equal_index_select(row_bytes, align, sort) -> None:
    t = _gpu_table(4099, row_bytes, row_bytes + align)
    cfg = UnifiedConfig(backend="cuda", sort_indices=sort, row_alignment=align)
    with unified(t, shared="off", config=cfg) as ut:
        assert ut.row_stride == -(-row_bytes // align) * align and ut.is_pinned
        idx = torch.randint(0, 4099, (15_000,), generator=torch.Generator().manual_seed(row_bytes))
        idx[::6] = idx[1]
        assert torch.equal(ut.gather(idx.cuda()), t.index_select(0, idx).cuda())
        with pytest.raises(IndexOutOfRangeError, match="index 4099"):
            ut.gather(torch.tensor([3, 4099], device="cuda"))


@pytest.mark.gpu
def test_gpu_tables_whose_rows_lie_apart_are_read_in_place() -> None:
    # a caller's own padded table (rows of 300 bytes, 301 apart) and a column (rows of 4 bytes, 256 apart)
    wide = _gpu_table(3001, 301, 7)
    x = torch.randn(3001, 64)
    for t in (wide[:, :300], x[:, 5]):
        with unified(t, shared="off") as ut:  # (follows the defaults set below)
            assert ut.tensor.data_ptr() == t.data_ptr() and ut.is_pinned
            idx = torch.randint(0, 3001, (7000,), generator=torch.Generator().manual_seed(3))
            for sort in (True, False):
                with dsx.defaults.set("unified", UnifiedConfig(backend="cuda", sort_indices=sort)):
                    assert torch.equal(ut.gather(idx.cuda()), t.index_select(0, idx).cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
def test_gpu_dtypes_and_unaligned_views(dtype) -> None:
    t = _table(3001, (37,), dtype, 9)
    with unified(t, shared="off", config=UnifiedConfig(backend="cuda")) as ut:
        idx = torch.randint(0, 3001, (4000,), device="cuda")
        assert torch.equal(ut[idx], t[idx.cpu()].cuda())
        # An out buffer at an odd offset forces the narrow-load path.
        base = torch.empty(4000 * 37 + 1, dtype=dtype, device="cuda")
        out = base[1:].view(4000, 37)
        assert torch.equal(ut.gather(idx, out=out), t[idx.cpu()].cuda())


@pytest.mark.gpu
def test_gpu_out_of_range_raises_sync_and_deferred() -> None:
    t = _gpu_table(1000, 64, 3)
    ut = unified(t, shared="off", config=UnifiedConfig(backend="cuda"))
    with pytest.raises(IndexOutOfRangeError, match="index 1000 is out of range"):
        ut.gather(torch.tensor([1, 1000, 2], device="cuda"))
    with pytest.raises(IndexOutOfRangeError, match="index -1 is out of range"):
        ut.gather(torch.tensor([-1, 5], device="cuda", dtype=torch.int32))
    out = ut.gather(torch.tensor([4, 5000, 6], device="cuda"), check="deferred")
    torch.cuda.synchronize()
    assert torch.equal(out[1].cpu(), torch.zeros(64, dtype=torch.uint8))  # zeroed, never garbage
    assert torch.equal(out[0].cpu(), t[4])
    with pytest.raises(IndexOutOfRangeError, match="index 5000"):
        ut.check()
    ut.gather(torch.tensor([3, 9999], device="cuda"), check="deferred")
    with pytest.raises(IndexOutOfRangeError, match="index 9999"):
        ut.close()
    # torch's own launch checks still pass (no sticky error left behind).
    torch.ones(4, device="cuda").sum().item()


@pytest.mark.gpu
def test_gpu_bounded_sms_and_side_stream_give_same_result() -> None:
    t = _gpu_table(20_000, 512, 4)
    idx = torch.randint(0, 20_000, (100_000,), device="cuda")
    ref = t.index_select(0, idx.cpu()).cuda()
    with unified(t, shared="off", config=UnifiedConfig(backend="cuda", max_gather_sms=2)) as ut:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got = ut.gather(idx, check="deferred")
        a = torch.randn(2048, 2048, device="cuda")
        _ = a @ a  # training-like work on the main stream meanwhile
        torch.cuda.current_stream().wait_stream(side)
        ut.check()
        assert torch.equal(got, ref)


@pytest.mark.gpu
def test_gpu_torch_backend_and_reregistration() -> None:
    t = _gpu_table(4000, 100, 6)
    idx = torch.randint(0, 4000, (3000,), device="cuda")
    ref = t.index_select(0, idx.cpu()).cuda()
    a = unified(t, shared="off", config=UnifiedConfig(backend="torch"))
    b = unified(t, shared="off", config=UnifiedConfig(backend="cuda"))  # same address: counted, not an error
    assert torch.equal(a.gather(idx), ref) and torch.equal(b.gather(idx), ref)
    a.close()
    assert b.is_pinned and torch.equal(b.gather(idx), ref)  # still registered for b
    b.close()
    c = unified(t, shared="off", config=UnifiedConfig(backend="cuda"))  # registers again after full release
    assert torch.equal(c.gather(idx), ref)
    c.close()
