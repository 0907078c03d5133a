"""Token data: the embedded corpus, user shards, and DALI / torch loaders yielding the same batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsx.data.tokens import WITH_DALI, load_shards, make_loader, stdlib_corpus, window_offsets


@pytest.fixture(scope="module")
def corpus():
    return stdlib_corpus(max_bytes=2 << 20)


def test_corpus_is_deterministic_bytes(corpus) -> None:
    again = stdlib_corpus(max_bytes=2 << 20)
    assert np.array_equal(corpus.train, again.train) and np.array_equal(corpus.val, again.val)
    assert corpus.vocab_size == 256 and corpus.train.max() < 256 and len(corpus.val) > 1000


def test_rank_shards_partition_the_global_batch(corpus) -> None:
    # Two ranks x accum 1 and one rank x accum 2 read the same windows, in rank / micro-batch order.
    one = make_loader(corpus.train, 16, 3, seed=9, backend="torch", grad_accum=2)
    r0 = make_loader(corpus.train, 16, 3, seed=9, rank=0, world=2, backend="torch")
    r1 = make_loader(corpus.train, 16, 3, seed=9, rank=1, world=2, backend="torch")
    for _ in range(3):
        a, b = next(one), next(one)
        assert torch.equal(a[0], next(r0)[0]) and torch.equal(b[0], next(r1)[0])


def test_targets_are_inputs_shifted(corpus) -> None:
    x, y = next(make_loader(corpus.train, 32, 4, seed=1, backend="torch"))
    assert x.shape == y.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.skipif(not WITH_DALI, reason="nvidia-dali is not installed (pip install dsx[dali])")
@pytest.mark.parametrize(("rank", "world", "accum"), [(0, 1, 1), (1, 2, 1), (0, 1, 3)])
def test_dali_and_torch_loaders_agree(corpus, rank: int, world: int, accum: int) -> None:
    a = make_loader(corpus.train, 48, 5, seed=123, rank=rank, world=world, backend="torch", grad_accum=accum)
    b = make_loader(corpus.train, 48, 5, seed=123, rank=rank, world=world, backend="dali", grad_accum=accum)
    for _ in range(7):
        (x1, y1), (x2, y2) = next(a), next(b)
        assert x2.dtype == torch.long and torch.equal(x1, x2) and torch.equal(y1, y2)


def test_shards_npy_and_bin(tmp_path) -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 1000, 5000).astype(np.uint16)
    b = rng.integers(0, 1000, 3000).astype(np.uint16)
    np.save(tmp_path / "a.npy", a)
    b.tofile(tmp_path / "b.bin")
    data = load_shards(tmp_path)
    both = np.concatenate([a, b])
    assert np.array_equal(np.concatenate([data.train, data.val]), both)
    assert data.vocab_size == int(both.max()) + 1


def test_shard_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_shards(tmp_path / "nothing")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"no \.npy or \.bin"):
        load_shards(tmp_path)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        window_offsets(10, 64, 1, 0, 0)


def test_dali_absent_without_an_nvidia_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    """find_spec("nvidia.dali") raises, not returns None, when no nvidia package exists at all."""
    import importlib.util

    from dsx.data import tokens

    def missing(name: str, package: str | None = None) -> None:
        raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}", name=name.split(".")[0])

    monkeypatch.setattr(importlib.util, "find_spec", missing)
    assert tokens.dali_available() is False
