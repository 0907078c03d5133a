"""megatron-core's GPTModel behind the same call as :class:`dsx.models.GPT`: ``model(tokens, targets) -> loss``.

Needs CUDA and ``megatron-core`` (extra ``[llm]``); :func:`megatron_available` says whether both are there.
Tensor and pipeline parallel sizes are 1: DeepSpeed provides data parallelism and ZeRO around it.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dsx.models.llama import LlamaConfig, SwiGLUActivation

__all__ = [
    "MegatronGPT",
    "build_megatron_gpt",
    "build_megatron_llama",
    "megatron_available",
    "sdpa_core_attention",
]


def megatron_available() -> tuple[bool, str]:
    """(usable, reason): megatron-core's GPT attention needs CUDA."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return False, "megatron-core is not installed (pip install dsx[llm])"
    if not torch.cuda.is_available():
        return False, "megatron-core's GPT needs CUDA; no GPU here"
    return True, "megatron-core with CUDA"


class MegatronGPT(nn.Module):
    """Wraps a megatron-core ``GPTModel``; returns the mean token loss when targets are given.

    ``causal_mask``: pass megatron its ``[1, 1, s, s]`` causal mask, which its local attention reads. A core
    attention that is causal by itself (:func:`sdpa_core_attention`) is given none, as megatron's flash paths
    are: the mask costs ``s * s`` bytes in every forward, growing with the square of the sequence where the
    activations grow linearly, and every layer takes it as an input."""

    def __init__(self, gpt: nn.Module, seq_len: int, causal_mask: bool = True) -> None:
        super().__init__()
        self.gpt = gpt
        self.seq_len = seq_len
        self.causal_mask = causal_mask

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        b, s = tokens.shape
        pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        mask = None
        if self.causal_mask:  # True marks positions that may not be attended to (megatron's convention)
            mask = torch.ones(s, s, dtype=torch.bool, device=tokens.device).triu_(1).view(1, 1, s, s)
        out = self.gpt(tokens, pos, mask, labels=targets)
        return out.float().mean() if targets is not None else out


def build_megatron_gpt(
    layers: int,
    hidden: int,
    heads: int,
    seq_len: int,
    vocab_size: int,
    seed: int = 0,
    bf16: bool = True,
    recompute_granularity: str | None = None,
) -> MegatronGPT:
    """Build the model after ``torch.distributed`` is initialised (``deepspeed.init_distributed()``).

    ``recompute_granularity="selective"`` is megatron-core's own selective recompute (the core attention
    recomputed in backward), the baseline for dsx's ``recompute_modules``.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    _init_megatron(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        recompute_granularity=recompute_granularity,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=vocab_size,
        max_sequence_length=seq_len,
        share_embeddings_and_output_weights=True,
    )
    return MegatronGPT(gpt, seq_len)


def _init_megatron(seed: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(seed)


@functools.cache
def sdpa_core_attention() -> type[nn.Module]:
    """A megatron-core core attention (the module between the QKV and output projections) that runs torch's
    ``scaled_dot_product_attention``, causal, with grouped heads: flash attention where the GPU has it.
    megatron-core's own local ``DotProductAttention`` materialises the ``[b, heads, s, s]`` scores, and its
    fused attention needs TransformerEngine. Causal self-attention without dropout, bias or packed sequences
    only: anything else is refused, not ignored (a mask megatron passes, if any, is its causal mask, which the
    kernel applies itself)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule

    class SDPACoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None):  # fmt: skip
            super().__init__(config=config)
            dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            if attn_mask_type != AttnMaskType.causal or dropout or config.apply_query_key_layer_scaling:
                raise ValueError(
                    "the SDPA core attention is causal, without attention dropout or query-key layer scaling: "
                    f"got attn_mask_type={attn_mask_type}, attention_dropout={dropout}, "
                    f"apply_query_key_layer_scaling={config.apply_query_key_layer_scaling}"
                )
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):  # fmt: skip
            if attention_bias is not None or packed_seq_params is not None:
                raise ValueError("the SDPA core attention takes no attention bias and no packed sequences")
            # megatron's layout is [s, b, heads, head_dim]; SDPA's [b, heads, s, head_dim]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1]
            )
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

    return SDPACoreAttention


