"""Argument checks of the rgnn kernels: shapes and dtypes always, index ranges on request.

Shape/dtype checks read only metadata. Index-range checks (opt-in) are host-synchronising; use them for
debugging and graph preparation.

The kernels never check index ranges themselves: a check needs a device-to-host copy, and the forward and
backward are meant to run without one. Pass ``check_indices=True`` to ``gather_gemm`` / ``fused_edge`` (or
call these functions once per prepared graph) to turn an out-of-range index into an error that names it.
"""

from __future__ import annotations

import torch

from dsx.rgnn.codegen.spec import EdgeSpec

__all__ = ["check_edge_args", "check_edge_indices", "check_index", "check_ptr"]


def check_index(name: str, idx: torch.Tensor | None, bound: int, what: str) -> None:
    """Raise if ``idx`` has a value outside ``[0, bound)`` (``bound`` = rows of ``what``)."""
    if idx is None or idx.numel() == 0:
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= bound:
        raise IndexError(
            f"{name} holds values in [{lo}, {hi}] but {what} has {bound} rows; every {name} value must be in "
            f"[0, {bound}). Rebuild the graph maps (e.g. relation ids >= num_relations or nodes past the node count)."
        )


def check_ptr(name: str, ptr: torch.Tensor, total: int) -> None:
    """Raise unless ``ptr`` is a non-decreasing CSR pointer starting at 0 and ending at ``total``."""
    if ptr.numel() == 0:
        raise ValueError(f"{name} is empty; it needs at least one entry (0)")
    first, last = int(ptr[0]), int(ptr[-1])
    if first != 0 or last != total:
        raise ValueError(
            f"{name} must start at 0 and end at {total} (the number of rows/edges); got {first}..{last}"
        )
    if ptr.numel() > 1 and bool((ptr[1:] < ptr[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing (a CSR pointer over sorted rows/edges)")


def check_edge_indices(spec, dst_ptr, msg, edge_msg_row, edge_src_row, edge_dst_row, src_term, dst_term,
                        edge_rel, rel_scale) -> None:  # fmt: skip
    check_ptr("dst_ptr", dst_ptr, edge_msg_row.numel())
    check_index("edge_msg_row", edge_msg_row, msg.shape[0], "msg")
    if spec.has_logit:
        check_index("edge_src_row", edge_src_row, src_term.shape[0], "src_term")
        check_index("edge_dst_row", edge_dst_row, dst_term.shape[0], "dst_term")
    if spec.rel_scale:
        check_index("edge_rel", edge_rel, rel_scale.shape[0], "rel_scale")


def check_edge_args(spec, dst_ptr, msg, edge_msg_row, edge_src_row, edge_dst_row, src_term, dst_term,
                     edge_rel, rel_scale, edge_weight) -> None:  # fmt: skip
    if not isinstance(spec, EdgeSpec):
        raise TypeError(f"spec must be an EdgeSpec, got {type(spec).__name__}")
    if msg.dim() != 3:
        raise ValueError(f"msg must be [M, H, D], got shape {tuple(msg.shape)}")
    heads = msg.shape[1]
    need = {"dst_ptr": dst_ptr, "edge_msg_row": edge_msg_row}
    if spec.has_logit:
        # edge_dst_row=None means dst_term is indexed by the destination node itself ([N_dst, H(, D')]).
        need.update(edge_src_row=edge_src_row, src_term=src_term, dst_term=dst_term)
    if spec.rel_scale:
        need.update(edge_rel=edge_rel, rel_scale=rel_scale)
    if spec.edge_weight:
        need.update(edge_weight=edge_weight)
    missing = [k for k, v in need.items() if v is None]
    if missing:
        raise ValueError(f"{spec} needs {missing}; pass them as keyword arguments")
    for name in ("dst_ptr", "edge_msg_row", "edge_src_row", "edge_dst_row", "edge_rel"):
        t = need.get(name)
        if t is not None and (t.dtype != torch.int64 or t.device != msg.device):
            raise ValueError(f"{name} must be int64 on {msg.device}; got {t.dtype} on {t.device}")
    if edge_dst_row is not None:
        need["edge_dst_row"] = edge_dst_row
    elif spec.has_logit and dst_term.shape[0] != dst_ptr.numel() - 1:
        raise ValueError(
            f"without edge_dst_row, dst_term is indexed by destination node and needs {dst_ptr.numel() - 1} rows "
            f"(N_dst); got {dst_term.shape[0]}. Pass edge_dst_row to index it per edge."
        )
    num_edges = edge_msg_row.numel()
    for name in ("edge_src_row", "edge_dst_row", "edge_rel", "edge_weight"):
        t = need.get(name)
        if t is not None and t.numel() != num_edges:
            raise ValueError(f"{name} has {t.numel()} entries but there are {num_edges} edges (edge_msg_row)")
    if spec.has_logit:
        want = 2 if spec.score == "add" else 3
        for name, t in (("src_term", src_term), ("dst_term", dst_term)):
            if t.dim() != want or t.shape[1] != heads:
                raise ValueError(
                    f"score={spec.score!r} needs {name} of rank {want} with H={heads} heads in dim 1; "
                    f"got {tuple(t.shape)}"
                )
        if spec.score == "dot" and src_term.shape[2] != dst_term.shape[2]:
            raise ValueError(
                f"src_term and dst_term disagree on D': {src_term.shape[2]} vs {dst_term.shape[2]}"
            )
    if spec.rel_scale and (rel_scale.dim() != 2 or rel_scale.shape[1] != heads):
        raise ValueError(f"rel_scale must be [R, H={heads}], got {tuple(rel_scale.shape)}")
