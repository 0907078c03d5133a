"""dsx.unified: gathers equal index_select, errors say what to do, one shared copy per node, no leftovers."""

from __future__ import annotations

import importlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import dsx.direct as dsx_direct
from dsx.config import UnifiedConfig
from dsx.direct import IndexOutOfRangeError, SharedMemoryError, UnifiedTensor, unified
from dsx.direct import shm as shm_mod
from dsx.direct.gather import torch_gather
from dsx.runtime.pinning import memlock_message
from tests.harness import free_port, launcher_env, remove_shm_buffers

# the module: the package's ``unified`` is the function
unified_module = importlib.import_module("dsx.direct.unified")

ROOT = Path(__file__).resolve().parents[2]

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int64]
ROW_SHAPES = [(), (1,), (3,), (7,), (16,), (3, 5), (33,), (128,)]


def _table(rows: int, row_shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn((rows, *row_shape), generator=g).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, (rows, *row_shape), generator=g).to(dtype)


def _cfg(tmp_path: Path, **kw: object) -> UnifiedConfig:
    return UnifiedConfig(shared_memory_dir=str(tmp_path), **kw)  # type: ignore[arg-type]


@pytest.fixture
def shm_dir(tmp_path: Path):
    """A directory for shared segments: tmp_path, or one in /dev/shm where CUDA will pin the segment's
    pages (it cannot pin pages of a file on a disk or overlay filesystem, as tmp_path is on the GPU host)."""
    if not (torch.cuda.is_available() and os.path.isdir("/dev/shm")):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="dsx-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------ CPU gather


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_shape", ROW_SHAPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_cpu_gather_equals_index_select(tmp_path, dtype, row_shape, index_dtype) -> None:
    seed = hash((str(dtype), row_shape, str(index_dtype))) % 10_000
    t = _table(257, row_shape, dtype, seed)
    ut = unified(t, shared="off", config=_cfg(tmp_path))
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, 257, (300,), generator=g, dtype=torch.int64)
    idx[::7] = idx[0]  # duplicates, scattered
    ref = t.index_select(0, idx)
    got = ut.gather(idx.to(index_dtype))
    assert got.dtype == t.dtype and got.shape == ref.shape
    assert torch.equal(got, ref)
    assert torch.equal(ut[idx.to(index_dtype)], ref)


@pytest.mark.parametrize("sort", [True, False])
def test_cpu_gather_shapes_out_and_empty(tmp_path, sort) -> None:
    t = _table(50, (9,), torch.float32, 3)
    ut = unified(t, shared="off", config=_cfg(tmp_path, sort_indices=sort))
    idx2d = torch.randint(0, 50, (4, 6), dtype=torch.int32)
    assert torch.equal(ut.gather(idx2d), t[idx2d.long()])
    out = torch.full((4, 6, 9), float("nan"))
    assert ut.gather(idx2d, out=out) is out and torch.equal(out, t[idx2d.long()])
    empty = ut.gather(torch.empty(0, dtype=torch.int64))
    assert empty.shape == (0, 9)
    # A table that holds every index once, reversed: un-permuting must restore the requested order.
    rev = torch.arange(49, -1, -1)
    assert torch.equal(torch_gather(t, rev, sort=sort), t.flip(0))


def test_host_indexing_passes_through(tmp_path) -> None:
    t = _table(20, (4,), torch.float32, 5)
    ut = unified(t, shared="off", config=_cfg(tmp_path))
    assert torch.equal(ut[3], t[3]) and torch.equal(ut[2:5], t[2:5])
    assert len(ut) == 20 and ut.shape == t.shape and ut.dtype == t.dtype and ut.nbytes == t.nbytes
    assert ut.tensor.data_ptr() == t.data_ptr()  # pinned in place: no copy


