"""``python -m tests.faults --trials 200 --out /tmp/faults.json``: the fault-injection harness (docs/faults.md).

Runs each job clean first (its losses and parameter digest are the reference), then the trials, cycling
through every (job, fault kind) pair with parameters drawn from ``--seed``; prints a tally per job and fault
and writes every trial (job, fault, params, outcome, evidence) to ``--out``. Exit status 1 when a trial ended
outside its kind's allowed outcomes (any ``wrong``, ``leak``, ``hang`` or ``unclear`` among them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tests.faults.session import Session, format_tally, tally
from tests.faults.trials import JOBS, Trial

__all__ = ["main", "plan"]


def plan(trials: int, jobs: list[str], kinds: list[str] | None) -> list[tuple[str, str]]:
    """The (job, fault kind) of each trial: every pair in turn, so that each gets about trials / pairs."""
    pairs = [(j, k) for j in jobs for k in JOBS[j].kinds if kinds is None or k in kinds]
    if not pairs:
        raise SystemExit(f"no fault kind of {jobs} among {kinds}")
    return [pairs[i % len(pairs)] for i in range(trials)]


def _write(out: Path, meta: dict[str, Any], done: list[Trial], session: Session) -> None:
    table = {f"{job}/{fault}": dict(c) for (job, fault), c in sorted(tally(done).items())}
    record = {"meta": meta | {"baselines": {k: b.evidence() for k, b in session.baselines.items()},
                              "owners": sorted(session.owners.records), "notes": session.owners.notes},
              "tally": table, "trials": [t.to_json() for t in done]}  # fmt: skip
    out.write_text(json.dumps(record, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--trials", type=int, default=200, help="trials in all (spread over every job and fault)")
    p.add_argument("--out", default="faults.json", help="the JSON record of every trial")
    p.add_argument("--seed", type=int, default=0, help="seeds every drawn fault parameter")
    p.add_argument("--jobs", default="gpt,sage", help="comma-separated: gpt (main job), sage (GNN job)")
    p.add_argument("--kinds", default=None, help="comma-separated fault kinds to try (default: every one)")
    p.add_argument(
        "--timeout", type=float, default=None, help="seconds a trial may run (default: from the clean run)"
    )
    p.add_argument(
        "--baseline-repeats", type=int, default=2, help="clean runs per job, which must agree bitwise"
    )
    p.add_argument("--keep", action="store_true", help="keep each trial's directories (output, logs, config)")
    args = p.parse_args(argv)
    jobs = [j for j in args.jobs.split(",") if j]
    unknown = [j for j in jobs if j not in JOBS]
    if unknown:
        p.error(f"unknown job(s) {unknown}; choose from {sorted(JOBS)}")
    order = plan(args.trials, jobs, args.kinds.split(",") if args.kinds else None)
    out = Path(args.out)
    meta: dict[str, Any] = {"seed": args.seed, "trials": args.trials, "jobs": jobs, "started": time.time()}
    t0 = time.monotonic()
    done: list[Trial] = []
    with Session(args.seed, args.timeout, args.baseline_repeats, args.keep) as session:
        for job in jobs:
            print(f"clean {job} run x{args.baseline_repeats} ...", flush=True)
            b = session.baseline(job)
            print(
                f"  {len(b.losses)} steps, digest {b.digest[:16]}, {b.wall_s:.1f} s, I/O per rank {b.counts}"
            )
        bar = tqdm(order, desc="trials", unit="trial", file=sys.stdout)
        for i, (job, kind) in enumerate(bar):
            done.append(session.trial(i, job, kind))
            bad = sum(not t.allowed for t in done)
            bar.set_postfix(job=job, fault=kind, outcome=done[-1].outcome, not_allowed=bad)
            meta["wall_s"] = time.monotonic() - t0
            _write(out, meta, done, session)  # after every trial: a long run can be read as it goes
        bar.close()
    wall = time.monotonic() - t0
    meta["wall_s"] = wall
    print(format_tally(done, wall))
    print(f"trials written to {out}")
    return 0 if all(t.allowed for t in done) else 1


if __name__ == "__main__":
    sys.exit(main())
