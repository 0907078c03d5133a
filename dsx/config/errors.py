"""Validation errors as lines a user can act on: the key path, the value given and what is allowed."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError

from dsx.config.sections import DsxConfig

__all__ = ["DSX_KEY", "DsxConfigError", "format_errors"]

DSX_KEY = "dsx"


class DsxConfigError(ValueError):
    """A bad key or value in the ``"dsx"`` section (or a config that cannot be read at all)."""


# --------------------------------------------------------------------------------------------- errors

# keys that older configs may still carry -> where the setting lives now
_MOVED: dict[tuple[str, ...], str] = {
    ("activation_offload", "io_threads"): "scheduler.io_workers",
}


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class whose field set applies at ``loc`` (for listing valid keys)."""
    model: type[BaseModel] = DsxConfig
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return model
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return model
    return model


def _fmt_loc(loc: tuple[Any, ...]) -> str:
    out = DSX_KEY
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isascii() and part.isidentifier():
            out += f".{part}"
        else:  # keys that are not identifiers are shown quoted, so that the path stays unambiguous
            out += f"[{json.dumps(part)}]"
    return out


def _allowed(err: dict[str, Any]) -> str:
    kind, ctx = err["type"], err.get("ctx", {})
    simple = {
        "bool_type": "true or false",
        "int_type": "an integer",
        "float_type": "a number",
        "string_type": "a string",
        "list_type": "a list",
        "model_type": "an object",
        "dict_type": "an object",
        "none_required": "null",
        "finite_number": "a finite number",
    }
    if kind in simple:
        return simple[kind]
    if kind == "literal_error":
        return f"one of {ctx.get('expected')}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        sign = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[
            kind
        ]
        bound = next(iter(ctx.values()))
        return f"a number {sign} {bound}"
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", err["msg"]))
    if kind == "too_short":
        return f"a list of at least {ctx.get('min_length')} item(s)"
    if kind == "too_long":
        return f"a list of at most {ctx.get('max_length')} item(s)"
    return err["msg"]


def format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        # Union members add their own loc part ("float", "none", "list[...]"); drop those for the path.
        loc = tuple(
            p for p in loc if not (isinstance(p, str) and ("[" in p or p in {"float", "none", "int"}))
        )
        if err["type"] == "extra_forbidden":
            moved = _MOVED.get(tuple(loc))
            if moved is not None:
                lines.append(f"{_fmt_loc(loc)}: this key moved: use {DSX_KEY}.{moved} instead")
                continue
            model = _model_at(loc[:-1])
            valid = ", ".join(model.model_fields) if model is not None else "?"
            lines.append(f"{_fmt_loc(loc)}: unknown key; valid keys here are: {valid}")
            continue
        if err["type"] == "dsx_missing":  # a key that must be given (its message says which and why)
            lines.append(f"{_fmt_loc(loc)}: {err['msg']}")
            continue
        value = err.get("input")
        shown = json.dumps(value, default=repr)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        if err["type"] in ("value_error", "assertion_error"):  # our checks: the message says what is wrong
            lines.append(f"{_fmt_loc(loc)}: {shown} {err.get('ctx', {}).get('error', err['msg'])}")
            continue
        lines.append(f"{_fmt_loc(loc)}: value {shown} is not allowed; expected {_allowed(err)}")
    # One line per problem, deduplicated (a union reports each member's failure).
    seen: list[str] = []
    for line in lines:
        if line not in seen:
            seen.append(line)
    return "invalid dsx config:\n  " + "\n  ".join(seen)