@pytest.mark.parametrize(
    ("row_shape", "dtype", "stride"),
    [((75,), torch.float32, 320), ((3, 25), torch.float32, 320), ((129,), torch.bfloat16, 288),
     ((1000,), torch.uint8, 1024), ((64,), torch.float32, 256)],
)  # fmt: skip
def test_row_alignment_lays_rows_out_in_whole_sectors(tmp_path, row_shape, dtype, stride) -> None:
    t = _table(211, row_shape, dtype, seed=stride)
    row = t[0].numel() * t.element_size()
    ut = unified(t, shared="off", config=_cfg(tmp_path, row_alignment=32))
    assert ut.shape == t.shape and ut.dtype == t.dtype and torch.equal(ut.tensor, t)
    assert ut.row_stride == stride and ut.nbytes == 210 * stride + row
    if stride == row:  # already whole sectors: pinned in place
        assert ut.tensor.data_ptr() == t.data_ptr()
    else:
        # the copy starts on a page, as every table dsx allocates
        assert ut.tensor.data_ptr() != t.data_ptr() and ut.tensor.data_ptr() % 4096 == 0
        assert not ut.tensor.is_contiguous()
        # a table already laid out so is taken as it is
        assert unified(
            ut.tensor, shared="off", config=_cfg(tmp_path, row_alignment=32)
        ).tensor.data_ptr() == (ut.tensor.data_ptr())
    idx = torch.randint(0, 211, (500,), generator=torch.Generator().manual_seed(stride))
    assert torch.equal(ut.gather(idx), t.index_select(0, idx)) and torch.equal(ut[idx], t[idx])
    # the default pins a table in place, whatever its rows
    assert unified(t, shared="off", config=_cfg(tmp_path)).tensor.data_ptr() == t.data_ptr()


