"""Context-extension scaling rules (filled in by the scaling-rules work).

A rule is a small frozen dataclass with

    compute(rotary_dim, base, seq_len) -> (inv_freq float64 (rotary_dim // 2,), attention_scale float)
    dynamic: bool   # True when the result depends on seq_len

so that :func:`ropekit.inv_frequencies` and :class:`ropekit.RotaryEmbedding` can use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ._checks import check_positive_float
from .frequencies import base_inv_freq


class ScalingRule(Protocol):
    """What :func:`ropekit.inv_frequencies` needs from a scaling rule."""

    dynamic: bool

    def compute(self, rotary_dim: int, base: float, seq_len: int | None) -> tuple[torch.Tensor, float]:
        """Return ``(inv_freq, attention_scale)`` for these parameters."""
        ...


@dataclass(frozen=True)
class Linear:
    """Position interpolation (Chen et al. 2023, arXiv:2306.15595): ``theta_i / factor``."""

    factor: float
    dynamic: bool = False

    def __post_init__(self) -> None:
        check_positive_float(self.factor, "factor")
        if self.factor < 1:
            raise ValueError(f"factor must be >= 1, got {self.factor}")

    def compute(self, rotary_dim: int, base: float, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """``inv_freq = base_inv_freq / factor``, attention scale 1."""
        return base_inv_freq(rotary_dim, base) / self.factor, 1.0


def rule_from_dict(params: dict[str, Any]) -> ScalingRule:
    """Build a rule from a Hugging Face ``rope_scaling``/``rope_parameters`` dict."""
    kind = params.get("rope_type", params.get("type"))
    if kind in (None, "default"):
        raise ValueError("rope_type 'default' has no scaling rule; pass scaling=None")
    if kind == "linear":
        return Linear(float(params["factor"]))
    raise ValueError(f"unknown rope_type {kind!r}")
