"""Validation shared by the scaling rules.

Every message names the rule, the parameter (by its Hugging Face key) and the value,
so that a bad ``config.json`` can be fixed without reading ropekit's source.
"""

from __future__ import annotations

import math
from typing import Any


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_number(rule: str, key: str, value: Any, *, low: float | None = None, strict: bool = False) -> float:
    """Return ``float(value)`` if it is a finite number (``> low`` if strict, else ``>= low``)."""
    if not _is_number(value):
        raise ValueError(f"{rule}: {key} must be a finite number, got {value!r}")
    value = float(value)
    if low is not None and (value <= low if strict else value < low):
        raise ValueError(f"{rule}: {key} must be {'>' if strict else '>='} {low:g}, got {value!r}")
    return value


def check_optional_number(rule: str, key: str, value: Any, **bounds: Any) -> float | None:
    """Like :func:`check_number`, letting ``None`` through."""
    return None if value is None else check_number(rule, key, value, **bounds)


def check_factor(rule: str, value: Any, key: str = "factor") -> float:
    """A context-extension factor: a finite number ``>= 1`` (``1`` means no extension)."""
    return check_number(rule, key, value, low=1.0)


def check_length(rule: str, key: str, value: Any) -> int:
    """A sequence length: a positive int (an integral float from JSON is accepted)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{rule}: {key} must be a positive int, got {value!r}")
    return value


def check_optional_length(rule: str, key: str, value: Any) -> int | None:
    """Like :func:`check_length`, letting ``None`` through."""
    return None if value is None else check_length(rule, key, value)


def check_factor_list(rule: str, key: str, value: Any) -> tuple[float, ...]:
    """A non-empty list of finite numbers ``> 0`` (LongRoPE's per-frequency rescale factors)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{rule}: {key} must be a list of numbers, got {value!r}")
    items = tuple(value)
    if not items:
        raise ValueError(f"{rule}: {key} must not be empty, got {value!r}")
    for i, item in enumerate(items):
        if not _is_number(item) or item <= 0:
            raise ValueError(f"{rule}: {key}[{i}] must be a finite number > 0, got {item!r}")
    return tuple(float(item) for item in items)


def check_base_above_one(rule: str, base: float) -> None:
    """Rules that take ``log(base)`` need ``base > 1``."""
    if not base > 1.0:
        raise ValueError(f"{rule}: base (rope_theta) must be > 1, got {base!r}")
