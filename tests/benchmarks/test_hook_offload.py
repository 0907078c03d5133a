"""The saved-tensor-hook offload baseline of bench_offload (``hooks_offload``): gradients bitwise equal to no
offload on the Llama model, every large saved tensor moved and nothing else; on CUDA, through pinned buffers
and side streams. The bench runs it beside dsx on the Llama model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import _hook_offload
from dsx.models.llama import Llama, LlamaConfig
from tests.harness import REPO, load_example

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
              "--out", str(tmp_path), "--section", "llama"])  # fmt: skip
    saved = json.loads((tmp_path / "bench_offload.json").read_text())["sections"]["llama"]
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


_KEYWORD_LAYERS = """
import sys, torch
from tests.harness import load_example
mod = load_example("benchmarks/bench_offload.py", "bench_offload_ckpt")
mod._init_distributed()


class Block(torch.nn.Module):  # called as megatron calls its layers: the hidden states by keyword
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, hidden_states, rope=None, pair=None):
        self.calls = getattr(self, "calls", 0) + 1  # 2 per step under a checkpoint: forward, then recompute
        out = torch.tanh(self.lin(hidden_states) * rope)
        return out if pair is None else out + pair[0]


class Net(torch.nn.Module):
    def __init__(self, frozen_input=False):
        super().__init__()
        self.emb = torch.nn.Linear(4, 8)
        self.emb.requires_grad_(not frozen_input)
        self.layers = torch.nn.ModuleList(Block() for _ in range(3))

    def forward(self, x, pair=None):
        rope = torch.linspace(0.5, 1.5, 8)  # shared by every layer, no gradient
        h = self.emb(x)
        for layer in self.layers:
            h = layer(hidden_states=h, rope=rope, pair=pair)
        return h.square().mean()


x = torch.randn(5, 4)
for frozen in (False, True):
    torch.manual_seed(0)
    plain, wrapped = Net(frozen), Net(frozen)
    wrapped.load_state_dict(plain.state_dict())
    mod._deepspeed_checkpointing(wrapped, in_cpu=False)
    plain(x).backward()
    wrapped(x).backward()
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
        if a.grad is None:
            assert b.grad is None, name
            continue
        assert b.grad is not None, f"{name}: no gradient through the wrapper (frozen input: {frozen})"
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)
    # every layer checkpointed, but a first layer whose input needs no gradient (it runs plainly)
    assert [layer.calls for layer in wrapped.layers] == [1 if frozen else 2, 2, 2], frozen
try:
    wrapped(x, pair=[torch.zeros(8, requires_grad=True)])
except TypeError as exc:
    assert "inside a container" in str(exc), exc
else:
    raise AssertionError("a gradient inside a container was accepted")
print("KEYWORD-LAYERS-OK")
"""


def test_deepspeed_checkpointing_wrapper_passes_keyword_inputs(tmp_path) -> None:
    """bench_offload's DeepSpeed checkpoint wrapper on layers called by keyword (as megatron calls them): the
    hidden states go through the checkpoint, so gradients reach the layers before, also when the first
    layer's input needs none; a tensor needing a gradient inside a container is refused. A child process:
    DeepSpeed's checkpointing needs a process group, which this one must not keep."""
    # a rank of its own: not the process group an in-process benchmark test may have left in this process's env
    dist_vars = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    env.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    out = subprocess.run([sys.executable, "-c", _KEYWORD_LAYERS], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0 and "KEYWORD-LAYERS-OK" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
