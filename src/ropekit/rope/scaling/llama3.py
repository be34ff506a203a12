"""Llama 3.1 scaling: wavelength bands, interpolated, smoothed or kept."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...validation import check_factor, check_length, check_number
from ..frequencies import base_inv_freq
from .registry import original_length, register_rule, required


@register_rule
@dataclass(frozen=True)
class Llama3:
    """Llama 3.1 frequency scaling: Meta 2024, "The Llama 3 Herd of Models", arXiv:2407.21783.

    The reference is ``apply_scaling`` in meta-llama/llama-models (Hugging Face ``rope_type="llama3"``).

    With ``L = original_max_position_embeddings`` and the wavelength ``w_i = 2 pi / theta_i``::

        w_i < L / high_freq_factor   ->  theta_i                        (high frequencies kept)
        w_i > L / low_freq_factor    ->  theta_i / factor               (low frequencies interpolated)
        otherwise                    ->  (1 - s) theta_i / factor + s theta_i,
                                         s = (L / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor)

    The blend is continuous at both band edges. Attention scale 1. Llama 4 uses the same rule.

    Args:
        factor: interpolation factor for the low band (Llama 3.1: 8, Llama 3.2: 32).
        low_freq_factor: ``L / low_freq_factor`` is the long-wavelength edge (Llama 3.1: 1).
        high_freq_factor: ``L / high_freq_factor`` is the short-wavelength edge (Llama 3.1: 4),
            ``>= low_freq_factor`` (equal: a hard cut with no blend, as in Llama 4 Scout).
        original_max_position_embeddings: ``L`` (Llama 3.1: 8192).
    """

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    dynamic: ClassVar[bool] = False
    rope_type: ClassVar[str] = "llama3"
    config_keys: ClassVar[frozenset[str]] = frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    )

    @classmethod
    def from_config(cls, params: Mapping[str, Any], max_positions: int | None) -> Llama3:
        """The rule of a ``"llama3"`` dict: the three factors are required, ``L`` defaults to the max length."""
        name = cls.rope_type
        return cls(
            required(name, params, "factor"),
            required(name, params, "low_freq_factor"),
            required(name, params, "high_freq_factor"),
            original_length(name, params, max_positions),
        )

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "factor", check_factor("Llama3", self.factor))
        low = check_number("Llama3", "low_freq_factor", self.low_freq_factor, low=0.0, strict=True)
        set_(self, "low_freq_factor", low)
        set_(self, "high_freq_factor", check_number("Llama3", "high_freq_factor", self.high_freq_factor, low=0.0))
        if self.high_freq_factor < self.low_freq_factor:
            raise ValueError(
                f"Llama3: high_freq_factor must be >= low_freq_factor, got high_freq_factor={self.high_freq_factor!r} "
                f"and low_freq_factor={self.low_freq_factor!r}"
            )
        length = check_length("Llama3", "original_max_position_embeddings", self.original_max_position_embeddings)
        set_(self, "original_max_position_embeddings", length)

    def compute(self, rotary_dim: int, base: float, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """Band-wise scaled frequencies; attention scale 1; ``seq_len`` is unused."""
        theta = base_inv_freq(rotary_dim, base)
        length = self.original_max_position_embeddings
        wavelen = 2 * math.pi / theta
        inv_freq = torch.where(wavelen > length / self.low_freq_factor, theta / self.factor, theta)
        width = self.high_freq_factor - self.low_freq_factor
        if width == 0:  # a hard cut (Llama 4 Scout); the reference would give 0/0 exactly at the edge
            return inv_freq, 1.0
        smooth = (length / wavelen - self.low_freq_factor) / width
        blended = (1.0 - smooth) * theta / self.factor + smooth * theta
        medium = (wavelen >= length / self.high_freq_factor) & (wavelen <= length / self.low_freq_factor)
        return torch.where(medium, blended, inv_freq), 1.0
