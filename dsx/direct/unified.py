"""``dsx.unified``: a host tensor pinned in place that GPU kernels gather rows from, zero-copy.

A :class:`UnifiedTensor` wraps a CPU tensor (a feature table, a CSR array). On a machine with a GPU its
pages are registered with ``cudaHostRegister`` (portable + mapped: every GPU of the process may read them
over PCIe, no copy is made). With several ranks on a node the data is first placed in shared memory, so that
the node holds one copy and every local rank maps and registers the same pages (:mod:`dsx.direct.shm`).

``ut[index]`` / ``ut.gather(index)`` return ``table[index]`` on the index's device: on a GPU through the
zero-copy kernel (``csrc/unified_gather.cu``) or its PyTorch twin, on a CPU through ``index_select``.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any, Literal

import torch

from dsx import defaults
from dsx.config import UnifiedConfig
from dsx.direct import gather as _g
from dsx.direct import shm
from dsx.runtime import pinning

__all__ = ["UnifiedTensor", "load_gather_op", "unified"]

logger = logging.getLogger("dsx")


def _local_world_size_gt1() -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return False
    return shm.local_group().size > 1


def load_gather_op() -> Any:
    """The compiled gather op (built by DeepSpeed's JIT on first use, then loaded from its cache)."""
    from dsx.ops.unified_gather import load_unified_gather

    return load_unified_gather()


class UnifiedTensor:
    """A CPU tensor pinned in place (and shared per node) from which GPUs gather rows zero-copy.

    Create with :func:`unified`. ``close()`` (or leaving a ``with`` block, or garbage collection)
    unregisters the pages exactly once; the data stays readable on the CPU through :attr:`tensor`.

    Gathers follow :attr:`config`: the section given to :func:`unified`, else the ``"unified"`` process
    default of the moment (:func:`dsx.defaults.get`), so an engine's section, or a
    ``with dsx.defaults.set("unified", ...)`` block, applies to tensors made before it.
    """

    def __init__(
        self,
        tensor: torch.Tensor,
        *,
        shared: bool,
        group: shm.NodeGroup | None,
        config: UnifiedConfig | None,
        name: str | None,
    ) -> None:
        self.tensor = tensor
        self.shared = shared
        self.group = group
        self.name = name
        self._config = config
        self._pending: list[_g.PendingCheck] = []
        self._ptr: int | None = None
        if torch.cuda.is_available() and tensor.numel() > 0:
            pinning.register(tensor.data_ptr(), _span(tensor))
            self._ptr = tensor.data_ptr()
        # close() raises what unregistering raises; garbage collection and exit cannot
        self._finalizer = weakref.finalize(self, pinning.unregister_at_finalization, self._ptr, tensor)

    # ---------------------------------------------------------------------------------------- metadata
    @property
    def config(self) -> UnifiedConfig:
        """The ``"unified"`` section this tensor's gathers follow (read at every gather)."""
        return self._config if self._config is not None else defaults.get("unified")

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the table spans (with the padding between rows, if it is padded)."""
        return _span(self.tensor)

    @property
    def row_stride(self) -> int:
        """Bytes from one row to the next: the row's size, or more where rows are padded (``row_alignment``)."""
        return _g.row_stride_of(self.tensor)

    @property
    def is_pinned(self) -> bool:
        """True while the pages are registered with CUDA (always False on a machine without a GPU)."""
        return self._ptr is not None and self._finalizer.alive

    def __len__(self) -> int:
        return self.tensor.shape[0]

    def __repr__(self) -> str:
        return (
            f"UnifiedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, pinned={self.is_pinned}, "
            f"shared={self.shared}, name={self.name!r})"
        )

    # ------------------------------------------------------------------------------------------ gather
    def _backend(self, index: torch.Tensor, want: str) -> Literal["cuda", "torch"]:
        if index.device.type != "cuda":
            if want == "cuda" and index.device.type != "cpu":
                raise ValueError(f"unified gather: backend 'cuda' cannot serve an index on {index.device}")
            return "torch"
        if want == "torch":
            return "torch"
        if not self.is_pinned:
            raise RuntimeError(
                "unified gather: this UnifiedTensor is closed (its pages are no longer pinned)"
            )
        if want == "cuda":
            load_gather_op()  # raises with the build log if the kernel cannot be built
            return "cuda"
        try:
            load_gather_op()
            return "cuda"
        except Exception as exc:  # auto: fall back, say why once
            if not getattr(UnifiedTensor, "_warned", False):
                UnifiedTensor._warned = True  # type: ignore[attr-defined]
                warnings.warn(
                    f"dsx unified gather: CUDA kernel unavailable, using PyTorch: {exc}", stacklevel=3
                )
            return "torch"

    def gather(
        self,
        index: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        check: Literal["sync", "deferred"] | None = None,
    ) -> torch.Tensor:
        """Rows ``tensor[index]`` on ``index.device`` (shape ``index.shape + tensor.shape[1:]``).

        Parameters
        ----------
        index
            int32 or int64 tensor of any shape, on a GPU (zero-copy kernel, runs on the current stream) or
            on the CPU (``index_select``).
        out
            Optional contiguous destination of the right shape, dtype and device.
        check
            GPU only. ``"sync"`` (default): wait for the gather and raise :class:`IndexOutOfRangeError` if an
            index was out of range. ``"deferred"``: return at once (the gather overlaps other work); the check
            runs at the next ``gather``, ``check()`` or ``close()`` — rows of bad indices are zero, and the
            error is raised there. Default from ``dsx.unified.check_indices``.

        The kernel's bandwidth against a plain pinned copy, by row size, is in docs/unified.md.
        """
        _g.check_index(index)
        self._poll()
        cfg = self.config
        if self._backend(index, cfg.backend) == "torch":
            return _g.torch_gather(self.tensor, index, out, sort=cfg.sort_indices)
        res, pending = _g.cuda_gather(
            load_gather_op(),
            self.tensor,
            index,
            out,
            sort=cfg.sort_indices,
            max_sms=cfg.max_gather_sms or 0,
        )
        if (check or cfg.check_indices) == "sync":
            pending.raise_if_bad()
        else:
            self._pending.append(pending)
        return res

    def __getitem__(self, index: Any) -> torch.Tensor:
        if isinstance(index, torch.Tensor) and index.dtype != torch.bool:
            return self.gather(index)
        return self.tensor[index]  # ints, slices, masks: a host view/copy, as for the wrapped tensor

    def _poll(self) -> None:
        """Raise for finished deferred gathers that saw a bad index (non-blocking)."""
        while self._pending and self._pending[0].ready():
            self._pending.pop(0).raise_if_bad()

    def check(self) -> None:
        """Wait for every deferred gather and raise if any saw an out-of-range index."""
        pending, self._pending = self._pending, []
        for p in pending:
            p.raise_if_bad()

    # --------------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Check deferred gathers, then unregister the pages (once; later calls do nothing)."""
        try:
            self.check()
        finally:
            if self._finalizer.detach() is not None and self._ptr is not None:
                pinning.unregister(self._ptr)  # exactly once: the finaliser is detached above

    def __enter__(self) -> UnifiedTensor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _span(t: torch.Tensor) -> int:
    """Bytes from a table's first byte to its last (rows and the padding between them)."""
    if t.numel() == 0:
        return 0
    return (t.shape[0] - 1) * _g.row_stride_of(t) + _g.row_bytes_of(t.shape, t.dtype)


# Zero-copy reads cross PCIe as requests for 128-byte lines: a row that starts off a line boundary touches one line
# more than its size needs (a 256-byte row three instead of two), and a gather of such rows reads that much more.
_LINE = 128
_hinted = False


def _needs_copy(align: int, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` must be copied for its rows to lie a multiple of ``align`` bytes apart from a start on
    a multiple of ``align`` (a 1-d table, one element a row, is never padded)."""
    if tensor.dim() < 2 or not align:
        return False
    stride = _g.row_stride_of(tensor) if tensor.shape[0] > 1 else 0
    return bool(stride % align or tensor.data_ptr() % align)


def _padded_copy(tensor: torch.Tensor, align: int) -> torch.Tensor:
    """A copy of ``tensor`` whose rows start at multiples of ``align`` bytes, the first on a page."""
    stride = _g.padded_row_stride(_g.row_bytes_of(tensor.shape, tensor.dtype), align)
    buf = _g.host_empty((tensor.shape[0] * stride,), torch.uint8)
    table = _g.strided_rows(buf, tensor.dtype, tuple(tensor.shape), stride)
    table.copy_(tensor)
    return table


def _hint_line_offset(tensor: torch.Tensor, name: str | None) -> None:
    """Say once per process that a table pinned in place starts off a 128-byte line while its rows lie a
    multiple of 128 bytes apart (every row then sits at that same offset and costs one line read more), and
    what avoids it. Rows at other strides start at every offset within a line whatever the table's start."""
    global _hinted
    if _hinted or tensor.dim() < 2 or tensor.shape[0] < 2 or not tensor.data_ptr() % _LINE:
        return
    if _g.row_stride_of(tensor) % _LINE:
        return
    _hinted = True
    logger.info(
        "dsx.unified%s: the table starts %d bytes into a 128-byte line and its rows lie a multiple of 128 bytes "
        "apart, so a GPU gather reads one line a row more than from an aligned table: allocate it with "
        "dsx.direct.host_empty, or set unified.row_alignment to 128 for an aligned copy (docs/unified.md, "
        "'Where the table starts')",
        f" {name}" if name else "",
        tensor.data_ptr() % _LINE,
    )


def unified(
    tensor: torch.Tensor | None,
    shared: Literal["auto", "on", "off"] | None = None,
    *,
    name: str | None = None,
    config: UnifiedConfig | None = None,
) -> UnifiedTensor:
    """Pin an existing host tensor in place (``cudaHostRegister``, no copy), shared once per node.

    Parameters
    ----------
    tensor
        A CPU tensor whose rows are contiguous (a contiguous tensor, or a row-padded one). With sharing on,
        ranks other than the node's first may pass ``None`` (the leader's data, shape and dtype are used).
    shared
        ``"auto"`` (default): share when torch.distributed is initialised and more than one rank runs on
        this node; ``"on"``: always (collective over the default process group); ``"off"``: this process
        pins its own tensor. Default from ``dsx.unified.shared``.
    name
        Tag shown in the segment's file name and in ``repr``.
    config
        The ``"unified"`` section to follow; default: the process default (:func:`dsx.defaults.get`), which
        inside an engine built by :func:`dsx.initialize` is the engine's section.

    Registration walks every page, so it is slow for a large table: do it once. Sharing copies the data
    once into ``shared_memory_dir`` (at host memory bandwidth), after which each rank adds only page tables.

    ``row_alignment`` (from ``config``): a table whose rows do not start at multiples of it is laid out in a
    copy whose rows do, and :attr:`UnifiedTensor.tensor` is a view of its leading bytes (same shape,
    dtype and values; not contiguous). A GPU gather of such rows then reads whole 32-byte PCIe sectors (a
    300-byte row spans 10 instead of 10.25 on average), at the cost of a copy and the padding's host memory
    (docs/unified.md, "Padded rows"). The default (0) keeps the rows as given.
    """
    cfg = config if config is not None else defaults.get("unified")
    mode = shared or cfg.shared
    if tensor is not None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"dsx.unified: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"dsx.unified: the tensor must live in host memory, got device {tensor.device}")
        if tensor.dim() == 0:
            raise ValueError("dsx.unified: a 0-d tensor has no rows; give at least one dimension")
        if not _g.rows_contiguous(tensor):
            raise ValueError(
                "dsx.unified: the tensor's rows must be contiguous (rows are read as bytes): a contiguous tensor "
                "or a row-padded one; call .contiguous() first (that copies it once)"
            )
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"dsx.unified: shared={mode!r}; allowed: 'auto', 'on', 'off'")
    use_shared = mode == "on" or (mode == "auto" and _local_world_size_gt1())
    if use_shared:
        # the node's copy is made anyway: laid out with its rows at multiples of the alignment (page-aligned)
        align = cfg.row_alignment if tensor is not None and tensor.dim() > 1 else 0
        data, group = shm.share_tensor(tensor, cfg.shared_memory_dir, name=name, row_alignment=align)
        return UnifiedTensor(data, shared=True, group=group, config=config, name=name)
    if tensor is None:
        raise ValueError("dsx.unified: tensor is None but sharing is off; every rank must pass its tensor")
    align = cfg.row_alignment
    if _needs_copy(align, tensor):
        logger.info(
            "dsx.unified%s: rows of %d bytes copied %d bytes apart, from a page (row_alignment=%d; the table's "
            "rows lay %d bytes apart from a start %d bytes past a multiple of the alignment)",
            f" {name}" if name else "",
            _g.row_bytes_of(tensor.shape, tensor.dtype),
            _g.padded_row_stride(_g.row_bytes_of(tensor.shape, tensor.dtype), align),
            align,
            _g.row_stride_of(tensor) if tensor.shape[0] > 1 else _g.row_bytes_of(tensor.shape, tensor.dtype),
            tensor.data_ptr() % align,
        )
        tensor = _padded_copy(tensor, align)
    else:
        _hint_line_offset(tensor, name)
    return UnifiedTensor(tensor, shared=False, group=None, config=config, name=name)
