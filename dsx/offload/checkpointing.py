"""Which modules are the layers, which of their sub-modules recompute, and the checkpoint wrappers that
recompute them.

A plan's action is per layer (``layer_classes``, by default the repeated blocks of the model's largest
``nn.ModuleList``); ``recompute_modules`` names sub-modules of a layer that may run again in backward instead
of storing (``+sel`` actions). A recomputed layer or sub-module runs under torch's checkpoint: its
``forward`` is replaced on the instance and restored when the action changes or offload closes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dsx.config import ActivationOffloadConfig, DsxConfigError

__all__ = [
    "add_note_once",
    "check_model",
    "checkpointed",
    "find_layers",
    "layers_and_subs",
    "noting_oom",
    "recompute_modules",
]


def find_layers(model: nn.Module, layer_classes: list[str] | None) -> list[nn.Module]:
    """Modules whose class name is in ``layer_classes``; by default the items of the largest
    ``nn.ModuleList`` whose items all share one class (the repeated transformer blocks)."""
    if layer_classes:
        names = set(layer_classes)
        layers = [m for m in model.modules() if type(m).__name__ in names]
        unmatched = sorted(names - {type(m).__name__ for m in layers})
        if unmatched:  # a misspelt name beside a right one would silently leave those blocks alone
            lists = sorted(
                {type(c).__name__ for m in model.modules() if isinstance(m, nn.ModuleList) for c in m}
            )
            raise ValueError(
                f"dsx activation offload: layer_classes {unmatched} match no module of {type(model).__name__}; "
                f"classes held in its nn.ModuleLists: {lists}"
            )
        # a layer inside another would be profiled twice (its time in both) and planned on its own while its
        # outer layer's action already covers it
        ids = {id(m) for m in layers}
        for outer in layers:
            inner = next((m for m in outer.modules() if m is not outer and id(m) in ids), None)
            if inner is not None:
                raise ValueError(
                    f"dsx activation offload: layer_classes nest: a {type(inner).__name__} sits inside a "
                    f"{type(outer).__name__}; layers must not nest. Name only the outer class (to recompute "
                    f"a part of each layer, name it in recompute_modules)"
                )
    else:
        best: list[nn.Module] = []
        for m in model.modules():
            if isinstance(m, nn.ModuleList) and len(m) > len(best) and len({type(c) for c in m}) == 1:
                best = list(m)
        layers = best
    if not layers:
        raise ValueError(
            f"dsx activation offload found no layers in {type(model).__name__} (layer_classes={layer_classes}): "
            "no nn.ModuleList holds modules of one class; set activation_offload.layer_classes to the class "
            "names of its repeated blocks"
        )
    return layers


def recompute_modules(layer: nn.Module, names: list[str]) -> list[nn.Module]:
    """The outermost sub-modules of ``layer`` whose class name is in ``names``."""
    if not names:
        return []
    out: list[nn.Module] = []
    for m in layer.modules():
        if m is not layer and type(m).__name__ in names and not any(m in set(o.modules()) for o in out):
            out.append(m)
    return out


def layers_and_subs(
    model: nn.Module, cfg: ActivationOffloadConfig
) -> tuple[list[nn.Module], list[list[nn.Module]]]:
    """The layers (``layer_classes``) and each one's ``recompute_modules``; ValueError naming what is there
    when a name matches nothing."""
    layers = find_layers(model, cfg.layer_classes)
    subs = [recompute_modules(layer, cfg.recompute_modules) for layer in layers]
    missing = [name for name in cfg.recompute_modules if not any(
        type(m).__name__ == name for s in subs for m in s)]  # fmt: skip
    if missing:
        found = sorted({type(m).__name__ for layer in layers for m in layer.modules()} - {""})
        raise ValueError(
            f"dsx activation offload: recompute_modules {missing} match no sub-module of the layers "
            f"({type(layers[0]).__name__}); classes inside a layer: {found}"
        )
    return layers, subs


def check_model(model: nn.Module, section: ActivationOffloadConfig) -> None:
    """What :class:`~dsx.offload.ActivationOffload` would find wrong with ``model`` (``layer_classes``,
    ``recompute_modules``), as a :class:`~dsx.config.DsxConfigError`: ``dsx.initialize`` calls it before
    DeepSpeed starts."""
    try:
        layers_and_subs(model, section)
    except ValueError as exc:
        raise DsxConfigError(str(exc)) from None


def noting_oom(fn: Callable[..., Any], note: Callable[[], str | None]) -> Callable[..., Any]:
    """``fn``, whose :class:`torch.OutOfMemoryError` leaves with ``note()`` added (:func:`add_note_once`)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except torch.OutOfMemoryError as exc:
            add_note_once(exc, note())
            raise

    return run


def add_note_once(exc: BaseException, note: str | None) -> None:
    """Add ``note`` to ``exc`` unless it is None or already there: an error raised in a layer's recomputation
    passes through the layer's wrapper and then the engine's ``backward``, each of which notes it."""
    if note is not None and note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)


def _reentrant(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], wrap: Any = None) -> Any:
    """torch's reentrant checkpoint of ``fn(*args, **kwargs)`` (it takes positional arguments only).

    The reentrant form computes no parameter gradients when no input requires grad (e.g. frozen
    embeddings feeding trainable layers), so such calls take the non-reentrant form instead. ``wrap``
    (the profiler's) wraps ``fn``, told which form runs it.
    """
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())):
        fn = wrap(fn, count_saved=False) if wrap else fn
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    fn = wrap(fn) if wrap else fn
    n, keys = len(args), tuple(kwargs)

    def run(*flat: Any) -> Any:
        return fn(*flat[:n], **dict(zip(keys, flat[n:])))

    return checkpoint(run, *args, *kwargs.values(), use_reentrant=True)


def checkpointed(
    module: nn.Module, on: bool, key: int, saved: dict[int, Any], reentrant: bool = False, wrap: Any = None
) -> None:
    """Run ``module`` under torch checkpointing (``on``) or restore its own forward.

    Whole layers use the reentrant form. With the non-reentrant one, megatron-core layers kept much of each
    layer's memory allocated between steps, so full recompute lowered the peak little and a larger
    micro-batch ran out of memory (the small torch GPT shows no such retention; the cause inside megatron-core
    was not pinned down; docs/offload.md). DeepSpeed's reentrant checkpoint of the same layers held nothing
    between steps; reentrant recomputation frees what it re-creates when the layer's backward ends.
    Sub-modules (``recompute_modules``) keep the non-reentrant form, which lets their inputs be saved (and
    moved) like any other tensor.
    """
    if on and key not in saved:
        orig = module.forward
        saved[key] = module.__dict__.get("forward")  # None: the class's forward, restored by deleting ours

        def fwd(*args: Any, _orig: Any = orig, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _orig(*args, **kwargs)
            if reentrant:
                return _reentrant(_orig, args, kwargs, wrap)
            return checkpoint(_orig, *args, use_reentrant=False, **kwargs)

        module.forward = fwd
    elif not on and key in saved:
        own = saved.pop(key)
        if own is None:
            del module.forward
        else:
            module.forward = own
