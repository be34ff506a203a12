"""Map a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict onto a scaling rule.

The rules themselves are frozen dataclasses of :mod:`ropekit.rope.scaling` (public as
:mod:`ropekit.scaling`), each registered under its ``rope_type``. A dict is checked here, in the
config layer (its type, its ``rope_type``, keys that no rule reads, the model's length); the rule
class's ``from_config`` then picks the values of the keys it declared.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..rope.frequencies import inv_freq_and_scale
from ..rope.scaling.longrope import LongRoPE
from ..rope.scaling.registry import RuleKeys, canonical_rope_type, known_rope_types, rule_class
from ..validation import check_length

#: ``rope_type`` values that mean plain RoPE frequencies. ``mrope`` has the plain ladder too; its axis map
#: (``mrope_section``, ``mrope_interleaved``) is read by ``RopeConfig.from_hf`` (:mod:`.multimodal`), not here.
PLAIN_ROPE_TYPES = ("default", "mrope")
#: Keys any rope dict may carry: identification, the base, partial rotary and multimodal metadata.
METADATA_KEYS = frozenset(
    {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved", "finetuned"}
)
#: The parameter keys each registered rule reads (beyond :data:`METADATA_KEYS`): a live view of the
#: registry of :mod:`ropekit.rope.scaling`, where each rule class declares its ``config_keys``.
RULE_KEYS = RuleKeys()


def rope_type_of(params: Mapping[str, Any]) -> str:
    """The rule name of a rope dict: ``rope_type`` (or the legacy ``type``), ``"default"`` if absent.

    Aliases are resolved (``"su"`` is LongRoPE); as Hugging Face's Phi-3 config does, a ``"yarn"``
    dict carrying ``short_factor`` and ``long_factor`` is read as LongRoPE; and as transformers'
    HunYuan code does, a ``"dynamic"`` dict with a non-zero ``alpha`` is HunYuan's fixed NTK alpha
    (``ntk_alpha``).
    """
    rope_type, legacy = params.get("rope_type"), params.get("type")
    if rope_type is not None and legacy is not None and rope_type != legacy:
        raise ValueError(f"rope parameters disagree: rope_type={rope_type!r} but type={legacy!r}")
    kind = rope_type if rope_type is not None else legacy
    if kind is None:
        return "default"
    if not isinstance(kind, str):
        raise ValueError(f"rope_type must be a string, got {kind!r}")
    kind = canonical_rope_type(kind)
    if kind == "yarn" and "short_factor" in params and "long_factor" in params:
        return "longrope"
    if kind == "dynamic" and params.get("alpha"):
        return "ntk_alpha"
    return kind


def rule_from_dict(
    params: Mapping[str, Any],
    *,
    max_position_embeddings: int | None = None,
    rotary_dim: int | None = None,
) -> Any:
    """Build a scaling rule from a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict.

    Args:
        params: one flat dict, e.g. ``{"rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 32768}``; ``type`` is read like ``rope_type``,
            ``null`` values like absent keys.
        max_position_embeddings: the model's ``max_position_embeddings``: the default of
            ``original_max_position_embeddings`` (YaRN, Llama 3, LongRoPE), the source of a
            missing ``factor`` (``max / original``; YaRN, LongRoPE) and dynamic NTK's length ``L``.
        rotary_dim: if given, LongRoPE's factor lists are checked against ``rotary_dim // 2``.

    Returns:
        An instance of the rule class registered under the dict's ``rope_type`` (see
        :func:`ropekit.scaling.register_rule`): its ``from_config`` reads the keys it declared.

    Raises:
        ValueError: the rope type is plain RoPE (``"default"``, ``"mrope"``: pass ``scaling=None``)
            or unknown; a key does not belong to the rule; a required key is missing; a value
            is out of range. The message names the key and the value.
        TypeError: ``params`` is not a mapping.
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"rope parameters must be a dict, got {type(params).__name__} {params!r}")
    kind = rope_type_of(params)
    if kind in PLAIN_ROPE_TYPES:
        raise ValueError(f"rope_type {kind!r} has no scaling rule (plain RoPE frequencies); pass scaling=None")
    try:
        cls = rule_class(kind)
    except ValueError:
        key = "rope_type" if params.get("rope_type") is not None else "type"
        raise ValueError(f"unknown {key} {kind!r}; known: {known_rope_types()}") from None
    unknown = sorted(set(params) - cls.config_keys - METADATA_KEYS)
    if unknown:
        found = ", ".join(f"{key!r}={params[key]!r}" for key in unknown)
        raise ValueError(f"{kind} scaling does not take {found}; it reads {sorted(cls.config_keys)}")
    if max_position_embeddings is not None:
        max_position_embeddings = check_length(kind, "max_position_embeddings", max_position_embeddings)
    rule = cls.from_config(params, max_position_embeddings)
    if rotary_dim is not None and isinstance(rule, LongRoPE) and len(rule.short_factor) != rotary_dim // 2:
        raise ValueError(
            f"longrope: short_factor and long_factor have {len(rule.short_factor)} entries, rotary_dim={rotary_dim} "
            f"needs {rotary_dim // 2}"
        )
    return rule


def inv_frequencies(
    rotary_dim: int,
    base: float = 10000.0,
    scaling: Any = None,
    *,
    seq_len: int | None = None,
) -> tuple[Any, float]:
    """``ropekit.inv_frequencies``: inverse frequencies and attention scale of a rotary dimension and scaling.

    Args:
        rotary_dim: number of rotated channels (positive, even).
        base: RoPE base ``b`` (``rope_theta`` in Hugging Face configs).
        scaling: ``None`` for plain RoPE, a rule from :mod:`ropekit.scaling`, or a ``config.json``
            rope dict (``{"rope_type": "yarn", "factor": 4.0, ...}``), mapped onto its rule by
            :func:`rule_from_dict`; a dict that describes plain RoPE gives the plain frequencies.
        seq_len: current sequence length; only rules that depend on it (dynamic NTK, LongRoPE) read it.

    Returns:
        ``(inv_freq, attention_scale)``: float64 tensor of shape ``(rotary_dim // 2,)`` and a Python
        float that multiplies the cos/sin tables (1.0 for plain RoPE). The rule-object half is
        :func:`ropekit.rope.frequencies.inv_freq_and_scale`.

    Example:
        >>> inv_freq, scale = inv_frequencies(4, 10000.0)
        >>> inv_freq.tolist(), scale
        ([1.0, 0.01], 1.0)
    """
    if isinstance(scaling, Mapping):
        if rope_type_of(scaling) in PLAIN_ROPE_TYPES and not set(scaling) & set().union(*RULE_KEYS.values()):
            scaling = None  # a rope dict that describes plain RoPE
        else:
            scaling = rule_from_dict(scaling)
    return inv_freq_and_scale(rotary_dim, base, scaling, seq_len=seq_len)
