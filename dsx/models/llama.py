"""A Llama-style decoder in plain PyTorch: RMSNorm, rotary position embeddings (RoPE), grouped-query attention
(GQA) and a SwiGLU MLP, with causal attention through ``torch.nn.functional.scaled_dot_product_attention``
(which picks its kernel: flash attention on GPUs that have it).

The layers live in one ``nn.ModuleList`` (``blocks``), which activation offload detects as the repeated layers.
Every block is called as ``block(x, cos, sin)``: the rotary tables, made once with the model and sliced to the
sequence in each forward, are given to each layer, so offload keeps them on the device instead of saving a copy
per layer (as megatron-core passes its ``rotary_pos_emb`` to every layer). That holds while the tables have the
activations' dtype (a model cast to bf16); under autocast each layer makes its own cast copy. RoPE uses the
rotate-half layout of megatron-core and Hugging Face: dimension ``i`` of a head pairs with ``i + head_dim / 2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Llama", "LlamaBlock", "LlamaConfig", "SwiGLUActivation", "apply_rope", "rope_tables"]


@dataclass
class LlamaConfig:
    """Shapes of the decoder; :meth:`llama3_8b` gives the Llama-3-8B layer."""

    vocab_size: int = 256
    seq_len: int = 128
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    ffn_hidden: int = 352
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "layers", "hidden", "heads", "kv_heads", "ffn_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"the head dimension hidden/heads ({self.head_dim}) must be even for RoPE")
        if not (self.rope_theta > 0 and self.norm_eps > 0):
            raise ValueError("rope_theta and norm_eps must be > 0")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def llama3_8b(cls, layers: int = 32, seq_len: int = 8192, vocab_size: int = 128256) -> LlamaConfig:
        """The Llama-3-8B layer (hidden 4096, FFN 14336, 32 heads, 8 KV heads, RoPE base 500000)."""
        return cls(vocab_size=vocab_size, seq_len=seq_len, layers=layers, hidden=4096, heads=32, kv_heads=8,
                   ffn_hidden=14336)  # fmt: skip


def rope_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape ``(seq_len, head_dim)`` in float32: position ``p`` turns the pair ``(i, i +
    head_dim/2)`` by ``p * theta ** (-2i / head_dim)``."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(batch, heads, seq, head_dim)`` by the tables of its positions ``(seq,
    head_dim)``; computed in ``x``'s dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention: ``kv_heads`` key/value heads, each shared by ``heads / kv_heads``
    query heads (SDPA's ``enable_gqa``: the flash kernel reads each shared head in place, not a copy per query
    head)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1
        )
        q = apply_rope(q.view(b, s, self.heads, self.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class SwiGLUActivation(nn.Module):
    """``silu(gate) * (up + offset)`` on the two halves ``gate, up`` of its input's last dimension (``offset``
    ``None``: ``silu(gate) * up``).

    A module, not an expression inside the MLP, so that activation offload's ``recompute_modules`` can name
    it: recomputed in backward, it drops the FFN-wide tensors it saves besides its input (``silu(gate)``, and
    with an offset ``up + offset``) for one elementwise pass over its input. megatron-core's layers take it in
    the slot their MLP has for an activation module (:func:`dsx.models.megatron_gpt.build_megatron_llama`),
    with ``offset`` megatron's ``glu_linear_offset``, so that they compute and save what megatron's own gated
    unit does."""

    def __init__(self, offset: float | None = None) -> None:
        super().__init__()
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * (up if self.offset is None else up + self.offset)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``; gate and up are one matrix multiply."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.ffn_hidden, bias=False)
        self.act = SwiGLUActivation()
        self.down = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate_up(x)))


class LlamaBlock(nn.Module):
    """One pre-norm decoder layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Llama-style decoder; ``forward(tokens, targets)`` returns the mean cross-entropy loss, ``forward(tokens)``
    the logits. Initialised from ``seed`` alone (independent of the global RNG)."""

    def __init__(self, cfg: LlamaConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight
        cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # derived from cfg: not in checkpoints
        self.register_buffer("rope_sin", sin, persistent=False)
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() >= 2:  # the residual branches' last projections scaled down with depth (GPT-2 style)
                std = (
                    0.02 / math.sqrt(2 * cfg.layers)
                    if name.endswith(("proj.weight", "down.weight"))
                    else 0.02
                )
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        s = tokens.shape[1]
        if s > self.cfg.seq_len:
            raise ValueError(f"sequence length {s} exceeds the model's seq_len {self.cfg.seq_len}")
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        x = self.tok(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
