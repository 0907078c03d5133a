"""Models the examples and benchmarks train (kept apart from how they are parallelised)."""

from dsx.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
