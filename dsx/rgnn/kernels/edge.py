"""Fused CSR edge kernel (score, softmax, weighting and aggregation in one pass) with autograd."""

from __future__ import annotations

import functools

import torch

from dsx.ops.triton_backend import resolve_backend
from dsx.ops.triton_source import load_source
from dsx.rgnn.codegen import generate_edge_kernel_source
from dsx.rgnn.codegen.spec import EdgeSpec
from dsx.rgnn.kernels.reference import fused_edge_ref
from dsx.rgnn.kernels.validate import check_edge_args, check_edge_indices

__all__ = ["fused_edge"]


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _block_e(block_hd: int, num_edges: int, num_dst: int) -> int:
    # One chunk should cover a typical destination: the mean in-degree (known on the host from the tensor
    # sizes, no synchronisation), rounded up to a power of two, capped so a tile stays near 4K values.
    # Larger chunks would be mostly masked lanes on graphs with mean in-degree 5-30; smaller ones cost a
    # dependent index-load round trip per chunk.
    mean_degree = max(1, -(-num_edges // max(num_dst, 1)))
    return max(4, min(_pow2(mean_degree), max(4, 4096 // block_hd), 128))


@functools.cache
def _module(spec: EdgeSpec, backend: str, node_dst: bool):
    # Cached per (spec, backend, variant), so that emitting and hashing the source stay off every launch.
    source = generate_edge_kernel_source(spec, dst_term_per_node=node_dst)
    return load_source(f"edge_{spec.key()}_n{int(node_dst)}", source, interpret=backend == "interpret")


def _consts(spec: EdgeSpec, heads: int, dim: int, dp: int, block_e: int | None, num_edges: int, num_dst: int):
    block_h, block_d = _pow2(heads), _pow2(dim)
    block_e = _block_e(block_h * block_d, num_edges, num_dst) if block_e is None else _pow2(block_e)
    c = {"H": heads, "D": dim, "BLOCK_H": block_h, "BLOCK_D": block_d, "BLOCK_E": block_e}
    if spec.score == "dot":
        c["DP"] = dp
        c["BLOCK_DP"] = _pow2(dp)
    return c


def _launch_opts(backend: str, consts: dict[str, int]) -> dict[str, int]:
    if backend == "interpret":
        return {}
    tile = consts["BLOCK_E"] * consts["BLOCK_H"] * consts["BLOCK_D"]
    # ~8-16 values per thread: small programs, many resident per SM to hide the gather latency.
    return {"num_warps": 8 if tile >= 8192 else 4 if tile >= 2048 else 2 if tile >= 512 else 1}


class _FusedEdge(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        spec,
        backend,
        block_e,
        dst_ptr,
        msg,
        edge_msg_row,
        idx,
        src_term,
        dst_term,
        rel_scale,
        edge_weight,
    ):
        node_dst = spec.has_logit and idx[1] is None
        mod = _module(spec, backend, node_dst)
        num_dst = dst_ptr.numel() - 1
        _, heads, dim = msg.shape
        dp = src_term.shape[-1] if spec.score == "dot" else 0
        out = torch.empty((num_dst, heads, dim), device=msg.device, dtype=msg.dtype)
        lse = torch.empty((num_dst, heads), device=msg.device, dtype=torch.float32) if spec.softmax else None
        named = {
            "dst_ptr": dst_ptr,
            "msg_ptr": msg,
            "msg_row_ptr": edge_msg_row,
            "out_ptr": out,
            "lse_ptr": lse,
        }
        named.update(_term_tensors(idx, src_term, dst_term, rel_scale, edge_weight))
        consts = _consts(spec, heads, dim, dp, block_e, edge_msg_row.numel(), num_dst)
        if num_dst > 0:
            mod.edge_fwd_kernel[(num_dst,)](
                *[named[a] for a in mod.FWD_ARGS], **consts,
                **_launch_opts(backend, consts),
            )  # fmt: skip
        ctx.spec, ctx.backend, ctx.consts, ctx.node_dst = spec, backend, consts, node_dst
        ctx.msg_meta = (msg.shape, msg.dtype)
        # Backward reads the messages only for a logit's gradient or the edge-weight gradient; otherwise
        # (RGCN) they are not saved, so the [M, H, D] rows are freed as soon as the caller drops them.
        keep_msg = spec.has_logit or (spec.edge_weight and ctx.needs_input_grad[10])
        ctx.save_for_backward(
            dst_ptr, msg if keep_msg else None, edge_msg_row, *idx, src_term, dst_term, rel_scale, edge_weight,
            out if spec.softmax else None, lse,
        )  # fmt: skip
        return out

    @staticmethod
    def backward(ctx, gout):
        spec, backend, consts = ctx.spec, ctx.backend, ctx.consts
        (
            dst_ptr,
            msg,
            edge_msg_row,
            i_src,
            i_dst,
            i_rel,
            src_term,
            dst_term,
            rel_scale,
            edge_weight,
            out,
            lse,
        ) = ctx.saved_tensors
        mod = _module(spec, backend, ctx.node_dst)
        num_dst = dst_ptr.numel() - 1
        gout = gout.contiguous()

        need = ctx.needs_input_grad
        # (kernel pointer, constexpr flag, forward input, needed?) for every gradient the spec can produce.
        msg_shape, msg_dtype = ctx.msg_meta
        table = [("dmsg_ptr", "NEED_DMSG", msg_shape, need[4])]
        if spec.has_logit:
            table += [
                ("dsrc_ptr", "NEED_DSRC", src_term.shape, need[7]),
                ("ddst_ptr", "NEED_DDST", dst_term.shape, need[8]),
            ]
        if spec.rel_scale:
            table.append(("drel_scale_ptr", "NEED_DSCALE", rel_scale.shape, need[9]))
        if spec.edge_weight:
            table.append(("dweight_ptr", "NEED_DW", edge_weight.shape, need[10]))
        grads, flags = {}, {}
        for ptr, flag, shape, wanted in table:
            # A gradient nobody needs is not computed (its atomics are compiled out); the kernel still needs a
            # pointer argument, so it gets gout, which it never writes.
            grads[ptr] = torch.zeros(shape, device=gout.device, dtype=torch.float32) if wanted else None
            flags[flag] = bool(wanted)
        launch_grads = {k: (gout if v is None else v) for k, v in grads.items()}
        named = {
            # A message tensor that was not saved is never read by this kernel variant (see edge_bwd.py).
            "dst_ptr": dst_ptr, "msg_ptr": gout if msg is None else msg, "msg_row_ptr": edge_msg_row,
            "gout_ptr": gout, "out_ptr": out, "lse_ptr": lse, **launch_grads,
        }  # fmt: skip
        named.update(_term_tensors((i_src, i_dst, i_rel), src_term, dst_term, rel_scale, edge_weight))
        if num_dst > 0 and any(flags.values()):
            mod.edge_bwd_kernel[(num_dst,)](
                *[named[a] for a in mod.BWD_ARGS], **consts, **flags,
                **_launch_opts(backend, consts),
            )  # fmt: skip

        def cast(g, like):
            return (
                None
                if g is None or like is None
                else g.to(like if isinstance(like, torch.dtype) else like.dtype)
            )

        return (
            None, None, None, None,
            cast(grads.get("dmsg_ptr"), msg_dtype), None, None,
            cast(grads.get("dsrc_ptr"), src_term), cast(grads.get("ddst_ptr"), dst_term),
            cast(grads.get("drel_scale_ptr"), rel_scale), cast(grads.get("dweight_ptr"), edge_weight),
        )  # fmt: skip


def _term_tensors(idx, src_term, dst_term, rel_scale, edge_weight) -> dict[str, torch.Tensor | None]:
    i_src, i_dst, i_rel = idx
    return {
        "src_row_ptr": i_src, "dst_row_ptr": i_dst, "src_term_ptr": src_term, "dst_term_ptr": dst_term,
        "edge_rel_ptr": i_rel, "rel_scale_ptr": rel_scale, "edge_weight_ptr": edge_weight,
    }  # fmt: skip


def fused_edge(
    spec: EdgeSpec,
    dst_ptr: torch.Tensor,
    msg: torch.Tensor,
    edge_msg_row: torch.Tensor,
    *,
    edge_src_row: torch.Tensor | None = None,
    edge_dst_row: torch.Tensor | None = None,
    src_term: torch.Tensor | None = None,
    dst_term: torch.Tensor | None = None,
    edge_rel: torch.Tensor | None = None,
    rel_scale: torch.Tensor | None = None,
    edge_weight: torch.Tensor | None = None,
    backend: str | None = None,
    block_e: int | None = None,
    check_indices: bool = False,
) -> torch.Tensor:
    """Edge softmax + aggregation over a destination-CSR; see :mod:`dsx.rgnn.kernels` for the contract.

    ``block_e`` (optional) sets the edge-chunk length (rounded up to a power of two); by default it is the
    mean in-degree rounded up to a power of two, capped so that a chunk holds at most ~4K values.
    ``check_indices=True`` validates ``dst_ptr`` and every index range first (synchronises with the host; the
    kernels themselves never check indices).

    Returns ``out [N_dst, H, D]`` in ``msg.dtype``. Forward reads each edge's message row once and writes
    one row per (node, head) plus, with softmax, one log-sum-exp float; backward recomputes alpha.
    """
    check_edge_args(spec, dst_ptr, msg, edge_msg_row, edge_src_row, edge_dst_row, src_term, dst_term,
                     edge_rel, rel_scale, edge_weight)  # fmt: skip
    if check_indices:
        check_edge_indices(spec, dst_ptr, msg, edge_msg_row, edge_src_row, edge_dst_row, src_term, dst_term,
                            edge_rel, rel_scale)  # fmt: skip
    chosen = resolve_backend(backend, msg.device)
    if chosen == "reference":
        return fused_edge_ref(
            spec, dst_ptr, msg, edge_msg_row, edge_src_row=edge_src_row, edge_dst_row=edge_dst_row,
            src_term=src_term, dst_term=dst_term, edge_rel=edge_rel, rel_scale=rel_scale, edge_weight=edge_weight,
        )  # fmt: skip

    def c(t):
        return None if t is None else t.contiguous()

    idx = (c(edge_src_row), c(edge_dst_row), c(edge_rel))
    return _FusedEdge.apply(
        spec, chosen, block_e, c(dst_ptr), c(msg), c(edge_msg_row), idx,
        c(src_term), c(dst_term), c(rel_scale), c(edge_weight),
    )  # fmt: skip
