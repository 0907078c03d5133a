"""benchmarks/_memory_trace.py: the replay that finds what is live at a step's peak."""

from __future__ import annotations

import random

from benchmarks import _memory_trace


def _frames(*where: tuple[str, int, str]) -> list[dict]:
    return [{"filename": f, "line": ln, "name": n} for f, ln, n in where]


def test_live_at_peak_replays_allocations_and_groups_them_by_line() -> None:
    rng = random.Random(2)
    torch_f = ("/x/site-packages/torch/nn/functional.py", 10, "linear")
    model_f = ("/x/megatron/core/transformer/mlp.py", 42, "forward")
    dsx_f = ("/x/dsx/offload/transfer.py", 201, "_read")
    events, live, cur, peak, want = [], {}, 0, 0, {}
    addr = 0
    # before recording: a free of a block the log never saw allocated is ignored
    events.append({"action": "free_requested", "addr": 10**9, "size": 1 << 30})
    for _ in range(300):
        if live and rng.random() < 0.45:
            a = rng.choice(sorted(live))
            size, _ = live.pop(a)
            events.append({"action": "free_requested", "addr": a, "size": size})
            events.append({"action": "free_completed", "addr": a, "size": size})
            cur -= size
            continue
        addr += 1
        size = rng.randint(1, 1000) * 512
        frames = rng.choice(
            [_frames(torch_f, model_f), _frames(torch_f, model_f, dsx_f), _frames(torch_f, dsx_f)]
        )
        events.append({"action": "alloc", "addr": addr, "size": size, "frames": frames})
        live[addr] = (size, _memory_trace._where(frames))
        cur += size
        if cur > peak:
            peak = cur
            want = {}
            for s, w in live.values():
                want[w] = want.get(w, 0) + s
    out = _memory_trace.live_at_peak({"device_traces": [events]})
    assert out["peak_bytes_since_recording"] == peak > 0
    assert {r["where"]: r["bytes"] for r in out["live_at_peak"]} == want
    assert set(want) == {
        "mlp.py:42 forward",
        "mlp.py:42 forward <- transfer.py:201 _read",
        "transfer.py:201 _read",
    }
    assert out["other_bytes"] == 0
    # at the end instead: what is live after the last event (where an allocation failed), not at the peak
    end: dict[str, int] = {}
    for s, w in live.values():
        end[w] = end.get(w, 0) + s
    assert end != want  # (the run ends below its peak: the two must differ for this to test anything)
    out = _memory_trace.live_at_peak({"device_traces": [events]}, at="end")
    assert out["peak_bytes_since_recording"] == peak
    assert {r["where"]: r["bytes"] for r in out["live_at_peak"]} == end
