"""LongRoPE: searched per-frequency rescale factors, one set for short and one for long sequences."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...validation import check_factor, check_factor_list, check_length, check_optional_length, check_optional_number
from ..frequencies import base_inv_freq
from .registry import extension_factor, original_length, register_rule, required


@register_rule
@dataclass(frozen=True)
class LongRoPE:
    """LongRoPE: Ding et al. 2024, arXiv:2402.13753 (Phi-3 / Phi-3.5 / Phi-4-mini "longrope", ex "su").

    With ``L = original_max_position_embeddings`` and the current length ``seq_len``::

        lambda = long_factor   if seq_len > L   else short_factor      (one list per pair)
        inv_freq_i = theta_i / lambda_i

    and, on both sides of the switch (the reference applies it to short sequences too)::

        attention_scale = attention_factor            if given, else
                          1                           if factor <= 1, else
                          sqrt(1 + ln(factor) / ln(L))

    where ``factor`` is the context-extension ratio (Hugging Face: ``max_position_embeddings / L``
    when the config has no ``factor``).

    **KV cache.** The switch happens when the sequence crosses ``L``: keys cached with the
    short factors then meet queries rotated with the long ones (as in Hugging Face and vLLM).
    ``fixed_seq_len`` freezes the choice (e.g. ``fixed_seq_len=L + 1`` always uses the long
    factors) and makes the rule static.

    Args:
        short_factor, long_factor: ``rotary_dim // 2`` rescale factors each (``> 0``).
        original_max_position_embeddings: ``L``.
        factor: extension ratio ``>= 1`` for the attention scale (needed unless ``attention_factor`` is given).
        attention_factor: explicit attention scale (``> 0``).
        fixed_seq_len: ``None`` (switch on the current length) or a length to freeze the choice at.
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    factor: float | None = None
    attention_factor: float | None = None
    fixed_seq_len: int | None = None
    rope_type: ClassVar[str] = "longrope"
    aliases: ClassVar[tuple[str, ...]] = ("su",)
    config_keys: ClassVar[frozenset[str]] = frozenset(
        {"short_factor", "long_factor", "original_max_position_embeddings", "factor", "attention_factor"}
    )

    @classmethod
    def from_config(cls, params: Mapping[str, Any], max_positions: int | None) -> LongRoPE:
        """The rule of a ``"longrope"`` dict; a missing ``factor`` is ``max / original`` as in Hugging Face."""
        name = cls.rope_type
        original = original_length(name, params, max_positions)
        return cls(
            required(name, params, "short_factor"),
            required(name, params, "long_factor"),
            original,
            factor=extension_factor(name, params, original, max_positions),
            attention_factor=params.get("attention_factor"),
        )

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "short_factor", check_factor_list("LongRoPE", "short_factor", self.short_factor))
        set_(self, "long_factor", check_factor_list("LongRoPE", "long_factor", self.long_factor))
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError(
                f"LongRoPE: short_factor and long_factor must have the same length, got {len(self.short_factor)} "
                f"and {len(self.long_factor)}"
            )
        length = check_length("LongRoPE", "original_max_position_embeddings", self.original_max_position_embeddings)
        set_(self, "original_max_position_embeddings", length)
        set_(self, "factor", None if self.factor is None else check_factor("LongRoPE", self.factor))
        attention = check_optional_number("LongRoPE", "attention_factor", self.attention_factor, low=0.0, strict=True)
        set_(self, "attention_factor", attention)
        if self.factor is None and self.attention_factor is None:
            raise ValueError(
                "LongRoPE: factor is None and attention_factor is None; give one of them (Hugging Face derives "
                "factor = max_position_embeddings / original_max_position_embeddings)"
            )
        set_(self, "fixed_seq_len", check_optional_length("LongRoPE", "fixed_seq_len", self.fixed_seq_len))

    @property
    def dynamic(self) -> bool:
        """``True`` unless ``fixed_seq_len`` freezes the short/long choice."""
        return self.fixed_seq_len is None

    def attention_scale(self) -> float:
        """The factor folded into cos and sin (see the class docstring)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))

    def uses_long(self, seq_len: int | None) -> bool:
        """Whether ``seq_len`` (or ``fixed_seq_len``) selects ``long_factor``."""
        if self.fixed_seq_len is not None:
            seq_len = self.fixed_seq_len
        return seq_len is not None and seq_len > self.original_max_position_embeddings

    def compute(self, rotary_dim: int, base: float, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """``theta_i / lambda_i`` with the short or long list, and the attention scale."""
        if len(self.short_factor) != rotary_dim // 2:
            raise ValueError(
                f"LongRoPE: short_factor and long_factor have {len(self.short_factor)} entries, rotary_dim="
                f"{rotary_dim} needs {rotary_dim // 2}"
            )
        factors = self.long_factor if self.uses_long(seq_len) else self.short_factor
        inv_freq = base_inv_freq(rotary_dim, base) / torch.tensor(factors, dtype=torch.float64)
        return inv_freq, self.attention_scale()
