"""The fault harness's CI subset: one trial each of ``io_error``, ``enospc``, ``corrupt`` and ``sigkill`` on
the main job (``short_read`` is retried, ``slow_io`` waited out: their trials end equal and run in the full
harness, ``python -m tests.faults``; test_injector.py tests the retry), the two shared-memory faults on the GNN
job, and proof that the classification can fail (docs/faults.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.faults.session import Session
from tests.faults.trials import ALLOWED, JOBS

pytestmark = pytest.mark.slow

CASES = [("gpt", kind) for kind in ("io_error", "enospc", "corrupt", "sigkill")] + [
    ("sage", "shm_enospc"),
    ("sage", "sigkill_setup"),
]
assert all(kind in JOBS[job].kinds for job, kind in CASES)


@pytest.fixture(scope="module")
def session() -> Iterator[Session]:
    with Session(seed=2024, repeats=1) as s:  # one clean run per job: any nondeterminism shows as ``wrong``
        yield s


@pytest.mark.parametrize(("job", "kind"), CASES)
def test_a_fault_ends_equal_or_in_a_clear_error(session: Session, job: str, kind: str) -> None:
    t = session.trial(CASES.index((job, kind)), job, kind)
    # the whole record, output tail included (pytest shortens a dict's repr to its first keys)
    record = json.dumps(t.to_json(), indent=1, default=str)
    assert t.outcome not in ("wrong", "leak", "hang", "unclear"), record
    assert t.allowed, record
    if t.evidence["fired"]:
        assert t.outcome in ALLOWED[kind], record


def test_the_harness_sees_a_silent_corruption(session: Session) -> None:
    """With verify off, flipped bytes in the SSD file reach the gradients: the trial must not pass."""
    t = session.trial(len(CASES), "gpt", "corrupt", offload={"verify": False})
    record = t.to_json()
    assert t.evidence["fired"], record
    assert t.outcome in ("wrong", "unclear") and not t.allowed, record
