"""Uniform rules: position interpolation, NTK-aware and dynamic NTK base change, p-RoPE.

Each rule maps ``(rotary_dim, base, seq_len)`` to ``(inv_freq, attention_scale)``; ``inv_freq``
is float64 of shape ``(rotary_dim // 2,)`` and ``attention_scale`` is 1 for all of these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...validation import check_factor, check_length, check_number, check_optional_length
from ..frequencies import base_inv_freq
from .registry import register_rule, required, value


def _set(rule: object, name: str, value: object) -> None:
    object.__setattr__(rule, name, value)


def ntk_base(base: float, rotary_dim: int, alpha: float) -> float:
    """The NTK-aware base ``base * alpha ** (d / (d - 2))`` (``base`` itself when ``d == 2``).

    The exponent makes the lowest frequency ``theta_{d/2-1}`` exactly ``alpha`` times slower
    while the highest (``theta_0 = 1``) is untouched. With ``d == 2`` the only frequency is
    ``theta_0 = 1`` whatever the base, so the base is returned unchanged (the formula would
    divide by zero).
    """
    if rotary_dim == 2:
        return base
    return base * alpha ** (rotary_dim / (rotary_dim - 2))


@register_rule
@dataclass(frozen=True)
class Linear:
    """Position interpolation (PI): Chen et al. 2023, arXiv:2306.15595.

    ``inv_freq_i = theta_i / factor``: position ``m`` is rotated like position ``m / factor``
    of the original model, so ``factor * L`` positions fit in the trained range ``L``.
    Hugging Face ``rope_type="linear"`` (kaiokendev's SuperHOT trick, the same formula).

    Args:
        factor: context-extension factor ``s >= 1``.
    """

    factor: float
    dynamic: ClassVar[bool] = False
    rope_type: ClassVar[str] = "linear"
    config_keys: ClassVar[frozenset[str]] = frozenset({"factor"})

    def __post_init__(self) -> None:
        _set(self, "factor", check_factor("Linear", self.factor))

    @classmethod
    def from_config(cls, params: Mapping[str, Any], max_positions: int | None) -> Linear:
        """The rule of a ``{"rope_type": "linear", "factor": s}`` dict."""
        return cls(required(cls.rope_type, params, "factor"))

    def compute(self, rotary_dim: int, base: float, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """``inv_freq = base_inv_freq / factor``, attention scale 1."""
        return base_inv_freq(rotary_dim, base) / self.factor, 1.0


@register_rule
@dataclass(frozen=True)
class NTK:
    """NTK-aware scaled RoPE: bloc97 2023 (r/LocalLLaMA, "NTK-Aware Scaled RoPE").

    Changes the base instead of the positions: ``b' = b * factor ** (d / (d - 2))``, so
    high frequencies (local order) are kept and the lowest one is interpolated by ``factor``.
    Not a Hugging Face ``rope_type``; ``rule_from_dict`` accepts ``{"rope_type": "ntk"}``.

    Args:
        factor: the NTK "alpha" ``>= 1``.
    """

    factor: float
    dynamic: ClassVar[bool] = False
    rope_type: ClassVar[str] = "ntk"
    config_keys: ClassVar[frozenset[str]] = frozenset({"factor"})

    def __post_init__(self) -> None:
        _set(self, "factor", check_factor("NTK", self.factor))

    @classmethod
    def from_config(cls, params: Mapping[str, Any], max_positions: int | None) -> NTK:
        """The rule of a ``{"rope_type": "ntk", "factor": alpha}`` dict."""
        return cls(required(cls.rope_type, params, "factor"))

    def compute(self, rotary_dim: int, base: float, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """Plain RoPE frequencies with the base ``b * factor ** (d / (d - 2))``."""
        return base_inv_freq(rotary_dim, ntk_base(base, rotary_dim, self.factor)), 1.0


@register_rule
@dataclass(frozen=True)
class DynamicNTK:
    """Dynamic NTK scaling: emozilla 2023 (r/LocalLLaMA, "Dynamically Scaled RoPE").

    With ``L = original_max_position_embeddings`` and ``s = max(seq_len, L)``::

        b' = b * (factor * s / L - (factor - 1)) ** (d / (d - 2))

    so nothing changes up to ``L`` and the base grows with the sequence beyond it
    (Hugging Face ``rope_type="dynamic"``, where ``L`` is the config's
    ``max_position_embeddings``).

    **KV cache.** The frequencies depend on the current length, so Hugging Face (and
    :class:`ropekit.RotaryEmbedding`, which recomputes its whole table when the length
    changes) rotate keys cached at an earlier step with *older* frequencies than the
    queries that later read them: ``<R_m q, R_n k>`` is no longer a function of ``n - m``
    alone. For decoding with a cache, pass ``fixed_seq_len`` (e.g. the longest length you
    will generate): the base is then computed once for that length, the rule is static
    (``dynamic`` is ``False``) and cached keys stay consistent with every later query.

    Args:
        factor: scaling factor ``>= 1``.
        original_max_position_embeddings: ``L``, the length up to which frequencies are unchanged.
        fixed_seq_len: ``None`` (recompute per length, as Hugging Face does) or a length to
            freeze the base at.
    """

    factor: float
    original_max_position_embeddings: int
    fixed_seq_len: int | None = None
    rope_type: ClassVar[str] = "dynamic"
    config_keys: ClassVar[frozenset[str]] = frozenset({"factor"})

    @classmethod
    def from_config(cls, params: Mapping[str, Any], max_positions: int | None) -> DynamicNTK:
        """The rule of a ``{"rope_type": "dynamic", "factor": s}`` dict; ``L`` is ``max_position_embeddings``."""
        if max_positions is None:
            raise ValueError(
                "dynamic scaling needs max_position_embeddings (the length up to which the frequencies are "
                "unchanged), got None"
            )
        return cls(required(cls.rope_type, params, "factor"), max_positions)

    def __post_init__(self) -> None:
        _set(self, "factor", check_factor("DynamicNTK", self.factor))
        length = check_length("DynamicNTK", "original_max_position_embeddings", self.original_max_position_embeddings)
        _set(self, "original_max_position_embeddings", length)
        _set(self, "fixed_seq_len", check_optional_length("DynamicNTK", "fixed_seq_len", self.fixed_seq_len))

    @property
    def dynamic(self) -> bool:
        """``True`` unless ``fixed_seq_len`` freezes the frequencies."""
        return self.fixed_seq_len is None

    def compute(self, rotary_dim: int, base: float, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """Frequencies for ``seq_len`` (or ``fixed_seq_len``); attention scale 1."""
        length = self.original_max_position_embeddings
        if self.fixed_seq_len is not None:
            seq_len = self.fixed_seq_len
        seq = length if seq_len is None else max(int(seq_len), length)
        alpha = self.factor * seq / length - (self.factor - 1)
        return base_inv_freq(rotary_dim, ntk_base(base, rotary_dim, alpha)), 1.0


@register_rule
@dataclass(frozen=True)
class Proportional:
    """p-RoPE: Barbero et al. 2024, "Round and Round We Go!", arXiv:2410.06205 (Gemma 4).

    Keeps the highest-frequency ``partial_rotary_factor`` share of the pairs and zeroes the
    rest (a zero frequency leaves its pair unrotated), all divided by ``factor``::

        inv_freq_i = theta_i / factor  for i < int(p * d // 2),   0 otherwise

    Unlike partial rotary, the kept frequencies stay ``base ** (-2i / d)`` of the *full*
    ``d`` and the table keeps ``d // 2`` entries (Hugging Face ``rope_type="proportional"``).

    Args:
        partial_rotary_factor: ``p`` in ``[0, 1]``.
        factor: linear scaling factor ``>= 1`` (default 1).
    """

    partial_rotary_factor: float = 1.0
    factor: float = 1.0
    dynamic: ClassVar[bool] = False
    rope_type: ClassVar[str] = "proportional"
    config_keys: ClassVar[frozenset[str]] = frozenset({"factor"})

    @classmethod
    def from_config(cls, params: Mapping[str, Any], max_positions: int | None) -> Proportional:
        """The rule of a ``{"rope_type": "proportional"}`` dict (with the metadata key ``partial_rotary_factor``)."""
        return cls(value(params, "partial_rotary_factor", 1.0), value(params, "factor", 1.0))

    def __post_init__(self) -> None:
        share = check_number("Proportional", "partial_rotary_factor", self.partial_rotary_factor, low=0.0)
        if share > 1.0:
            raise ValueError(f"Proportional: partial_rotary_factor must be <= 1, got {self.partial_rotary_factor!r}")
        _set(self, "partial_rotary_factor", share)
        _set(self, "factor", check_factor("Proportional", self.factor))

    def compute(self, rotary_dim: int, base: float, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """``theta_i / factor`` for the kept pairs, zero for the others; attention scale 1."""
        kept = int(self.partial_rotary_factor * rotary_dim // 2)  # Hugging Face's exact rounding
        inv_freq = base_inv_freq(rotary_dim, base)
        inv_freq[kept:] = 0.0
        return inv_freq / self.factor, 1.0