@pytest.mark.parametrize("align", [32, 128])
def test_row_alignment_also_aligns_where_rows_start(tmp_path, align) -> None:
    # rows 64 bytes apart, but the first starts 4 bytes past an aligned address: copied, to aligned rows
    wide = torch.randn(40, 16)
    t = wide[:, 1:]
    ut = unified(t, shared="off", config=_cfg(tmp_path, row_alignment=align))
    assert ut.tensor.data_ptr() != t.data_ptr() and ut.tensor.data_ptr() % align == 0
    assert ut.row_stride == align * -(-60 // align) and torch.equal(ut.tensor, t)
    # 128-byte rows starting on a page: pinned in place at either alignment
    packed = dsx_direct.host_empty((50, 32))
    packed.copy_(torch.randn(50, 32))
    assert unified(packed, shared="off", config=_cfg(tmp_path, row_alignment=align)).tensor.data_ptr() == (
        packed.data_ptr()
    )
    # the same rows 64 bytes into a 128-byte line (as a table torch allocated may start): pinned in place at 32,
    # copied to a page at 128
    buf = dsx_direct.host_empty((51 * 32,))
    off = buf[16 : 16 + 50 * 32].view(50, 32)
    off.copy_(packed)
    ut = unified(off, shared="off", config=_cfg(tmp_path, row_alignment=align))
    assert torch.equal(ut.tensor, packed)
    if align == 32:
        assert ut.tensor.data_ptr() == off.data_ptr()
    else:
        assert ut.tensor.data_ptr() % 4096 == 0 and ut.row_stride == 128


@pytest.mark.parametrize(
    ("shape", "dtype"), [((1000, 75), torch.float32), ((7, 3, 5), torch.bfloat16), ((4097,), torch.uint8), ((0, 8), torch.int64)]
)  # fmt: skip
def test_host_empty_starts_a_page_and_holds_what_is_written(shape, dtype) -> None:
    t = dsx_direct.host_empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert t.numel() == 0 or t.data_ptr() % 4096 == 0
    src = torch.randint(-100, 100, shape, generator=torch.Generator().manual_seed(len(shape))).to(dtype)
    t.copy_(src)
    assert torch.equal(t, src)


def test_host_empty_takes_a_length_and_refuses_a_negative_one() -> None:
    assert dsx_direct.host_empty(5, torch.int16).shape == (5,)
    for bad in ((2, -1), (-1,), -3):
        with pytest.raises(ValueError, match="negative dimension"):
            dsx_direct.host_empty(bad)


def test_a_table_pinned_off_a_line_is_named_once(tmp_path, caplog, monkeypatch) -> None:
    monkeypatch.setattr(unified_module, "_hinted", False)
    buf = dsx_direct.host_empty((41 * 64,))
    aligned, off = buf[: 40 * 64].view(40, 64), buf[16 : 16 + 40 * 64].view(40, 64)
    # rows 300 bytes apart start at every offset within a line whatever the table's start: nothing to say
    rows300 = buf[16 : 16 + 8 * 75].view(8, 75)
    with caplog.at_level("INFO", logger="dsx"):
        unified(aligned, shared="off", config=_cfg(tmp_path))
        unified(rows300, shared="off", config=_cfg(tmp_path))
        assert "128-byte line" not in caplog.text
        unified(off, shared="off", config=_cfg(tmp_path))
        unified(off, shared="off", config=_cfg(tmp_path))
    assert caplog.text.count("starts 64 bytes into a 128-byte line") == 1
    assert "host_empty" in caplog.text and "row_alignment" in caplog.text


def test_dsx_feature_tables_start_on_a_page() -> None:
    from dsx.data.mag import synthetic_mag
    from dsx.data.rmat import rmat_graph

    assert synthetic_mag(0.001, paper_features=16, num_classes=20)["paper"].x.data_ptr() % 4096 == 0
    assert rmat_graph(300, 2000, num_features=32, num_classes=4).x.data_ptr() % 4096 == 0


def test_a_column_is_a_table_of_rows_a_row_apart(tmp_path) -> None:
    # a 1-d view whose elements lie a whole row of its parent apart: rows of 4 bytes, 256 bytes apart
    x = torch.randn(100, 64)
    col = x[:, 3]
    ut = unified(col, shared="off", config=_cfg(tmp_path))
    assert ut.row_stride == 256 and ut.nbytes == 99 * 256 + 4 and ut.tensor.data_ptr() == col.data_ptr()
    idx = torch.randint(0, 100, (50,))
    assert torch.equal(ut.gather(idx), col[idx])


def test_a_0d_tensor_is_refused_as_having_no_rows() -> None:
    with pytest.raises(ValueError, match="0-d tensor has no rows"):
        unified(torch.tensor(1.0), shared="off")


@pytest.mark.parametrize("bad", [8, 24, 8192, -32, "32B", 1.5])
def test_row_alignment_rejects_what_it_cannot_lay_out(bad) -> None:
    with pytest.raises(ValueError, match="row_alignment"):
        UnifiedConfig(row_alignment=bad)  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("sort", [True, False])
def test_out_of_range_names_the_index(tmp_path, sort) -> None:
    t = _table(100, (8,), torch.float32, 7)
    ut = unified(t, shared="off", config=_cfg(tmp_path, sort_indices=sort))
    with pytest.raises(
        IndexOutOfRangeError, match=r"index 100 is out of range for a table of 100 rows.*1 of"
    ):
        ut.gather(torch.tensor([5, 100, 7]))
    with pytest.raises(IndexOutOfRangeError, match=r"index -3 is out of range.*2 of"):
        ut.gather(torch.tensor([-3, 4, 1000], dtype=torch.int32))


@pytest.mark.parametrize("bad", [torch.float32, torch.int16, torch.uint8, torch.bool])
def test_wrong_index_dtype(tmp_path, bad) -> None:
    ut = unified(_table(10, (2,), torch.float32, 1), shared="off", config=_cfg(tmp_path))
    with pytest.raises(TypeError, match=r"int32 or torch.int64"):
        ut.gather(torch.zeros(3, dtype=bad))


def test_bad_inputs(tmp_path) -> None:
    t = _table(10, (6,), torch.float32, 2)
    with pytest.raises(ValueError, match="contiguous"):
        unified(t.t(), shared="off")
    with pytest.raises(ValueError, match="shared="):
        unified(t, shared="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        unified(t.numpy(), shared="off")  # type: ignore[arg-type]
    ut = unified(t, shared="off", config=_cfg(tmp_path))
    with pytest.raises(ValueError, match="expected shape"):
        ut.gather(torch.tensor([1, 2]), out=torch.empty(3, 6))


def test_memlock_message_uses_real_limits() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    msg = memlock_message(64 << 30, "out of memory (cudaError 2)")

    def shown(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else f"{v} bytes"

    assert f"soft {shown(soft)}" in msg and f"hard {shown(hard)}" in msg and "RLIMIT_MEMLOCK" in msg
    assert "ulimit -l unlimited" in msg and "--ulimit memlock=-1" in msg
    if soft != resource.RLIM_INFINITY:
        assert "larger than the limit" in msg  # 64 GiB is above any limited soft value seen in practice
    small = memlock_message(1, "x", limits=(1 << 20, 1 << 20))
    assert "larger than the limit" not in small and "1.0 MiB" in small


def test_shm_too_small_names_sizes_and_fix(tmp_path) -> None:
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    needed = free + (5 << 30)
    with pytest.raises(SharedMemoryError) as err:
        shm_mod.check_space(str(tmp_path), needed)
    msg = str(err.value)
    assert str(tmp_path) in msg and f"({needed} bytes)" in msg and "--shm-size" in msg
    assert "shared_memory_dir" in msg
    shm_mod.check_space(str(tmp_path), 1)  # a byte fits


# ---------------------------------------------------------------------------------- shared segments


def test_shared_single_process_unlinks_and_maps(shm_dir) -> None:
    t = _table(300, (17,), torch.float32, 11)
    with unified(t, shared="on", name="one proc", config=_cfg(shm_dir)) as ut:
        assert isinstance(ut, UnifiedTensor) and ut.shared
        assert os.listdir(shm_dir) == []  # unlinked as soon as every local rank mapped it
        assert ut.tensor.data_ptr() != t.data_ptr() and torch.equal(ut.tensor, t)
        with open("/proc/self/maps") as f:
            maps = [ln for ln in f if str(shm_dir) in ln]
        assert maps and all(ln.rstrip().endswith("(deleted)") for ln in maps)
        idx = torch.randint(0, 300, (64,))
        assert torch.equal(ut[idx], t[idx])
    ut.close()  # a second close is a no-op
    empty = unified(torch.empty(0, 4), shared="on", config=_cfg(shm_dir))
    assert empty.shape == (0, 4) and empty[torch.empty(0, dtype=torch.int64)].shape == (0, 4)
    assert os.listdir(shm_dir) == []


def test_a_shared_copy_lays_rows_out_at_the_alignment(shm_dir) -> None:
    # the node's one copy is laid out padded where asked: no second copy
    for row_shape, cfg, stride in (((75,), {"row_alignment": 32}, 320), ((75,), {}, 300), ((17,), {}, 68),
                                   ((17,), {"row_alignment": 16}, 80), ((64,), {"row_alignment": 32}, 256)):  # fmt: skip
        t = _table(300, row_shape, torch.float32, seed=stride)
        with unified(t, shared="on", config=_cfg(shm_dir, **cfg)) as ut:
            assert ut.row_stride == stride and torch.equal(ut.tensor, t)
            idx = torch.randint(0, 300, (64,))
            assert torch.equal(ut[idx], t[idx])
    assert os.listdir(shm_dir) == []


def test_leader_without_data_fails_everywhere(shm_dir) -> None:
    with pytest.raises(SharedMemoryError, match="must pass the tensor"):
        unified(None, shared="on", config=_cfg(shm_dir))
    with pytest.raises(ValueError, match="every rank must pass its tensor"):
        unified(None, shared="off", config=_cfg(shm_dir))
    assert os.listdir(shm_dir) == []


def _two_rank_job(tmp_path: Path, accelerator: str) -> None:
    """2 ranks via the deepspeed launcher (gloo): same pages (Pss = Rss / 2), then one rank is SIGKILLed."""
    out, shm_dir = tmp_path / "out", tmp_path / "shm"
    out.mkdir()
    if torch.cuda.is_available() and os.path.isdir("/dev/shm"):
        # The worker pins the segment wherever CUDA is present (also with the CPU accelerator), and CUDA
        # cannot pin pages of a file on a disk/overlay filesystem (tmp_path on the GPU host): use tmpfs.
        shm_dir = Path(tempfile.mkdtemp(prefix="dsx-test-", dir="/dev/shm"))
    else:
        shm_dir.mkdir()
    try:
        _two_rank_job_in(tmp_path, out, shm_dir, accelerator)
    finally:
        if str(shm_dir).startswith("/dev/shm/"):
            shutil.rmtree(shm_dir, ignore_errors=True)


def _two_rank_job_in(tmp_path: Path, out: Path, shm_dir: Path, accelerator: str) -> None:
    env = launcher_env({"DS_ACCELERATOR": accelerator})
    if accelerator == "cuda":
        env.pop("CUDA_VISIBLE_DEVICES", None)
    port = free_port()
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
        str(ROOT / "tests" / "direct" / "_unified_worker.py"), str(out), str(shm_dir), "kill",
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    finally:
        remove_shm_buffers(port)  # the killed rank cannot unlink DeepSpeed's all-reduce buffer
    missing = [r for r in range(2) if not (out / f"rank{r}.json").is_file()]
    assert not missing, (
        f"ranks {missing} wrote no report; launcher output:\n{(proc.stdout + proc.stderr)[-6000:]}"
    )
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert proc.returncode != 0, "the killed rank must make the job fail"
    for rep in reports:
        assert rep["shared"] and rep["group"] == [0, 1] and rep["equal"] and rep["gather_ok"]
        assert rep["files_after_unified"] == []
        assert rep["seen_write"] == 4242.0  # rank 0's write after mapping is visible: the same pages
        sm = rep["smaps"]
        assert sm["mappings"] >= 1 and sm["deleted"] == sm["mappings"]
        # Both ranks touched every page: each is charged half (Pss), so the node holds one copy, not two.
        assert sm["Rss"] >= rep["nbytes"] // 1024 * 0.95
        assert sm["Pss"] <= sm["Rss"] * 0.6
    assert os.listdir(shm_dir) == [], "a killed rank must leave nothing in the shared-memory directory"


@pytest.mark.slow
def test_two_ranks_share_one_copy_and_killed_rank_leaves_nothing(tmp_path) -> None:
    _two_rank_job(tmp_path, "cpu")


@pytest.mark.multigpu
def test_two_gpu_ranks_register_and_gather_the_shared_copy(tmp_path) -> None:
    _two_rank_job(tmp_path, "cuda")  # the worker also gathers on its own GPU from the shared pages


def test_an_engine_installs_its_section_as_the_defaults(tmp_path) -> None:
    """dsx.initialize with an enabled "unified" section: the engine's section is the process default while the
    engine lives (a unified tensor made then follows it); closing the engine restores the defaults."""
    import dsx
    from dsx import defaults

    section = {"enabled": True, "shared": "off", "sort_indices": False, "shared_memory_dir": str(tmp_path),
               "backend": "torch"}  # fmt: skip
    model = torch.nn.Linear(4, 4)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"torch_adam": True}},
              "dsx": {"unified": section}}  # fmt: skip
    engine, _, _, _ = dsx.initialize(model=model, model_parameters=model.parameters(), config=config)
    runtime = dsx.runtime_of(engine)
    try:
        feature = runtime.features["unified"]
        assert feature.section is runtime.config.unified is defaults.get("unified")
        ut = unified(_table(30, (5,), torch.float32, 8))
        assert ut.config is runtime.config.unified and not ut.shared and not ut.config.sort_indices
        idx = torch.tensor([4, 4, 29, 0])
        assert torch.equal(ut[idx], ut.tensor[idx])
    finally:
        runtime.close()
    assert defaults.get("unified") is not runtime.config.unified
    assert ut.config is defaults.get("unified")  # no config of its own: it follows the defaults


