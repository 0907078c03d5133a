"""What verifying SSD reads costs: the SSD tier with its default integrity check and without, interleaved.

``bench_offload.py`` with ``offload_all`` to the SSD tier (``dsx_ssd``) and the same with ``"verify": false``
(``dsx_ssd_noverify``), each in its own process, ``--repeats`` rounds of both, at the offload benchmark's shape;
the JSON's ``ratios.verify`` gives each config's step times, their medians' ratio, the bytes checked a step
and the device's checksum rate (so the device time verifying takes a step, beside the measured difference,
which a drive-bound step's spread can hide). ``ratios.ssd_tier_vs_drive`` sets the tier's write and read rates
while it had work against the drive's (``dsx report --io``'s sequential 4 MiB O_DIRECT write and read, 2 GiB,
measured in the same directory after each run). One measured step a run: on a drive of 2 GB/s a step
takes about 20 s. Every other option is ``bench_offload.py``'s.

    python benchmarks/bench_offload_ssd.py --out benchmarks/results      # suite offload-ssd
    python benchmarks/bench_offload_ssd.py --quick                        # CPU smoke test
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_offload

DEFAULTS = ["--configs", "dsx_ssd", "dsx_ssd_noverify", "--repeats", "3", "--warmup", "1", "--steps", "1",
            "--pool-gb", "20", "--child-timeout", "100", "--name", "bench_offload_ssd", "--section", "verify"]  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``bench_offload.main`` with this benchmark's configs and defaults; later arguments override them."""
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
    return bench_offload.main([*DEFAULTS, *args])


if __name__ == "__main__":
    main()
