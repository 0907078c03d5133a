"""megatron-core's fine-grained activation offloading as a bench_offload peer, with TransformerEngine's flag held
here.

megatron-core 0.19's fine-grained activation offloading (``TransformerConfig.fine_grained_activation_offloading``
with ``offload_modules``) is megatron's own saved-tensor-hook offload: the tensors that the named sub-modules of
each layer save for backward are copied to pinned host memory on a side stream after their forward and back
before their backward; ``activation_offload_fraction`` offloads that share of them. Its hook context also sets
TransformerEngine's ``cpu_offload.CPUOffloadEnabled`` on entry and clears it on exit (only TE's own layers read
it), and without TransformerEngine it raises "TE CPU offload is not available" instead. TransformerEngine is not
among dsx's dependencies (``dsx[llm]``), and the benchmark's model has no TE layer, so
:func:`hold_te_offload_flag` gives megatron a plain object that holds the flag: megatron's offload code runs
unchanged. Installing a stand-in ``transformer_engine`` package instead would turn on megatron's TE code paths
elsewhere (FP8 utilities, fused layers) and break them.

A training loop calls :func:`start_offload_step` before every step's forward (megatron's schedules do the same):
the first step offloads every group and records their layout; later steps apply the fraction, and keep each
sub-module's last layer on the GPU, its backward being next.
"""

from __future__ import annotations

import types

__all__ = [
    "OFFLOAD_SETS",
    "hold_te_offload_flag",
    "offload_bytes",
    "release_offload",
    "reset_offload",
    "start_offload_step",
]

# Named ``offload_modules`` sets of a dense decoder layer (megatron refuses attn_proj without core_attn; its
# other names are MoE sub-modules): each module alone, the attention's output pair, and all five.
OFFLOAD_SETS: dict[str, list[str]] = {
    "attn_norm": ["attn_norm"],
    "qkv": ["qkv_linear"],
    "core_attn": ["core_attn"],
    "attn": ["core_attn", "attn_proj"],
    "mlp_norm": ["mlp_norm"],
    "all": ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"],
}


def hold_te_offload_flag() -> bool:
    """Give megatron an object holding TE's ``CPUOffloadEnabled`` flag where TE is absent; True if megatron
    uses this holder (installed now or by an earlier call), False if it flips TransformerEngine's own flag."""
    import megatron.core.extensions.transformer_engine as te_ext

    held = getattr(te_ext, "cpu_offload", None)
    if isinstance(held, types.SimpleNamespace):
        return True
    if held is not None:
        return False  # TransformerEngine is installed
    te_ext.cpu_offload = types.SimpleNamespace(CPUOffloadEnabled=False)
    return True


def reset_offload() -> None:
    """A fresh offload manager (its first step is again the warm-up that records the groups)."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface,
    )

    FineGrainedActivationOffloadingInterface.reset_instance()


def start_offload_step() -> None:
    """Before each step's forward, as megatron's schedules do."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface,
    )

    FineGrainedActivationOffloadingInterface.reset()


def release_offload() -> None:
    """Drop megatron's offload manager (its streams and pinned pool), so that the next model starts afresh."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

    PipelineOffloadManager.OFFLOAD_MGR = None


def offload_bytes() -> dict[str, int]:
    """Bytes per sub-module group that megatron plans to offload each step, sized in its warm-up step (empty
    before the warm-up ends)."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

    return dict(getattr(PipelineOffloadManager.get_instance(), "_offload_summary_bytes", None) or {})
