"""bench_offload's peer ``megatron_offload_*``: megatron-core's own fine-grained activation offloading, run
without TransformerEngine through the flag holder of ``benchmarks/_megatron_offload.py``, moves bytes and gives
the gradients of no offload on the megatron Llama model (GPU: megatron's GPT attention needs CUDA)."""

from __future__ import annotations

import pytest
import torch

from dsx.models.llama import LlamaConfig
from tests.harness import load_example

pytestmark = pytest.mark.gpu


def _grads(
    model: torch.nn.Module, tokens: torch.Tensor, before_step=None, steps: int = 1
) -> list[torch.Tensor]:
    for _ in range(steps):  # no optimizer step: every step computes the same gradients
        if before_step is not None:
            before_step()
        model.zero_grad(set_to_none=True)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    return [p.grad.float().clone() for p in model.parameters()]


def test_megatron_fine_grained_offload_moves_bytes_and_keeps_the_gradients() -> None:
    pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install dsx[llm])")
    mod = load_example("benchmarks/bench_offload.py", "bench_offload_megatron_offload")
    mod._init_distributed()  # megatron's model-parallel state and its offload summary need a process group
    import _megatron_offload as mo

    from dsx.models.megatron_gpt import build_megatron_llama

    mo.hold_te_offload_flag()
    # hidden states of [seq 1024, batch 2, hidden 1024]: above megatron's 1M-element offload threshold
    cfg = LlamaConfig(
        vocab_size=256, hidden=1024, layers=3, heads=8, kv_heads=2, ffn_hidden=2048, seq_len=1024
    )
    tokens = torch.randint(0, 256, (2, cfg.seq_len + 1), device="cuda")
    plain = build_megatron_llama(cfg, seed=0).cuda()
    ref = _grads(plain, tokens)
    for key in ("all", "attn", "mlp_norm"):
        model = build_megatron_llama(cfg, seed=0, offload_modules=mo.OFFLOAD_SETS[key]).cuda()
        model.load_state_dict(plain.state_dict())
        mo.reset_offload()
        # step 1 records the groups (and offloads them all); step 3 runs the settled plan
        got = _grads(model, tokens, mo.start_offload_step, steps=3)
        moved = mo.offload_bytes()
        assert sum(moved.values()) > 0, (key, moved)
        for (name, _), a, b in zip(plain.named_parameters(), ref, got, strict=True):
            scale = a.abs().max().clamp(min=1e-6)
            assert (a - b).abs().max() <= 2e-2 * scale, f"{key}: {name} differs from no offload"
        del model
    torch.cuda.empty_cache()
