"""The saved-tensor-hook offload baseline of bench_offload (``hooks_offload``): gradients bitwise equal to no
offload on the Llama model, every large saved tensor moved and nothing else; on CUDA, through pinned buffers
and side streams. The bench runs it beside dsx on the Llama model."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import _hook_offload
from dsx.models.llama import Llama, LlamaConfig
from tests.harness import load_example

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


def _grads(model: torch.nn.Module, x: torch.Tensor, ctx) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with ctx:
        loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_the_baseline_moves_large_saved_tensors_and_keeps_gradients_bitwise(device: str) -> None:
    cfg = LlamaConfig(seq_len=32, layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=160)
    model = Llama(cfg, seed=1).to(device)
    x = torch.randint(0, cfg.vocab_size, (3, 33), generator=torch.Generator().manual_seed(2)).to(device)
    large = []  # what autograd saves that the baseline should move: 4 KiB or more, not a parameter

    def count(t: torch.Tensor) -> torch.Tensor:
        if t.numel() * t.element_size() >= 4096 and not isinstance(t, torch.nn.Parameter):
            large.append(t.numel() * t.element_size())
        return t

    want = _grads(model, x, torch.autograd.graph.saved_tensors_hooks(count, lambda t: t))
    hooks = _hook_offload.SavedTensorOffload(min_bytes=4096, device_only=device != "cpu")
    got = _grads(model, x, hooks)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert hooks.moved_tensors == len(large) > 0 and hooks.moved_bytes == sum(large)
    small = _hook_offload.SavedTensorOffload(min_bytes=1 << 30, device_only=False)
    _grads(model, x, small)
    assert small.moved_bytes == 0  # under min_bytes nothing moves


def test_bench_offload_runs_the_llama_model_with_its_peers(tmp_path) -> None:
    mod = load_example("benchmarks/bench_offload.py", "bench_offload_llama")
    mod.main(["--quick", "--in-process", "--model", "llama", "--configs", "none", "hooks_offload", "ds_cpu_ckpt", "dsx_host",
              "--out", str(tmp_path), "--name", "llama"])  # fmt: skip
    saved = json.loads((tmp_path / "llama.json").read_text())
    rows = {r["config"]: r for r in saved["results"]}
    assert set(rows) == {"none", "hooks_offload", "ds_cpu_ckpt", "dsx_host"}
    ds = rows.pop("ds_cpu_ckpt")
    if not torch.cuda.is_available():
        assert "needs a GPU" in ds["error"]
    else:
        rows["ds_cpu_ckpt"] = ds
    assert all("error" not in r and r["step_s"] > 0 for r in rows.values()), rows
    assert saved["config"]["model"] == "llama"


@pytest.mark.gpu
def test_deepspeed_cpu_checkpointing_of_the_llama_model_gives_its_gradients() -> None:
    """bench_offload's ds_cpu_ckpt wrapper: DeepSpeed empties the inputs it offloads, so the rotary tables that
    every layer shares must not be among them, and the hidden states must be, or no gradient reaches the
    layers before: the gradients equal those of the unwrapped model."""
    mod = load_example("benchmarks/bench_offload.py", "bench_offload_ckpt")
    mod._init_distributed()  # DeepSpeed's checkpointing asks its process group for the model-parallel rank
    cfg = LlamaConfig(vocab_size=256, hidden=64, layers=3, heads=4, kv_heads=2, ffn_hidden=128, seq_len=32)
    plain, wrapped = Llama(cfg, seed=3).cuda(), Llama(cfg, seed=3).cuda()
    mod._deepspeed_checkpointing(wrapped)
    tokens = torch.randint(0, 256, (2, 33), device="cuda")
    for model in (plain, wrapped):
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
        assert b.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
