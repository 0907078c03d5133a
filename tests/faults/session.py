"""A harness session: its working directories, the sentinel owners, one clean baseline per job, the seeded
draws of each trial's fault parameters, and the tally of outcomes."""

from __future__ import annotations

import random
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from dsx.testing.faults import SETUP_POINTS
from tests.faults.trials import JOBS, OUTCOMES, Baseline, Owners, Trial, baseline, run_trial

__all__ = ["Session", "draw", "format_tally", "tally"]


def _nth(base: Baseline, rank: int, op: str, rng: random.Random) -> int:
    """An operation number the clean run reached on ``rank`` (so that the fault fires)."""
    return rng.randint(1, max(1, base.counts.get(rank, {}).get(op, 1)))


def draw(kind: str, job: str, base: Baseline, rng: random.Random) -> dict[str, Any]:
    """Random parameters of one ``kind`` trial on ``job`` (the injector's FaultSpec fields; a sigkill's
    rank, anchor and delay), from the clean run's counts and timings."""
    rank = rng.randint(0, 1)
    seed = rng.randint(0, 2**31 - 1)
    if kind == "io_error":
        op = rng.choice(["read", "write"])
        return {"op": op, "rank": rank, "nth": _nth(base, rank, op, rng)}
    if kind == "short_read":  # 0 bytes reads as an end of file; more is a short count dsx must retry
        return {"rank": rank, "nth": _nth(base, rank, "read", rng), "keep": 4096 * rng.randint(0, 3)}
    if kind == "enospc":
        return {"rank": rank, "nth": _nth(base, rank, "write", rng)}
    if kind == "slow_io":
        params: dict[str, Any] = {"ms": round(rng.uniform(1.0, 20.0), 1), "seed": seed}
        return params | ({"rank": rank} if rng.random() < 0.5 else {})
    if kind == "corrupt":
        return {"rank": rank, "nth": _nth(base, rank, "write", rng), "nbytes": rng.choice([1, 4, 16, 64]),
                "seed": seed}  # fmt: skip
    if kind == "sigkill":
        # half the kills anywhere in the run, half once dsx has made its first file (its files at stake)
        anchor = "dsx" if job == "gpt" and base.dsx_seen_s is not None and rng.random() < 0.5 else "launch"
        span = max(0.0, base.ranks_end_s - (base.dsx_seen_s or 0.0)) if anchor == "dsx" else base.ranks_end_s
        # (0.85: a trial may run faster than the clean run did; a kill after the rank ended tests nothing)
        return {"rank": rank, "anchor": anchor, "delay_s": round(rng.uniform(0.0, 0.85 * span), 3)}
    if kind == "shm_enospc":
        return {"nth": 1}
    if kind == "sigkill_setup":
        return {"at": rng.choice(SETUP_POINTS)}
    raise ValueError(f"no draw for fault kind {kind!r}")


class Session:
    """Working directories (removed at close), the sentinel owners, and one baseline per job."""

    def __init__(
        self,
        seed: int = 0,
        timeout: float | None = None,
        repeats: int = 1,
        keep: bool = False,
        workdir: str | None = None,
    ) -> None:
        self.rng = random.Random(seed)
        self.timeout, self.repeats, self.keep = timeout, repeats, keep
        self.work = Path(tempfile.mkdtemp(prefix="dsx-faults-", dir=workdir))
        self.shm_work = Path(tempfile.mkdtemp(prefix="dsxfaults-", dir="/dev/shm"))
        self.owners = Owners()
        self.baselines: dict[str, Baseline] = {}

    def job_timeout(self, job: str) -> float:
        """A trial's limit: well above a clean run's time (two cores may be shared with other work)."""
        return self.timeout or max(150.0, 6 * self.baseline(job).wall_s)

    def baseline(self, job: str) -> Baseline:
        if job not in self.baselines:
            self.baselines[job] = baseline(
                JOBS[job], self.work, self.shm_work, self.timeout or 600, self.repeats
            )
        return self.baselines[job]

    def trial(
        self,
        index: int,
        job: str,
        kind: str,
        params: dict[str, Any] | None = None,
        offload: dict[str, Any] | None = None,
    ) -> Trial:
        """Run one trial (parameters drawn unless given); ``offload`` changes the job's offload section."""
        base = self.baseline(job)
        if params is None:
            params = draw(kind, job, base, self.rng)
        t = Trial(index, job, kind, params)
        return run_trial(t, JOBS[job], base, self.owners, self.work, self.shm_work, self.job_timeout(job),
                         offload=offload, keep=self.keep)  # fmt: skip

    def close(self) -> None:
        self.owners.close()
        if not self.keep:
            shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.shm_work, ignore_errors=True)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tally(trials: list[Trial]) -> dict[tuple[str, str], Counter[str]]:
    """(job, fault) -> outcome counts, with ``not_allowed`` counting the trials outside their kind's set."""
    out: dict[tuple[str, str], Counter[str]] = {}
    for t in trials:
        c = out.setdefault((t.job, t.fault), Counter())
        c[t.outcome] += 1
        c["not_allowed"] += not t.allowed
    return out


def format_tally(trials: list[Trial], wall_s: float) -> str:
    """The tally as a text table: a row per job and fault, a column per outcome, totals last."""
    table = tally(trials)
    cols = [*OUTCOMES, "not_allowed"]
    head = f"{'job':<6} {'fault':<14} {'trials':>6} " + " ".join(f"{c:>11}" for c in cols)
    lines = [head, "-" * len(head)]
    total: Counter[str] = Counter()
    for (job, fault), c in sorted(table.items()):
        n = sum(c[o] for o in OUTCOMES)
        total.update(c)
        lines.append(f"{job:<6} {fault:<14} {n:>6} " + " ".join(f"{c[o]:>11}" for o in cols))
    lines.append("-" * len(head))
    n = sum(total[o] for o in OUTCOMES)
    lines.append(f"{'all':<6} {'':<14} {n:>6} " + " ".join(f"{total[o]:>11}" for o in cols))
    lines.append(f"wall time {wall_s / 60:.1f} min ({wall_s / max(n, 1):.1f} s a trial)")
    return "\n".join(lines)
