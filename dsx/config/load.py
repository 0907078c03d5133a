"""Reading a DeepSpeed config (a path or a dict) and validating its ``"dsx"`` section."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dsx.config.errors import DSX_KEY, DsxConfigError, format_errors
from dsx.config.sections import DsxConfig

__all__ = ["load_deepspeed_config", "parse_dsx_config", "split_config"]

# ------------------------------------------------------------------------------------------- parsing


def parse_dsx_config(section: Any) -> DsxConfig:
    """Validate a ``"dsx"`` section (a mapping, or None for all-off).

    Raises
    ------
    DsxConfigError
        With one line per problem: key path, value given and what is allowed.
    """
    if section is None:
        return DsxConfig()
    if not isinstance(section, Mapping):
        raise DsxConfigError(
            f"invalid dsx config:\n  {DSX_KEY}: value {json.dumps(section, default=repr)[:80]} is not allowed; "
            "expected an object"
        )
    try:
        return DsxConfig.model_validate(dict(section))
    except ValidationError as exc:
        raise DsxConfigError(format_errors(exc)) from None


def load_deepspeed_config(config: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Read a DeepSpeed config given as a path or a dict (the dict is copied, never changed)."""
    if isinstance(config, Mapping):
        return json.loads(json.dumps(config))
    path = Path(config)
    if not path.is_file():
        raise DsxConfigError(f"DeepSpeed config {str(path)!r} does not exist or is not a file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DsxConfigError(f"DeepSpeed config {str(path)!r} is not valid JSON: {exc}") from None


def split_config(config: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[dict[str, Any], DsxConfig]:
    """Split a DeepSpeed config into what DeepSpeed reads and the validated ``"dsx"`` section."""
    raw = load_deepspeed_config(config)
    if not isinstance(raw, dict):
        raise DsxConfigError("a DeepSpeed config must be a JSON object")
    section = raw.pop(DSX_KEY, None)
    return raw, parse_dsx_config(section)