def test_gathers_follow_the_defaults_of_the_moment(tmp_path) -> None:
    from dsx import defaults

    t = _table(40, (3,), torch.float32, 12)
    ut = unified(t, shared="off")
    fixed = unified(t, shared="off", config=_cfg(tmp_path, sort_indices=False))
    assert ut.config.sort_indices and ut.config is defaults.get("unified")
    with defaults.set("unified", sort_indices=False, backend="torch"):
        assert not ut.config.sort_indices and ut.config.backend == "torch"
        idx = torch.tensor([3, 1, 3, 39])
        assert torch.equal(ut[idx], t[idx]) and torch.equal(fixed[idx], t[idx])
    assert ut.config.sort_indices and fixed.config.sort_indices is False  # an explicit section stays
    assert "configure" not in dsx_direct.__all__ and not hasattr(unified_module, "_config")


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU-only torch message")
def test_op_builder_says_why_it_cannot_build_here() -> None:
    from dsx.ops import UnifiedGatherBuilder, load_unified_gather

    b = UnifiedGatherBuilder()
    assert all(Path(p).is_file() for p in b.sources()) and b.absolute_name() == "dsx.ops.dsx_unified_gather"
    assert not b.is_compatible()
    with pytest.raises(RuntimeError, match="built without CUDA"):
        load_unified_gather()
    with pytest.raises(RuntimeError, match="built without CUDA"):  # remembered, not rebuilt per call
        load_unified_gather()


