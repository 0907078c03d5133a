"""Shared pieces of the edge-kernel emitter: indentation, guards, signatures, loads and logits."""

from __future__ import annotations

from dsx.rgnn.codegen.spec import EdgeSpec

__all__ = [
    "MAX", "SUM", "chunk_prologue", "guard", "ind", "logit_lines", "preamble", "signature", "term_args",
]  # fmt: skip

SUM = "tl.standard._sum_combine"
MAX = "tl.standard._elementwise_max"


def ind(lines: list[str], n: int) -> list[str]:
    return [(" " * n + ln) if ln else ln for ln in lines]


def term_args(spec: EdgeSpec, node_dst: bool) -> list[str]:
    args = []
    if spec.has_logit:
        args += ["src_row_ptr"] + ([] if node_dst else ["dst_row_ptr"]) + ["src_term_ptr", "dst_term_ptr"]
    if spec.rel_scale:
        args += ["edge_rel_ptr", "rel_scale_ptr"]
    if spec.edge_weight:
        args += ["edge_weight_ptr"]
    return args


def chunk_prologue(load_x: bool = True) -> list[str]:
    """Per edge chunk: offsets, masks, message rows and (``load_x``) the message values ``x``."""
    lines = [
        "offs_e = e0 + tl.arange(0, BLOCK_E)",
        "e_mask = offs_e < end",
        "rows = tl.load(msg_row_ptr + offs_e, mask=e_mask, other=0)",
        "eh_mask = e_mask[:, None] & h_mask[None, :]",
        "x_ptrs = msg_ptr + rows[:, None, None] * (H * D) + offs_h[None, :, None] * D + offs_d[None, None, :]",
        "x_mask = eh_mask[:, :, None] & d_mask[None, None, :]",
    ]
    return [*lines, "x = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)"] if load_x else lines


def logit_lines(spec: EdgeSpec, node_dst: bool) -> list[str]:
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
            out.append(f"raw = tl.reduce(ts * td[None, :, :], 2, {SUM})")
        else:
            out += [
                "td_ptrs = dst_term_ptr + drow[:, None, None] * (H * DP) + hp",
                "td = tl.load(td_ptrs, mask=p_mask, other=0.0).to(tl.float32)",
                f"raw = tl.reduce(ts * td, 2, {SUM})",
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


def guard(flag: str, lines: list[str]) -> list[str]:
    """Emit ``lines`` under a constexpr flag: a gradient nobody asked for costs no atomics (dead code)."""
    return [f"if {flag}:", *ind(lines, 4)]


def signature(name: str, ptr_args: list[str], spec: EdgeSpec, flags: tuple[str, ...] = ()) -> list[str]:
    consts = ["H: tl.constexpr", "D: tl.constexpr"]
    if spec.score == "dot":
        consts.append("DP: tl.constexpr")
    consts += ["BLOCK_E: tl.constexpr", "BLOCK_H: tl.constexpr", "BLOCK_D: tl.constexpr"]
    if spec.score == "dot":
        consts.append("BLOCK_DP: tl.constexpr")
    consts += [f"{f}: tl.constexpr" for f in flags]
    return ["@triton.jit", f"def {name}(", *ind([a + "," for a in ptr_args + consts], 8), "):"]


def preamble(spec: EdgeSpec, node_dst: bool) -> list[str]:
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
