"""dsx.runtime.bandwidth: the tier probes activation offload plans with, and the share the ranks of a node agree
on."""

from __future__ import annotations

import pytest

from dsx.runtime.bandwidth import (
    TierBandwidth,
    measure_file_bandwidth,
    measure_host_bandwidth,
    measure_tier_bandwidth,
)


def test_bandwidth_probes_measure_real_transfers(tmp_path) -> None:
    res = measure_file_bandwidth(tmp_path, mb=8)
    assert res["write_GBps"] > 0 and res["read_GBps"] > 0 and res["bytes"] == 8 << 20
    assert not list(tmp_path.iterdir())
    w, r = measure_host_bandwidth(16)
    assert w > 0 and r > 0
    tiers = measure_tier_bandwidth(["host", "ssd"], tmp_path, mb=8)
    assert [t.tier for t in tiers] == ["host", "ssd"] and all(t.write_Bps > 0 for t in tiers)
    with pytest.raises(OSError, match="not a writable directory"):
        measure_file_bandwidth(tmp_path / "missing")


def _agree_worker(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from dsx.runtime import bandwidth

        # each rank "measures" a different share; the agreed one is the smallest, the same on both ranks
        own = [TierBandwidth("host", 10e9 * (rank + 1), 20e9 / (rank + 1))]
        q.put((rank, [(b.tier, b.write_Bps, b.read_Bps) for b in bandwidth._agree(own, [0, 1])]))
    finally:
        dist.destroy_process_group()


def test_ranks_of_a_node_agree_on_the_smallest_share(caplog) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_agree_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert got[0] == got[1] == [("host", 10e9, 10e9)]
