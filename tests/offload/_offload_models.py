"""Small models for the activation-offload tests (CPU, float32, deterministic kernels)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["OddModel", "TinyGPT"]


class CoreAttention(nn.Module):
    """Scores, mask, softmax and the weighted sum: what Megatron's selective recompute recomputes."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor | None = None
    ) -> torch.Tensor:
        s = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        if masked is None:
            masked = ~torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        return att.masked_fill(masked, float("-inf")).softmax(-1) @ v


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads
        self.attn = CoreAttention()

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = hidden_states
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)  # views of one storage
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = self.attn(q, k, v, attention_mask).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """``by_keyword``: blocks are called as ``blk(hidden_states=x)``, as Megatron calls its layers;
    ``shared_mask``: with ``attention_mask=``, one causal mask made once a step and saved by every layer's
    attention, as Megatron's is."""

    def __init__(
        self,
        vocab: int = 64,
        d: int = 32,
        layers: int = 3,
        heads: int = 4,
        seq: int = 16,
        by_keyword: bool = False,
        shared_mask: bool = False,
    ) -> None:
        super().__init__()
        self.by_keyword, self.shared_mask = by_keyword, shared_mask
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        s = idx.shape[1]
        mask = ~torch.ones(s, s, dtype=torch.bool, device=idx.device).tril() if self.shared_mask else None
        for blk in self.blocks:
            if mask is not None:
                x = blk(hidden_states=x, attention_mask=mask)
            else:
                x = blk(hidden_states=x) if self.by_keyword else blk(x)
        return self.head(self.ln(x))


class OddBlock(nn.Module):
    """Views of one storage, a tensor saved by two ops, a tied weight used twice in one layer."""

    def __init__(self, d: int, shared: nn.Linear) -> None:
        super().__init__()
        self.shared, self.own = shared, nn.Linear(d, 2 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.own(x)
        a, b = h.chunk(2, dim=-1)  # two views, both saved below
        t = a.sigmoid()
        y = t * b + t * t  # t saved by two ops
        y = self.shared(y) + torch.nn.functional.linear(y.tanh(), self.shared.weight)  # tied weight twice
        return x + y.transpose(0, 1).contiguous().transpose(0, 1) * a.cos()


class OddModel(nn.Module):
    def __init__(self, d: int = 48, layers: int = 3) -> None:
        super().__init__()
        shared = nn.Linear(d, d)
        self.layers = nn.ModuleList(OddBlock(d, shared) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.layers:
            x = m(x)
        return x


def assert_same_grads(want: list[list[torch.Tensor]], got: list[list[torch.Tensor]]) -> None:
    """Per step, every parameter's gradient finite and bitwise equal to the reference run's."""
    assert len(got) == len(want) > 0
    for gw, gg in zip(want, got):
        assert len(gg) == len(gw) > 0
        for a, b in zip(gw, gg):
            assert torch.isfinite(a).all() and torch.equal(a, b)
