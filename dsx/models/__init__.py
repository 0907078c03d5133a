"""Models the examples and benchmarks train (kept apart from how they are parallelised)."""

from dsx.models.gpt import GPT, GPTConfig
from dsx.models.llama import Llama, LlamaConfig

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig"]
