"""bench_offload's peer ``megatron_offload_*``: megatron-core's own fine-grained activation offloading, run
without TransformerEngine through the flag holder of ``benchmarks/_megatron_offload.py``, moves bytes and gives
the gradients of no offload on the megatron Llama model (GPU: megatron's GPT attention needs CUDA)."""

from __future__ import annotations

import pytest
import torch

from dsx.models.llama import LlamaConfig
from tests.harness import load_example

pytestmark = pytest.mark.gpu


def _grads(model: torch.nn.Module, batches: list[torch.Tensor], before_step=None) -> list[torch.Tensor]:
    """The gradients of the last batch, after a step on each (no optimizer step)."""
    for tokens in batches:
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
    # other tokens every step: a reload from a buffer of an earlier step would give other gradients
    batches = [torch.randint(0, 256, (2, cfg.seq_len + 1), device="cuda") for _ in range(3)]
    plain = build_megatron_llama(cfg, seed=0).cuda()
    ref = _grads(plain, batches[-1:])
    for key in ("all", "attn", "mlp_norm"):
        model = build_megatron_llama(cfg, seed=0, offload_modules=mo.OFFLOAD_SETS[key]).cuda()
        model.load_state_dict(plain.state_dict())
        mo.reset_offload()
        # step 1 records the groups (and offloads them all); step 3 runs the settled plan
        got = _grads(model, batches, mo.start_offload_step)
        moved = mo.offload_bytes()
        mo.release_offload()
        assert sum(moved.values()) > 0, (key, moved)
        for (name, _), a, b in zip(plain.named_parameters(), ref, got, strict=True):
            scale = a.abs().max().clamp(min=1e-6)
            assert (a - b).abs().max() <= 2e-2 * scale, f"{key}: {name} differs from no offload"
        del model
    torch.cuda.empty_cache()
