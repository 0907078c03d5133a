"""The Llama-style decoder: its parts against references written another way, causality, training, and
activation offload on it (bitwise-equal gradients on CPU tensors and real files)."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from dsx.config import SchedulerConfig
from dsx.models import Llama, LlamaConfig
from dsx.models.llama import Attention, SwiGLUActivation, apply_rope, rope_tables
from dsx.offload import ActivationOffload
from dsx.runtime.scheduler import Scheduler
from tests.offload._offload_models import assert_same_grads
from tests.offload._runs import _cfg

SMALL = LlamaConfig(vocab_size=64, seq_len=16, layers=3, hidden=32, heads=4, kv_heads=2, ffn_hidden=48)


def _rope_by_complex(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as a complex multiply: the pair (i, i + d/2) is the number x_i + j x_{i+d/2}, turned by
    exp(j p theta^(-2i/d)) at position p."""
    d = x.shape[-1]
    pos = torch.arange(x.shape[-2], dtype=torch.float64)
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    turn = torch.polar(torch.ones(len(pos), d // 2, dtype=torch.float64), torch.outer(pos, freq))
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double()) * turn
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_is_the_complex_turn_and_keeps_only_relative_positions(theta: float) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 24, 16, generator=g)
    cos, sin = rope_tables(24, 16, theta)
    got = apply_rope(x, cos, sin)
    torch.testing.assert_close(got, _rope_by_complex(x, theta), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    # the same q and k moved together by 5 positions: their dot product does not change
    q, k = torch.randn(16, generator=g), torch.randn(16, generator=g)
    qs, ks = (apply_rope(t.expand(1, 1, 24, 16), cos, sin)[0, 0] for t in (q, k))
    torch.testing.assert_close(qs[10] @ ks[3], qs[15] @ ks[8], rtol=1e-4, atol=1e-5)


def _attention_by_hand(
    attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Softmax attention with a causal mask, the key/value heads copied out to every query head."""
    b, s, h = x.shape
    hd, nq, nkv = attn.head_dim, attn.heads, attn.kv_heads
    q, k, v = attn.qkv(x).split([nq * hd, nkv * hd, nkv * hd], dim=-1)
    q = apply_rope(q.view(b, s, nq, hd).transpose(1, 2), cos, sin)
    k = apply_rope(k.view(b, s, nkv, hd).transpose(1, 2), cos, sin).repeat_interleave(nq // nkv, dim=1)
    v = v.view(b, s, nkv, hd).transpose(1, 2).repeat_interleave(nq // nkv, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    y = scores.softmax(-1) @ v
    return attn.proj(y.transpose(1, 2).reshape(b, s, h))


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_grouped_query_attention_matches_copied_heads(kv_heads: int) -> None:
    torch.manual_seed(2)
    cfg = LlamaConfig(seq_len=16, hidden=32, heads=4, kv_heads=kv_heads)
    attn = Attention(cfg)
    x = torch.randn(2, 16, 32)
    cos, sin = rope_tables(16, cfg.head_dim, cfg.rope_theta)
    torch.testing.assert_close(attn(x, cos, sin), _attention_by_hand(attn, x, cos, sin), rtol=1e-5, atol=1e-5)


def test_a_token_changes_only_the_logits_at_and_after_it() -> None:
    model = Llama(SMALL, seed=3).eval()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 64
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)
    assert (a[:, 9:] - b[:, 9:]).abs().amax() > 1e-4


def test_same_seed_same_model_and_it_learns() -> None:
    a, b = Llama(SMALL, seed=5), Llama(SMALL, seed=5)
    assert all(
        torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    assert "rope_cos" not in a.state_dict()
    g = torch.Generator().manual_seed(6)
    x, y = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)
    opt = torch.optim.AdamW(a.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = a(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(64), rel=0.1)
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(hidden=30), "divisible by heads"),
        (dict(kv_heads=3), "multiple of kv_heads"),
        (dict(hidden=12, heads=4), "must be even"),
        (dict(layers=0), "layers must be >= 1"),
        (dict(rope_theta=0.0), "rope_theta"),
    ],
)
def test_bad_shapes_say_what_is_wrong(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**{**SMALL.__dict__, **change})
    with pytest.raises(ValueError, match="exceeds the model's seq_len"):
        Llama(SMALL)(torch.zeros(1, 17, dtype=torch.long))


def test_llama3_8b_shape() -> None:
    cfg = LlamaConfig.llama3_8b(layers=1, seq_len=8)
    assert (cfg.hidden, cfg.ffn_hidden, cfg.heads, cfg.kv_heads, cfg.head_dim) == (4096, 14336, 32, 8, 128)


@pytest.mark.parametrize("offset", [None, 0.0, 0.75])
def test_the_swiglu_activation_is_silu_of_the_first_half_times_the_second(offset: float | None) -> None:
    x = torch.randn(3, 5, 2 * 24, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    gate, up = x[..., :24], x[..., 24:]
    want = gate / (1 + torch.exp(-gate)) * (up + (offset or 0.0))
    torch.testing.assert_close(SwiGLUActivation(offset)(x), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("tiers", "sel"), [(["host"], False), (["host", "ssd"], False), (["host"], True)])
def test_activation_offload_gives_bitwise_equal_gradients(tmp_path, tiers: list[str], sel: bool) -> None:
    """Every layer moved, to the host or through it to files; ``sel``: with the SwiGLU activation recomputed in
    backward, so that each layer moves less."""
    ref = Llama(SMALL, seed=7)
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(8)
    batches = [(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g))]
    batches *= 2

    def train(m: Llama, off: ActivationOffload | None) -> list[list[torch.Tensor]]:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        grads = []
        for x, y in batches:
            opt.zero_grad()
            m(x, y).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
            opt.step()
            if off is not None:
                off.end_step()
        return grads

    want = train(ref, None)
    sched = Scheduler(SchedulerConfig(io_workers=2))
    off = ActivationOffload(
        model, _cfg(tmp_path, tiers, recompute_modules=["SwiGLUActivation"] if sel else []), sched
    )
    try:
        got = train(model, off)
        moved = [sum(h.bytes_by_tier.values()) for h in sched.telemetry.history]
    finally:
        off.close()
        sched.close()
    assert moved and moved[0] > 0, "nothing was offloaded: the test would pass vacuously"
    assert_same_grads(want, got)
    if sel:
        # one FFN-wide float32 tensor a layer fewer to write and to read back: silu(gate) (its input is kept)
        full = Llama(SMALL, seed=7)
        sched = Scheduler(SchedulerConfig(io_workers=2))
        off = ActivationOffload(full, _cfg(tmp_path, tiers), sched)
        try:
            train(full, off)
            moved_full = sum(sched.telemetry.history[0].bytes_by_tier.values())
        finally:
            off.close()
            sched.close()
        tokens = batches[0][0].numel()
        assert moved_full - moved[0] == SMALL.layers * 2 * tokens * SMALL.ffn_hidden * 4, (
            moved_full,
            moved[0],
        )


@pytest.mark.gpu
def test_bf16_on_the_gpu_runs_flash_attention_and_matches_float32() -> None:
    """Forced to the flash kernel (an error if SDPA cannot use it with grouped heads), the bf16 model on the GPU
    gives the float32 CPU model's loss and gradients within bf16's precision."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = LlamaConfig(vocab_size=512, seq_len=256, layers=2, hidden=256, heads=8, kv_heads=2, ffn_hidden=688)
    ref = Llama(cfg, seed=9)
    gpu = copy.deepcopy(ref).cuda().to(torch.bfloat16)
    g = torch.Generator().manual_seed(10)
    x, y = torch.randint(0, 512, (2, 256), generator=g), torch.randint(0, 512, (2, 256), generator=g)
    want = ref(x, y)
    want.backward()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        got = gpu(x.cuda(), y.cuda())
        got.backward()
    assert abs(got.item() - want.item()) < 2e-2 * want.item()
    for (name, p), q in zip(ref.named_parameters(), gpu.parameters(), strict=True):
        a, b = p.grad, q.grad.float().cpu()
        assert (a - b).norm() <= 0.05 * a.norm() + 1e-6, name


@pytest.mark.parametrize("causal_mask", [True, False])
def test_the_megatron_wrapper_passes_a_causal_mask_only_where_asked(causal_mask: bool) -> None:
    """megatron's local attention reads the ``[1, 1, s, s]`` mask; the Llama build's SDPA core attention is causal
    by itself and gets none (the mask would cost s * s bytes a forward and be an input of every layer)."""
    from dsx.models.megatron_gpt import MegatronGPT

    seen = {}

    class Recorder(torch.nn.Module):  # what megatron's GPTModel receives
        def forward(self, tokens, pos, mask, labels=None):
            seen["mask"], seen["pos"] = mask, pos
            return torch.randn(tokens.shape, requires_grad=True)

    tokens = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(3))
    MegatronGPT(Recorder(), 6, causal_mask=causal_mask)(tokens, tokens)
    assert torch.equal(seen["pos"], torch.arange(6).expand(2, 6))
    if causal_mask:
        assert seen["mask"].shape == (1, 1, 6, 6)
        assert torch.equal(seen["mask"][0, 0], torch.ones(6, 6, dtype=torch.bool).triu(1))  # True: masked out
    else:
        assert seen["mask"] is None


@pytest.mark.gpu
def test_megatron_llama_trains_and_its_sdpa_core_attention_equals_megatrons() -> None:
    """The main job trains the megatron-core build in bf16; then, on fresh random inputs with grouped heads, the
    SDPA core attention it uses gives megatron's own ``DotProductAttention`` output (float32)."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install dsx[llm])")
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from dsx.models.megatron_gpt import sdpa_core_attention
    from tests.harness import REPO, load_example

    main = load_example("examples/gpt/train.py", "gpt_train_megatron_llama").main
    summary = main(["--deepspeed_config", str(REPO / "configs/gpt_megatron_bf16.json"), "--model", "megatron-llama",
                    "--kv-heads", "2", "--steps", "30", "--layers", "2", "--hidden", "256", "--heads", "4",
                    "--seq-len", "128", "--no-progress"])  # fmt: skip
    assert summary["model"] == "megatron-core Llama (SDPA attention)"
    assert summary["final_loss"] < summary["first_loss"] - 0.5, summary
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                            attention_dropout=0.0, masked_softmax_fusion=False)  # fmt: skip
    theirs = DotProductAttention(cfg, 1, AttnMaskType.causal, "self").cuda()
    ours = sdpa_core_attention()(cfg, 1, AttnMaskType.causal, "self").cuda()
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(64, 2, 8, 32, device="cuda", generator=g)
    k, v = (torch.randn(64, 2, 2, 32, device="cuda", generator=g) for _ in range(2))
    mask = torch.ones(64, 64, dtype=torch.bool, device="cuda").triu(1).view(1, 1, 64, 64)
    torch.testing.assert_close(ours(q, k, v, mask), theirs(q, k, v, mask), rtol=2e-4, atol=2e-4)
    with pytest.raises(ValueError, match="causal"):
        sdpa_core_attention()(cfg, 1, AttnMaskType.no_mask, "self")


@pytest.mark.gpu
def test_megatrons_mlp_with_the_swiglu_module_equals_its_own_gated_unit() -> None:
    """The build fills megatron's activation-module slot with :class:`SwiGLUActivation` in every layer (so that
    ``recompute_modules`` can name it): on fresh random inputs megatron's MLP with it gives the output and
    gradients of megatron's own inline gated unit (float32), and saves the same bytes for backward."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install dsx[llm])")
    import torch.distributed as dist
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from dsx.models.megatron_gpt import _init_megatron, _mlp_submodules, _swiglu_activation
    from dsx.runtime.process import single_process_env

    if not dist.is_initialized():
        single_process_env()
        dist.init_process_group("nccl")
    _init_megatron(13)
    common = dict(num_layers=1, hidden_size=128, num_attention_heads=4, ffn_hidden_size=344, gated_linear_unit=True,
                  activation_func=torch.nn.functional.silu, add_bias_linear=False, bias_activation_fusion=False)  # fmt: skip
    # the linear layers of the spec the build starts from, with and without the activation module
    subs = _mlp_submodules(get_gpt_layer_local_spec(normalization="RMSNorm").submodules.mlp)
    assert subs.activation_func is None
    theirs = MLP(TransformerConfig(**common), subs, ffn_hidden_size=344).cuda()
    subs = dataclasses.replace(subs, activation_func=_swiglu_activation)
    ours = MLP(TransformerConfig(**common, use_te_activation_func=True), subs, ffn_hidden_size=344).cuda()
    assert isinstance(ours.activation_func, SwiGLUActivation)
    # and the build puts it in every layer
    from dsx.models.megatron_gpt import build_megatron_llama

    cfg = LlamaConfig(vocab_size=64, seq_len=32, layers=2, hidden=128, heads=4, kv_heads=2, ffn_hidden=344)
    built = build_megatron_llama(cfg, seed=0)
    assert built.causal_mask is False  # (its SDPA core attention is causal by itself)
    acts = [m for m in built.modules() if isinstance(m, SwiGLUActivation)]
    assert len(acts) == cfg.layers and all(a.offset == 0.0 for a in acts)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(32, 2, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(14))
    saved: dict[str, list[int]] = {"theirs": [], "ours": []}
    outs = {}
    for name, mlp in (("theirs", theirs), ("ours", ours)):
        inp = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, s=saved[name]: s.append(t.nbytes) or t, lambda t: t
        ):
            out, _ = mlp(inp)
        out.square().sum().backward()
        outs[name] = (out.detach(), inp.grad, [p.grad for p in mlp.parameters()])
    torch.testing.assert_close(outs["ours"][0], outs["theirs"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["ours"][1], outs["theirs"][1], rtol=1e-5, atol=1e-5)
    for a, b in zip(outs["ours"][2], outs["theirs"][2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert sorted(saved["ours"]) == sorted(saved["theirs"]), saved
