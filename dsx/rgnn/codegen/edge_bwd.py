"""Emit the backward edge kernel: recompute alpha from the stored log-sum-exp, scatter the gradients."""

from __future__ import annotations

from dsx.rgnn.codegen.edge_parts import (
    SUM,
    chunk_prologue,
    guard,
    ind,
    logit_lines,
    preamble,
    signature,
    term_args,
)
from dsx.rgnn.codegen.spec import EdgeSpec

__all__ = ["backward_kernel", "bwd_flags"]


def backward_kernel(spec: EdgeSpec, node_dst: bool) -> tuple[list[str], list[str]]:
    """(pointer-argument names, source lines) of ``edge_bwd_kernel``."""
    args = ["dst_ptr", "msg_ptr", "msg_row_ptr", *term_args(spec, node_dst), "gout_ptr", "dmsg_ptr"]
    if spec.softmax:
        args += ["out_ptr", "lse_ptr"]
    if spec.has_logit:
        args += ["dsrc_ptr", "ddst_ptr"]
    if spec.rel_scale:
        args.append("drel_scale_ptr")
    if spec.edge_weight:
        args.append("dweight_ptr")
    body = [
        *preamble(spec, node_dst),
        "go = tl.load(gout_ptr + o_off, mask=hd_mask, other=0.0).to(tl.float32)",
    ]
    if node_dst and spec.score == "add":
        body.append("gtd = tl.full([BLOCK_H], 0.0, tl.float32)  # d dst_term[v]: summed in registers")
    elif node_dst and spec.score == "dot":
        body.append(
            "gtd = tl.full([BLOCK_H, BLOCK_DP], 0.0, tl.float32)  # d dst_term[v]: summed in registers"
        )
    if spec.softmax:
        body += [
            "o = tl.load(out_ptr + o_off, mask=hd_mask, other=0.0).to(tl.float32)",
            f"delta = tl.reduce(o * go, 1, {SUM})  # per head: sum_e alpha_e <msg_e, dout> (softmax Jacobian)",
            "lse = tl.load(lse_ptr + v * H + offs_h, mask=h_mask, other=0.0)",
        ]
    xg = f"xg = tl.reduce(x * go[None, :, :], 2, {SUM})  # <msg_e, dout_v> per head"
    if spec.has_logit:
        loop = [*chunk_prologue(), xg]
    else:
        # Without a logit the messages feed only the edge-weight gradient: the kernel reads them only under
        # NEED_DW, so the forward need not keep them alive for backward (RGCN frees its [M, D] rows).
        loop = [*chunk_prologue(load_x=False)]
    if spec.has_logit:
        loop += logit_lines(spec, node_dst)
    if spec.edge_weight:
        loop.append("w = tl.load(edge_weight_ptr + offs_e, mask=e_mask, other=0.0).to(tl.float32)[:, None]")
    # p: the normalised score before the edge weight; alpha = p * w; ds = dL/d(final logit).
    if spec.softmax:
        loop += ["p = tl.where(eh_mask, tl.exp(s - lse[None, :]), 0.0)"]
        if spec.edge_weight:
            loop += ["alpha = p * w", "ds = p * (w * xg - delta[None, :])"]
        else:
            loop += ["alpha = p", "ds = p * (xg - delta[None, :])"]
    elif spec.has_logit:
        loop += ["p = s"]
        loop += ["alpha = s * w", "ds = w * xg"] if spec.edge_weight else ["alpha = s", "ds = xg"]
    else:
        loop += ["p = tl.where(eh_mask, 1.0, 0.0)", "alpha = p * w" if spec.edge_weight else "alpha = p"]
    if spec.edge_weight:
        # xg is 0 on padded heads and masked edges, so the head sum needs no extra mask; one atomic per edge.
        load = [] if spec.has_logit else ["x = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)", xg]
        loop += guard(
            "NEED_DW",
            [*load, f"tl.atomic_add(dweight_ptr + offs_e, tl.reduce(p * xg, 1, {SUM}), mask=e_mask)"],
        )
    loop += guard(
        "NEED_DMSG",
        [
            "tl.atomic_add(dmsg_ptr + rows[:, None, None] * (H * D) + offs_h[None, :, None] * D"
            " + offs_d[None, None, :],",
            "              alpha[:, :, None] * go[None, :, :], mask=x_mask)",
        ],
    )
    if spec.has_logit:
        if spec.rel_scale:
            loop += guard(
                "NEED_DSCALE",
                [
                    "tl.atomic_add(drel_scale_ptr + rel[:, None] * H + offs_h[None, :], ds * act, mask=eh_mask)"
                ],
            )
            loop.append("dact = ds * sc")
        else:
            loop.append("dact = ds")
        if spec.leaky_relu_slope is not None:
            loop.append(f"draw = tl.where(raw > 0, dact, dact * {spec.leaky_relu_slope!r})")
        else:
            loop.append("draw = dact")
        if spec.score == "add":
            loop += guard(
                "NEED_DSRC",
                ["tl.atomic_add(dsrc_ptr + srow[:, None] * H + offs_h[None, :], draw, mask=eh_mask)"],
            )
            if node_dst:
                loop += guard("NEED_DDST", [f"gtd += tl.reduce(tl.where(eh_mask, draw, 0.0), 0, {SUM})"])
            else:
                loop += guard(
                    "NEED_DDST",
                    ["tl.atomic_add(ddst_ptr + drow[:, None] * H + offs_h[None, :], draw, mask=eh_mask)"],
                )
        else:
            td = "td[None, :, :]" if node_dst else "td"
            loop += guard(
                "NEED_DSRC",
                [
                    "tl.atomic_add(dsrc_ptr + srow[:, None, None] * (H * DP) + hp, "
                    f"draw[:, :, None] * {td}, mask=p_mask)"
                ],
            )
            if node_dst:
                loop += guard(
                    "NEED_DDST",
                    [f"gtd += tl.reduce(draw[:, :, None] * ts, 0, {SUM})  # ts is 0 on masked lanes"],
                )
            else:
                loop += guard(
                    "NEED_DDST",
                    [
                        "tl.atomic_add(ddst_ptr + drow[:, None, None] * (H * DP) + hp, draw[:, :, None] * ts, "
                        "mask=p_mask)"
                    ],
                )
    body += ["for e0 in range(start, end, BLOCK_E):", *ind(loop, 4)]
    if node_dst and spec.score == "add":
        body += guard(
            "NEED_DDST", ["tl.store(ddst_ptr + v * H + offs_h, gtd, mask=h_mask)  # one writer per row"]
        )
    elif node_dst and spec.score == "dot":
        body += guard("NEED_DDST", ["tl.store(ddst_ptr + td_off, gtd, mask=hp_mask)  # one writer per row"])
    return args, signature("edge_bwd_kernel", args, spec, bwd_flags(spec)) + ind(body, 4)


def bwd_flags(spec: EdgeSpec) -> tuple[str, ...]:
    """Constexpr flags of the backward kernel, in order: which gradients to compute."""
    flags = ["NEED_DMSG"]
    if spec.has_logit:
        flags += ["NEED_DSRC", "NEED_DDST"]
    if spec.rel_scale:
        flags.append("NEED_DSCALE")
    if spec.edge_weight:
        flags.append("NEED_DW")
    return tuple(flags)
