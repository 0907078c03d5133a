"""The options every relational layer takes, resolved against the process defaults at call time.

A layer option left as ``None`` follows the ``"rgnn"`` section of :mod:`dsx.defaults` as it is when the layer
runs, not when it was built: a layer made before :func:`dsx.initialize` (or outside a ``with
dsx.defaults.set("rgnn", ...)`` block) still takes the engine's (or the block's) precision, backend and
pass flags. ``kernel_backend`` has no config key: it picks how the kernels run (Triton, its interpreter, or
the PyTorch twins) and is chosen by device unless a layer names it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsx import defaults

__all__ = ["LAYER_BACKENDS", "LayerOptions", "Options"]

LAYER_BACKENDS = ("auto", "kernels", "interpreter")

# The config spells the generated-kernels path after what runs it ("triton"); a layer after what it runs.
_CONFIG_BACKEND = {"auto": "auto", "triton": "kernels", "interpreter": "interpreter"}

# Graph fields the unfused paths read (interpreter, fusion or compaction off), on top of a layer's own.
_UNFUSED_FIELDS = ("src", "dst", "rel")
_PER_EDGE_FIELDS = ("rel_perm", "rel_ptr", "edge_rel_row")


@dataclass(frozen=True)
class Options:
    """A layer's options with every ``None`` resolved; one per forward, so that graph preparation and the
    program run agree even if the defaults change meanwhile."""

    backend: str
    precision: str
    kernel_backend: str | None
    compact_materialization: bool
    linear_reorder: bool
    fusion: bool

    @property
    def interpreter(self) -> bool:
        return self.backend == "interpreter"

    def graph_needs(self, *fused: str) -> tuple[str, ...]:
        """The :class:`~dsx.rgnn.graph.RelGraph` fields this path reads (``fused``: the fused kernels')."""
        if self.interpreter:
            return (*fused, *_UNFUSED_FIELDS)
        needs = fused if self.fusion else (*fused, *_UNFUSED_FIELDS)
        return needs if self.compact_materialization else (*needs, *_UNFUSED_FIELDS, *_PER_EDGE_FIELDS)


class LayerOptions:
    """Mixin: the options every dsx relational layer takes (``None``: the process default at call time)."""

    def _init_options(self, backend, precision, kernel_backend, compact_materialization, linear_reorder,
                      fusion=None):  # fmt: skip
        if backend is not None and backend not in LAYER_BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {LAYER_BACKENDS}")
        self.backend = backend
        self.precision = precision
        self.kernel_backend = kernel_backend
        self.compact_materialization = compact_materialization
        self.linear_reorder = linear_reorder
        self.fusion = fusion

    def options(self) -> Options:
        """This layer's options now: its own where set, else the ``"rgnn"`` process defaults."""
        section = defaults.get("rgnn")

        def pick(name: str):
            value = getattr(self, name)
            return getattr(section, name) if value is None else value

        return Options(
            backend=self.backend if self.backend is not None else _CONFIG_BACKEND[section.backend],
            precision=pick("precision"),
            kernel_backend=self.kernel_backend,
            compact_materialization=bool(pick("compact_materialization")),
            linear_reorder=bool(pick("linear_reorder")),
            fusion=bool(pick("fusion")),
        )

    def _use_interpreter(self) -> bool:
        return self.options().interpreter
