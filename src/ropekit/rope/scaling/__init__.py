"""Context-extension scaling rules.

A rule is a small frozen dataclass with

    compute(rotary_dim, base, seq_len) -> (inv_freq float64 (rotary_dim // 2,), attention_scale float)
    dynamic: bool   # True when the result depends on seq_len

so that :func:`ropekit.inv_frequencies` and :class:`ropekit.RotaryEmbedding` can use it. The
attention scale multiplies both the cos and the sin table (hence the logits by its square),
exactly where Hugging Face applies ``attention_scaling``.

- :class:`Linear` (``linear``): position interpolation, Chen et al. 2023, arXiv:2306.15595.
- :class:`NTK` (``ntk``, ropekit only): NTK-aware base change, bloc97 2023.
- :class:`DynamicNTK` (``dynamic``): NTK base grown with the sequence, emozilla 2023.
- :class:`NTKAlpha` (``ntk_alpha``): HunYuan's fixed NTK alpha (a ``dynamic`` dict with ``alpha``).
- :class:`YaRN` (``yarn``): Peng et al. 2023, arXiv:2309.00071.
- :class:`Llama3` (``llama3``): Meta 2024, arXiv:2407.21783.
- :class:`LongRoPE` (``longrope``, formerly ``su``): Ding et al. 2024, arXiv:2402.13753.
- :class:`Proportional` (``proportional``): p-RoPE, Barbero et al. 2024, arXiv:2410.06205.

Each rule class declares its ``rope_type`` (and ``aliases``), the ``config_keys`` it reads and a
``from_config`` classmethod, and enters the one registry with the :func:`register_rule` decorator
(:mod:`.registry`); a new rule is that one class and nothing else.

``ropekit.config.rules.rule_from_dict`` maps a ``config.json`` rope dict onto these (dicts are parsed
in :mod:`ropekit.config` only); see ``docs/scaling.md``. The public namespace is :mod:`ropekit.scaling`.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from .basic import NTK, DynamicNTK, Linear, Proportional, ntk_base
from .llama3 import Llama3
from .longrope import LongRoPE
from .ntk_alpha import NTKAlpha
from .registry import RULES, RuleKeys, known_rope_types, register_rule, rope_type_of_rule, rule_class
from .yarn import YaRN, yarn_mscale


class ScalingRule(Protocol):
    """What :func:`ropekit.inv_frequencies` needs from a scaling rule (and the registry from its class)."""

    dynamic: bool
    rope_type: ClassVar[str]
    config_keys: ClassVar[frozenset[str]]

    def compute(self, rotary_dim: int, base: float, seq_len: int | None) -> tuple[torch.Tensor, float]:
        """Return ``(inv_freq, attention_scale)`` for these parameters."""
        ...


__all__ = [
    "NTK",
    "DynamicNTK",
    "NTKAlpha",
    "Linear",
    "Llama3",
    "LongRoPE",
    "RULES",
    "Proportional",
    "RuleKeys",
    "ScalingRule",
    "YaRN",
    "known_rope_types",
    "ntk_base",
    "register_rule",
    "rope_type_of_rule",
    "rule_class",
    "yarn_mscale",
]
