"""The description of one fused edge kernel: the key the code generator emits source from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["EdgeSpec"]

_SCORES = ("none", "add", "dot")


@dataclass(frozen=True)
class EdgeSpec:
    """What the fused CSR edge kernel computes per edge before aggregating messages.

    Parameters
    ----------
    score : {"none", "add", "dot"}
        How an edge's logit is formed: none (alpha = 1 unless weighted), ``src + dst`` per head (RGAT) or a
        per-head dot product of source and destination vectors (HGT).
    leaky_relu_slope : float or None
        Negative slope of a leaky ReLU applied to the logit; None applies none.
    rel_scale : bool
        Multiply the (activated) logit by ``rel_scale[edge_rel[e], h]`` (HGT's mu_r / sqrt(d)).
    edge_weight : bool
        Multiply alpha by a per-edge weight after the softmax (RGCN's 1 / deg_r normalisation).
    softmax : bool
        Normalise the logits over each destination's incoming edges (per head), online and max-stabilised.
    """

    score: Literal["none", "add", "dot"] = "none"
    leaky_relu_slope: float | None = None
    rel_scale: bool = False
    edge_weight: bool = False
    softmax: bool = False

    def __post_init__(self) -> None:
        if self.score not in _SCORES:
            raise ValueError(f"EdgeSpec.score={self.score!r} is not one of {_SCORES}")
        if self.score == "none" and (self.softmax or self.leaky_relu_slope is not None or self.rel_scale):
            raise ValueError(
                f"EdgeSpec(score='none') has no logit, so softmax={self.softmax}, "
                f"leaky_relu_slope={self.leaky_relu_slope}, rel_scale={self.rel_scale} are meaningless; "
                "set score='add' or 'dot', or turn those options off"
            )
        if self.leaky_relu_slope is not None:
            object.__setattr__(self, "leaky_relu_slope", float(self.leaky_relu_slope))

    @property
    def has_logit(self) -> bool:
        return self.score != "none"

    def key(self) -> str:
        """A short stable string naming this spec (used in cache file names)."""
        slope = "x" if self.leaky_relu_slope is None else repr(self.leaky_relu_slope)
        return (
            f"s{self.score}_lr{slope}_rs{int(self.rel_scale)}_ew{int(self.edge_weight)}_sm{int(self.softmax)}"
        )
