"""Emit the fused CSR edge kernels (forward and backward) for one ``EdgeSpec``.

The kernels run one program per destination node covering all heads: tiles are
``[BLOCK_E, BLOCK_H, BLOCK_D]`` (edges x heads x features, heads and features padded to powers of two and
masked), so an edge's message row (``H * D`` contiguous values) is one coalesced load. The forward walks the
destination's incoming edges in chunks of ``BLOCK_E``, forms the logits ``[BLOCK_E, BLOCK_H]`` from the spec
(add / dot score, leaky ReLU, relation scale), keeps a running max and sum per head (online, max-stabilised
softmax, as in flash attention) and accumulates ``alpha * msg``; it stores the output row and the per-(node,
head) log-sum-exp. The backward recomputes alpha from that log-sum-exp (nothing of size ``E x H`` is saved) and
uses ``delta = <out, dout>`` per (node, head) for the softmax Jacobian. Gradients of rows shared by edges are
scattered with ``tl.atomic_add``.

Only the code a spec needs is emitted: the argument lists, loads and gradient scatters follow the spec, and
the generated module exports ``FWD_ARGS`` / ``BWD_ARGS`` (kernel pointer-argument names in order) so the
launcher passes exactly those. All address arithmetic is int64: program ids are widened before use and the
index arrays are int64.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsx.rgnn.kernels.spec import EdgeSpec

__all__ = ["generate_edge_kernel_source"]

EMITTER_VERSION = 4
_SUM = "tl.standard._sum_combine"
_MAX = "tl.standard._elementwise_max"


def _ind(lines: list[str], n: int) -> list[str]:
    return [(" " * n + ln) if ln else ln for ln in lines]


def _term_args(spec: EdgeSpec, node_dst: bool) -> list[str]:
    args = []
    if spec.has_logit:
        args += ["src_row_ptr"] + ([] if node_dst else ["dst_row_ptr"]) + ["src_term_ptr", "dst_term_ptr"]
    if spec.rel_scale:
        args += ["edge_rel_ptr", "rel_scale_ptr"]
    if spec.edge_weight:
        args += ["edge_weight_ptr"]
    return args


def _chunk_prologue() -> list[str]:
    return [
        "offs_e = e0 + tl.arange(0, BLOCK_E)",
        "e_mask = offs_e < end",
        "rows = tl.load(msg_row_ptr + offs_e, mask=e_mask, other=0)",
        "eh_mask = e_mask[:, None] & h_mask[None, :]",
        "x_ptrs = msg_ptr + rows[:, None, None] * (H * D) + offs_h[None, :, None] * D + offs_d[None, None, :]",
        "x_mask = eh_mask[:, :, None] & d_mask[None, None, :]",
        "x = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)",
    ]


def _logit_lines(spec: EdgeSpec, node_dst: bool) -> list[str]:
    """Compute ``s`` (final logit, [BLOCK_E, BLOCK_H]); keep ``raw`` (pre-activation) and ``act`` for backward."""
    out = ["srow = tl.load(src_row_ptr + offs_e, mask=e_mask, other=0)"]
    if not node_dst:
        out.append("drow = tl.load(dst_row_ptr + offs_e, mask=e_mask, other=0)")
    if spec.score == "add":
        out.append(
            "ts = tl.load(src_term_ptr + srow[:, None] * H + offs_h[None, :], mask=eh_mask, other=0.0).to(tl.float32)"
        )
        if node_dst:  # td [BLOCK_H] was loaded once per destination in the preamble
            out.append("raw = ts + td[None, :]")
        else:
            out.append(
                "td = tl.load(dst_term_ptr + drow[:, None] * H + offs_h[None, :], mask=eh_mask, other=0.0)"
                ".to(tl.float32)"
            )
            out.append("raw = ts + td")
    else:  # dot
        out += [
            "p_mask = eh_mask[:, :, None] & dp_mask[None, None, :]",
            "hp = offs_h[None, :, None] * DP + offs_p[None, None, :]",
            "ts_ptrs = src_term_ptr + srow[:, None, None] * (H * DP) + hp",
            "ts = tl.load(ts_ptrs, mask=p_mask, other=0.0).to(tl.float32)",
        ]
        if node_dst:  # td [BLOCK_H, BLOCK_DP] was loaded once per destination in the preamble
            out.append(f"raw = tl.reduce(ts * td[None, :, :], 2, {_SUM})")
        else:
            out += [
                "td_ptrs = dst_term_ptr + drow[:, None, None] * (H * DP) + hp",
                "td = tl.load(td_ptrs, mask=p_mask, other=0.0).to(tl.float32)",
                f"raw = tl.reduce(ts * td, 2, {_SUM})",
            ]
    if spec.leaky_relu_slope is not None:
        out.append(f"act = tl.where(raw > 0, raw, raw * {spec.leaky_relu_slope!r})")
    else:
        out.append("act = raw")
    if spec.rel_scale:
        out += [
            "rel = tl.load(edge_rel_ptr + offs_e, mask=e_mask, other=0)",
            "sc = tl.load(rel_scale_ptr + rel[:, None] * H + offs_h[None, :], mask=eh_mask, other=0.0).to(tl.float32)",
            "s = act * sc",
        ]
    else:
        out.append("s = act")
    return out


def _guard(flag: str, lines: list[str]) -> list[str]:
    """Emit ``lines`` under a constexpr flag: a gradient nobody asked for costs no atomics (dead code)."""
    return [f"if {flag}:", *_ind(lines, 4)]


def _signature(name: str, ptr_args: list[str], spec: EdgeSpec, flags: tuple[str, ...] = ()) -> list[str]:
    consts = ["H: tl.constexpr", "D: tl.constexpr"]
    if spec.score == "dot":
        consts.append("DP: tl.constexpr")
    consts += ["BLOCK_E: tl.constexpr", "BLOCK_H: tl.constexpr", "BLOCK_D: tl.constexpr"]
    if spec.score == "dot":
        consts.append("BLOCK_DP: tl.constexpr")
    consts += [f"{f}: tl.constexpr" for f in flags]
    return ["@triton.jit", f"def {name}(", *_ind([a + "," for a in ptr_args + consts], 8), "):"]


def _preamble(spec: EdgeSpec, node_dst: bool) -> list[str]:
    out = [
        "v = tl.program_id(0).to(tl.int64)  # destination node; int64 so v * (H * D) cannot overflow",
        "start = tl.load(dst_ptr + v)",
        "end = tl.load(dst_ptr + v + 1)",
        "offs_h = tl.arange(0, BLOCK_H)",
        "h_mask = offs_h < H",
        "offs_d = tl.arange(0, BLOCK_D)",
        "d_mask = offs_d < D",
        "hd_mask = h_mask[:, None] & d_mask[None, :]",
        "o_off = v * (H * D) + offs_h[:, None] * D + offs_d[None, :]",
    ]
    if spec.score == "dot":
        out += ["offs_p = tl.arange(0, BLOCK_DP)", "dp_mask = offs_p < DP"]
    if node_dst and spec.score == "add":
        out.append("td = tl.load(dst_term_ptr + v * H + offs_h, mask=h_mask, other=0.0).to(tl.float32)")
    elif node_dst and spec.score == "dot":
        out += [
            "hp_mask = h_mask[:, None] & dp_mask[None, :]",
            "td_off = v * (H * DP) + offs_h[:, None] * DP + offs_p[None, :]",
            "td = tl.load(dst_term_ptr + td_off, mask=hp_mask, other=0.0).to(tl.float32)",
        ]
    return out


def _forward(spec: EdgeSpec, node_dst: bool) -> tuple[list[str], list[str]]:
    args = ["dst_ptr", "msg_ptr", "msg_row_ptr", *_term_args(spec, node_dst), "out_ptr"]
    if spec.softmax:
        args.append("lse_ptr")
    body = [*_preamble(spec, node_dst), "acc = tl.full([BLOCK_H, BLOCK_D], 0.0, tl.float32)"]
    if spec.softmax:
        body += [
            "m_i = tl.full([BLOCK_H], float('-inf'), tl.float32)  # running max per head",
            "l_i = tl.full([BLOCK_H], 0.0, tl.float32)  # running sum per head",
        ]
    loop = _chunk_prologue()
    if spec.has_logit:
        loop += _logit_lines(spec, node_dst)
    if spec.edge_weight:
        loop.append("w = tl.load(edge_weight_ptr + offs_e, mask=e_mask, other=0.0).to(tl.float32)[:, None]")
    if spec.softmax:
        loop += [
            # Mask by edge only: padded heads see finite logits (0), so their max never stays -inf (no NaN).
            "s = tl.where(e_mask[:, None], s, float('-inf'))",
            f"m_new = tl.maximum(m_i, tl.reduce(s, 0, {_MAX}))  # finite: every chunk has an edge",
            "corr = tl.exp(m_i - m_new)",
            "p = tl.exp(s - m_new[None, :])",
            f"l_i = l_i * corr + tl.reduce(p, 0, {_SUM})",
            "a = p * w" if spec.edge_weight else "a = p",
            f"acc = acc * corr[:, None] + tl.reduce(a[:, :, None] * x, 0, {_SUM})",
            "m_i = m_new",
        ]
    else:
        if spec.has_logit:
            loop.append("a = s * w" if spec.edge_weight else "a = s")
            loop.append(f"acc += tl.reduce(a[:, :, None] * x, 0, {_SUM})")
        elif spec.edge_weight:
            loop.append(f"acc += tl.reduce(w[:, :, None] * x, 0, {_SUM})")
        else:
            loop.append(f"acc += tl.reduce(x, 0, {_SUM})")
    body += ["for e0 in range(start, end, BLOCK_E):", *_ind(loop, 4)]
    if spec.softmax:
        body += [
            "has = l_i > 0",
            "l_safe = tl.where(has, l_i, 1.0)",
            "acc = acc / l_safe[:, None]",
            "tl.store(lse_ptr + v * H + offs_h, tl.where(has, m_i + tl.log(l_safe), 0.0), mask=h_mask)",
        ]
    body.append("tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=hd_mask)")
    return args, _signature("edge_fwd_kernel", args, spec) + _ind(body, 4)


def _backward(spec: EdgeSpec, node_dst: bool) -> tuple[list[str], list[str]]:
    args = ["dst_ptr", "msg_ptr", "msg_row_ptr", *_term_args(spec, node_dst), "gout_ptr", "dmsg_ptr"]
    if spec.softmax:
        args += ["out_ptr", "lse_ptr"]
    if spec.has_logit:
        args += ["dsrc_ptr", "ddst_ptr"]
    if spec.rel_scale:
        args.append("drel_scale_ptr")
    if spec.edge_weight:
        args.append("dweight_ptr")
    body = [
        *_preamble(spec, node_dst),
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
            f"delta = tl.reduce(o * go, 1, {_SUM})  # per head: sum_e alpha_e <msg_e, dout> (softmax Jacobian)",
            "lse = tl.load(lse_ptr + v * H + offs_h, mask=h_mask, other=0.0)",
        ]
    loop = [*_chunk_prologue(), f"xg = tl.reduce(x * go[None, :, :], 2, {_SUM})  # <msg_e, dout_v> per head"]
    if spec.has_logit:
        loop += _logit_lines(spec, node_dst)
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
        loop += _guard(
            "NEED_DW", [f"tl.atomic_add(dweight_ptr + offs_e, tl.reduce(p * xg, 1, {_SUM}), mask=e_mask)"]
        )
    loop += _guard(
        "NEED_DMSG",
        [
            "tl.atomic_add(dmsg_ptr + rows[:, None, None] * (H * D) + offs_h[None, :, None] * D"
            " + offs_d[None, None, :],",
            "              alpha[:, :, None] * go[None, :, :], mask=x_mask)",
        ],
    )
    if spec.has_logit:
        if spec.rel_scale:
            loop += _guard(
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
            loop += _guard(
                "NEED_DSRC",
                ["tl.atomic_add(dsrc_ptr + srow[:, None] * H + offs_h[None, :], draw, mask=eh_mask)"],
            )
            if node_dst:
                loop += _guard("NEED_DDST", [f"gtd += tl.reduce(tl.where(eh_mask, draw, 0.0), 0, {_SUM})"])
            else:
                loop += _guard(
                    "NEED_DDST",
                    ["tl.atomic_add(ddst_ptr + drow[:, None] * H + offs_h[None, :], draw, mask=eh_mask)"],
                )
        else:
            td = "td[None, :, :]" if node_dst else "td"
            loop += _guard(
                "NEED_DSRC",
                [
                    "tl.atomic_add(dsrc_ptr + srow[:, None, None] * (H * DP) + hp, "
                    f"draw[:, :, None] * {td}, mask=p_mask)"
                ],
            )
            if node_dst:
                loop += _guard(
                    "NEED_DDST",
                    [f"gtd += tl.reduce(draw[:, :, None] * ts, 0, {_SUM})  # ts is 0 on masked lanes"],
                )
            else:
                loop += _guard(
                    "NEED_DDST",
                    [
                        "tl.atomic_add(ddst_ptr + drow[:, None, None] * (H * DP) + hp, draw[:, :, None] * ts, "
                        "mask=p_mask)"
                    ],
                )
    body += ["for e0 in range(start, end, BLOCK_E):", *_ind(loop, 4)]
    if node_dst and spec.score == "add":
        body += _guard(
            "NEED_DDST", ["tl.store(ddst_ptr + v * H + offs_h, gtd, mask=h_mask)  # one writer per row"]
        )
    elif node_dst and spec.score == "dot":
        body += _guard("NEED_DDST", ["tl.store(ddst_ptr + td_off, gtd, mask=hp_mask)  # one writer per row"])
    return args, _signature("edge_bwd_kernel", args, spec, _bwd_flags(spec)) + _ind(body, 4)


def _bwd_flags(spec: EdgeSpec) -> tuple[str, ...]:
    """Constexpr flags of the backward kernel, in order: which gradients to compute."""
    flags = ["NEED_DMSG"]
    if spec.has_logit:
        flags += ["NEED_DSRC", "NEED_DDST"]
    if spec.rel_scale:
        flags.append("NEED_DSCALE")
    if spec.edge_weight:
        flags.append("NEED_DW")
    return tuple(flags)


def generate_edge_kernel_source(spec: EdgeSpec, *, dst_term_per_node: bool = False) -> str:
    """Return the Triton source (forward + backward kernels) for ``spec`` as one importable module.

    ``dst_term_per_node=True`` emits the variant where ``dst_term`` is indexed by the destination node itself
    (no ``edge_dst_row``): it is loaded once per program and its gradient is summed in registers and stored
    once per node, without atomics.
    """
    node_dst = bool(dst_term_per_node) and spec.has_logit
    fwd_args, fwd = _forward(spec, node_dst)
    bwd_args, bwd = _backward(spec, node_dst)
    mode = " (dst_term per destination node)" if node_dst else ""
    lines = [
        f'"""Generated by dsx.rgnn.codegen.edge (emitter v{EMITTER_VERSION}) for {spec!r}{mode}; do not edit."""',
        "import triton",
        "import triton.language as tl",
        "",
        f"FWD_ARGS = {fwd_args!r}",
        f"BWD_ARGS = {bwd_args!r}",
        f"BWD_FLAGS = {_bwd_flags(spec)!r}",
        "",
        "",
        *fwd,
        "",
        "",
        *bwd,
        "",
    ]
    return "\n".join(lines)
