"""HunYuan's NTK-alpha: the NTK-aware base change with a fixed ``alpha``, read from a ``"dynamic"`` dict.

Tencent's HunYuan checkpoints (``hunyuan_v1_dense``, ``hunyuan_v1_moe``) publish::

    "rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 1.0}

Their modeling code (transformers' ``HunYuanDenseV1RotaryEmbedding.compute_ntk_alpha_rope_parameters``,
and Tencent's own ``HunYuanDynamicNTKAlphaRotaryEmbedding`` before it) reads only ``alpha``: the base
becomes ``b * alpha ** (d / (d - 2))`` once, whatever the sequence length. Despite the ``"dynamic"``
label nothing depends on the length (transformers renames the type ``ntk_alpha`` internally so that
it is not recomputed), so the rule is static.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...validation import check_factor
from ..frequencies import base_inv_freq
from .basic import ntk_base
from .registry import register_rule, required

#: Keys HunYuan's configs carry next to ``alpha`` that its modeling code ignores (YaRN's, left over).
IGNORED_KEYS = frozenset({"factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"})


@register_rule
@dataclass(frozen=True)
class NTKAlpha:
    """NTK-aware base change by a fixed ``alpha`` (HunYuan; Hugging Face's internal ``ntk_alpha``).

    ::

        b' = b * alpha ** (d / (d - 2))          inv_freq_i = b' ** (-2i / d)

    the formula of :class:`~ropekit.scaling.NTK` with ``factor = alpha``: the highest frequency is
    kept and the lowest divided by exactly ``alpha``. Attention scale 1, not length-dependent.

    A rope dict ``{"type": "dynamic", "alpha": a, ...}`` with a non-zero ``alpha`` is this rule (as in
    transformers' HunYuan code); ``{"rope_type": "ntk_alpha", "alpha": a}`` names it directly. The
    other keys HunYuan's configs carry (``factor``, ``beta_fast``, ``beta_slow``, ``mscale``,
    ``mscale_all_dim``) are accepted and ignored, because HunYuan's modeling code ignores them.

    Args:
        alpha: the NTK alpha, ``>= 1`` (HunYuan: 1000).
    """

    alpha: float
    dynamic: ClassVar[bool] = False
    rope_type: ClassVar[str] = "ntk_alpha"
    config_keys: ClassVar[frozenset[str]] = frozenset({"alpha"}) | IGNORED_KEYS

    def __post_init__(self) -> None:
        object.__setattr__(self, "alpha", check_factor("NTKAlpha", self.alpha, key="alpha"))

    @classmethod
    def from_config(cls, params: Mapping[str, Any], max_positions: int | None) -> NTKAlpha:
        """The rule of a ``{"type": "dynamic", "alpha": a}`` (or ``{"rope_type": "ntk_alpha", ...}``) dict."""
        return cls(required(cls.rope_type, params, "alpha"))

    def compute(self, rotary_dim: int, base: float, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """Plain RoPE frequencies (float64 ``(rotary_dim // 2,)``) with the base ``b * alpha ** (d / (d - 2))``."""
        return base_inv_freq(rotary_dim, ntk_base(base, rotary_dim, self.alpha)), 1.0
