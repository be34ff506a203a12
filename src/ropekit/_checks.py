"""Argument validation shared by every public entry point.

Every error names the argument, what was expected and what was given, so that a
caller can fix the call without reading ropekit's source.
"""

from __future__ import annotations

import torch

LAYOUTS = ("half", "interleaved")


def check_layout(layout: str, name: str = "layout") -> str:
    """Return ``layout`` if it is ``"half"`` or ``"interleaved"``, else raise ``ValueError``."""
    if layout not in LAYOUTS:
        raise ValueError(f"{name} must be one of {LAYOUTS}, got {layout!r}")
    return layout


def check_even_positive(value: int, name: str) -> int:
    """Return ``value`` if it is a positive even int, else raise ``TypeError``/``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value <= 0 or value % 2:
        raise ValueError(f"{name} must be a positive even number, got {value}")
    return value


def check_positive_float(value: float, name: str) -> float:
    """Return ``float(value)`` if it is a finite number > 0, else raise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def check_positions(positions: torch.Tensor, name: str = "positions") -> torch.Tensor:
    """Return ``positions`` if it is an integer tensor with no negative entry."""
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(positions).__name__}")
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise TypeError(
            f"{name} must have an integer dtype (token indices), got {positions.dtype}; "
            "fractional positions are a scaling rule's job, not the positions'"
        )
    if positions.numel() and not torch.compiler.is_compiling() and int(positions.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got a minimum of {int(positions.min())}")
    return positions


def check_float_tensor(x: torch.Tensor, name: str) -> torch.Tensor:
    """Return ``x`` if it is a real floating-point tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    return x