def _mlp_submodules(mlp: Any) -> Any:
    """The ``MLPSubmodules`` of a layer spec's MLP entry: a ``ModuleSpec``'s ``submodules`` before megatron-core
    0.19, the ``submodules`` keyword of the builder (``functools.partial`` of ``MLP.as_mlp_submodule``) after."""
    return mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules


def _swiglu_activation(config: Any) -> nn.Module:
    """megatron's gated SiLU unit (``silu(x_glu) * (x_linear + glu_linear_offset)``) as a module: what its MLP
    computes inline when no activation module is given and its fused kernel is off (``bias_activation_fusion``,
    which megatron-core refuses beside an activation module; the fused kernel saves only its input)."""
    if not config.gated_linear_unit or config.activation_func is not torch.nn.functional.silu:
        raise ValueError("the SwiGLU activation module is a gated SiLU unit: it needs gated_linear_unit=True and "
                         f"activation_func=silu, got {config.gated_linear_unit} and {config.activation_func}")  # fmt: skip
    if config.activation_func_clamp_value is not None:
        raise ValueError(
            "the SwiGLU activation module does not clamp: activation_func_clamp_value must be None"
        )
    return SwiGLUActivation(offset=config.glu_linear_offset)


def build_megatron_llama(
    cfg: LlamaConfig,
    seed: int = 0,
    bf16: bool = True,
    recompute_granularity: str | None = None,
    offload_modules: Sequence[str] = (),
    offload_fraction: float = 1.0,
) -> MegatronGPT:
    """The Llama-style decoder of :class:`dsx.models.LlamaConfig` built with megatron-core (RMSNorm, RoPE,
    grouped-query attention, SwiGLU, no biases) and :func:`sdpa_core_attention` as its core attention. Build it
    after ``torch.distributed`` is initialised. ``recompute_granularity="selective"``: megatron-core's own
    selective recompute (the core attention recomputed in backward). ``offload_modules``: megatron-core's
    fine-grained activation offloading (0.19 and later) of those sub-modules' saved tensors, the share
    ``offload_fraction`` of them; its training loop must start every step with megatron's
    ``FineGrainedActivationOffloadingInterface.reset()``, and without TransformerEngine megatron needs a holder
    for TE's offload flag (``benchmarks/_megatron_offload.py``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    _init_megatron(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    # (only when asked: megatron-core before 0.19 has no such fields)
    offload = {"fine_grained_activation_offloading": True, "offload_modules": list(offload_modules),
               "activation_offload_fraction": offload_fraction} if offload_modules else {}  # fmt: skip
    config = TransformerConfig(
        num_layers=cfg.layers,
        hidden_size=cfg.hidden,
        num_attention_heads=cfg.heads,
        num_query_groups=cfg.kv_heads,
        ffn_hidden_size=cfg.ffn_hidden,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        # megatron's slot for an activation module (named for TransformerEngine's, which fills it by default),
        # filled with dsx's SwiGLUActivation below: megatron's own gated unit as a module that
        # recompute_modules can name
        use_te_activation_func=True,
        apply_rope_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        recompute_granularity=recompute_granularity,
        **offload,
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = sdpa_core_attention()
    _mlp_submodules(spec.submodules.mlp).activation_func = _swiglu_activation
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_len,
        position_embedding_type="rope",
        rotary_base=int(cfg.rope_theta),
        share_embeddings_and_output_weights=cfg.tie_embeddings,
    )
    return MegatronGPT(gpt, cfg.seq_len, causal_mask=False)  # (its core attention is causal SDPA)