def run_bench_gather_quick(out: Path, sizes: tuple[str, ...] = ("--quick",)) -> list[dict]:
    """``bench_gather`` at tiny ``sizes`` into ``out`` (``--quick``: the CPU paths only); its results, each
    method's output checked against ``index_select``."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_gather
    finally:
        sys.path.pop(0)
    report = bench_gather.main([*sizes, "--out", str(out)])
    assert (out / "bench_gather.json").is_file() and (out / "bench_gather.png").is_file()
    saved = json.loads((out / "bench_gather.json").read_text())
    assert saved["env"]["torch"] == torch.__version__ and len(saved["results"]) == len(report["results"]) == 2
    for rec in saved["results"]:
        assert all(rec["correct"].values()), rec["correct"]
        assert rec["gb_per_s"]["dsx"] > 0
    return saved["results"]


def test_bench_gather_quick_smoke(tmp_path) -> None:
    run_bench_gather_quick(tmp_path)


def test_a_row_off_whole_sectors_is_bounded_by_the_row_rounded_up_to_them() -> None:
    """bench_gather's sector bound: a 300-byte row costs the 10 sectors of a 320-byte row, so its fraction of the
    ceiling is at most the 320-byte rows', times 300/320, times the distinct rows each reads (a duplicate is read
    once); a row of whole sectors, or one whose rounded size was not measured, gets no bound."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_gather
    finally:
        sys.path.pop(0)
    r300 = {"row_bytes": 300, "unique_fraction": 0.96, "fraction_of_ceiling": {"dsx_queued": 0.85}}
    r320 = {"row_bytes": 320, "unique_fraction": 0.95, "fraction_of_ceiling": {"dsx_queued": 0.93}}
    bench_gather._sector_bound(r300, r320)
    assert r300["sector_bound"] == {"of_ceiling_queued": round(0.93 * 300 / 320 * 0.95 / 0.96, 3),
                                    "from_row_bytes": 320}  # fmt: skip
    bench_gather._sector_bound(r320, r320)
    r1000 = {"row_bytes": 1000, "unique_fraction": 0.9, "fraction_of_ceiling": {"dsx_queued": 1.0}}
    bench_gather._sector_bound(r1000, None)
    assert "sector_bound" not in r320 and "sector_bound" not in r1000
