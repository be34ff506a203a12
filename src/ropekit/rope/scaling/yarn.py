"""YaRN: per-frequency blend of interpolation and extrapolation, plus an attention factor."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...validation import check_base_above_one, check_factor, check_length, check_number, check_optional_number
from ..frequencies import base_inv_freq
from .registry import extension_factor, original_length, register_rule, value


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``sqrt(1/t)``: ``0.1 * mscale * ln(factor) + 1`` for ``factor > 1``, else ``1``."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def correction_dim(rotations: float, rotary_dim: int, base: float, length: int) -> float:
    """The (fractional) pair index whose wavelength fits ``rotations`` times into ``length``.

    ``d * ln(L / (2 pi r)) / (2 ln b)``: YaRN eq. 17 solved for the pair index.
    """
    return rotary_dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))


@register_rule
@dataclass(frozen=True)
class YaRN:
    """YaRN: Peng et al. 2023, "YaRN: Efficient Context Window Extension", arXiv:2309.00071.

    With ``r(i)`` the number of rotations pair ``i`` makes over the original length ``L``,
    pairs with ``r > beta_fast`` are kept (extrapolated), pairs with ``r < beta_slow`` are
    interpolated by ``factor`` (PI), and a linear ramp over the pair index blends between::

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)   # floor/ceil if truncate
        ramp_i = clamp((i - low) / (high - low), 0, 1)
        inv_freq_i = theta_i / factor * ramp_i + theta_i * (1 - ramp_i)

    The attention scale multiplies both cos and sin, so the logits by its square
    (the paper's ``1/t``)::

        attention_factor                                  if given, else
        mscale(factor, mscale) / mscale(factor, mscale_all_dim)   if mscale and mscale_all_dim, else
        mscale(factor) = 0.1 * ln(factor) + 1

    This is exactly Hugging Face's ``_compute_yarn_parameters``, including its quirks: the
    ramp is clamped to ``[0, d - 1]`` rather than ``[0, d/2 - 1]``, ``high`` is nudged by
    0.001 when ``low == high``, and ``mscale`` alone (without a truthy ``mscale_all_dim``)
    is ignored -- DeepSeek's own code would use ``mscale(factor, mscale)`` there.

    Args:
        factor: context-extension factor ``s >= 1``.
        original_max_position_embeddings: ``L``, the pre-training context length.
        beta_fast: rotations above which a pair is extrapolated (default 32).
        beta_slow: rotations below which a pair is interpolated (default 1), ``<= beta_fast``.
        mscale, mscale_all_dim: DeepSeek-V2 style attention factor parameters.
        attention_factor: explicit attention scale (``> 0``), overriding the above.
        truncate: round the ramp bounds outward to whole pairs (default ``True``; gpt-oss uses ``False``).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    dynamic: ClassVar[bool] = False
    rope_type: ClassVar[str] = "yarn"
    config_keys: ClassVar[frozenset[str]] = frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
            "truncate",
        }
    )

    @classmethod
    def from_config(cls, params: Mapping[str, Any], max_positions: int | None) -> YaRN:
        """The rule of a ``"yarn"`` dict; a missing ``factor`` is ``max / original`` as in Hugging Face."""
        original = original_length(cls.rope_type, params, max_positions)
        factor = extension_factor(cls.rope_type, params, original, max_positions)
        if factor is None:
            raise ValueError(
                f"yarn scaling needs 'factor' (or max_position_embeddings to derive it from), got {dict(params)!r}"
            )
        return cls(
            factor,
            original,
            beta_fast=value(params, "beta_fast", 32.0),
            beta_slow=value(params, "beta_slow", 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=value(params, "truncate", True),
        )

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "factor", check_factor("YaRN", self.factor))
        length = check_length("YaRN", "original_max_position_embeddings", self.original_max_position_embeddings)
        set_(self, "original_max_position_embeddings", length)
        set_(self, "beta_fast", check_number("YaRN", "beta_fast", self.beta_fast, low=0.0, strict=True))
        set_(self, "beta_slow", check_number("YaRN", "beta_slow", self.beta_slow, low=0.0, strict=True))
        if self.beta_fast < self.beta_slow:
            raise ValueError(
                f"YaRN: beta_fast must be >= beta_slow, got beta_fast={self.beta_fast!r} and "
                f"beta_slow={self.beta_slow!r}"
            )
        set_(self, "mscale", check_optional_number("YaRN", "mscale", self.mscale))
        set_(self, "mscale_all_dim", check_optional_number("YaRN", "mscale_all_dim", self.mscale_all_dim))
        attention = check_optional_number("YaRN", "attention_factor", self.attention_factor, low=0.0, strict=True)
        set_(self, "attention_factor", attention)
        if not isinstance(self.truncate, bool):
            raise ValueError(f"YaRN: truncate must be a bool, got {self.truncate!r}")
        try:
            scale = self.attention_scale()
        except ZeroDivisionError:
            scale = math.inf
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(
                f"YaRN: mscale={self.mscale!r} and mscale_all_dim={self.mscale_all_dim!r} give the attention "
                f"factor {scale!r} at factor={self.factor!r}; it must be a finite number > 0"
            )

    def attention_scale(self) -> float:
        """The factor folded into cos and sin (see the class docstring)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def ramp_bounds(self, rotary_dim: int, base: float) -> tuple[float, float]:
        """``(low, high)`` pair indices of the blend ramp, as Hugging Face computes them."""
        length = self.original_max_position_embeddings
        low = correction_dim(self.beta_fast, rotary_dim, base, length)
        high = correction_dim(self.beta_slow, rotary_dim, base, length)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, rotary_dim - 1)

    def compute(self, rotary_dim: int, base: float, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """Blended frequencies and the attention factor; ``seq_len`` is unused."""
        check_base_above_one("YaRN", base)
        low, high = self.ramp_bounds(rotary_dim, base)
        if low == high:
            high += 0.001  # the reference's guard against a zero-width ramp
        index = torch.arange(rotary_dim // 2, dtype=torch.float64)
        ramp = ((index - low) / (high - low)).clamp(0.0, 1.0)  # 1 = interpolate, 0 = extrapolate
        theta = base_inv_freq(rotary_dim, base)
        inv_freq = theta / self.factor * ramp + theta * (1.0 - ramp)
        return inv_freq, self.attention_scale()
