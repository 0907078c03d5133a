"""megatron-core's GPTModel behind the same call as :class:`dsx.models.GPT`: ``model(tokens, targets) -> loss``.

Needs CUDA and ``megatron-core`` (extra ``[llm]``); :func:`megatron_available` says whether both are there.
Tensor and pipeline parallel sizes are 1: DeepSpeed provides data parallelism and ZeRO around it.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

__all__ = ["MegatronGPT", "build_megatron_gpt", "megatron_available"]


def megatron_available() -> tuple[bool, str]:
    """(usable, reason): megatron-core's GPT attention needs CUDA."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return False, "megatron-core is not installed (pip install dsx[llm])"
    if not torch.cuda.is_available():
        return False, "megatron-core's GPT needs CUDA; no GPU here"
    return True, "megatron-core with CUDA"


class MegatronGPT(nn.Module):
    """Wraps a megatron-core ``GPTModel``; returns the mean token loss when targets are given."""

    def __init__(self, gpt: nn.Module, seq_len: int) -> None:
        super().__init__()
        self.gpt = gpt
        self.seq_len = seq_len

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        b, s = tokens.shape
        pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        # True marks positions that may not be attended to (megatron's convention).
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
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(seed)
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
