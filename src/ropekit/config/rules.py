"""Map a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict onto a scaling rule.

The rules themselves are frozen dataclasses of :mod:`ropekit.rope.scaling` (public as
:mod:`ropekit.scaling`); dicts are parsed here, in the config layer, and nowhere below it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..rope.frequencies import inv_frequencies as _rule_inv_frequencies
from ..rope.scaling.basic import NTK, DynamicNTK, Linear, Proportional
from ..rope.scaling.llama3 import Llama3
from ..rope.scaling.longrope import LongRoPE
from ..rope.scaling.yarn import YaRN
from ..validation import check_length

#: ``rope_type`` values that mean plain RoPE frequencies. ``mrope`` has the plain ladder too; its axis map
#: (``mrope_section``, ``mrope_interleaved``) is read by ``RopeConfig.from_hf`` (:mod:`.multimodal`), not here.
PLAIN_ROPE_TYPES = ("default", "mrope")
#: Old names still found in published configs.
ALIASES = {"su": "longrope"}
#: Keys any rope dict may carry: identification, the base, partial rotary and multimodal metadata.
METADATA_KEYS = frozenset(
    {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved", "finetuned"}
)
#: The parameter keys each rule reads (beyond :data:`METADATA_KEYS`).
RULE_KEYS: dict[str, frozenset[str]] = {
    "linear": frozenset({"factor"}),
    "ntk": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "yarn": frozenset(
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
    ),
    "longrope": frozenset(
        {"short_factor", "long_factor", "original_max_position_embeddings", "factor", "attention_factor"}
    ),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "proportional": frozenset({"factor"}),
}


def rope_type_of(params: Mapping[str, Any]) -> str:
    """The rule name of a rope dict: ``rope_type`` (or the legacy ``type``), ``"default"`` if absent.

    Aliases are resolved (``"su"`` is LongRoPE) and, as Hugging Face's Phi-3 config does, a
    ``"yarn"`` dict carrying ``short_factor`` and ``long_factor`` is read as LongRoPE.
    """
    rope_type, legacy = params.get("rope_type"), params.get("type")
    if rope_type is not None and legacy is not None and rope_type != legacy:
        raise ValueError(f"rope parameters disagree: rope_type={rope_type!r} but type={legacy!r}")
    kind = rope_type if rope_type is not None else legacy
    if kind is None:
        return "default"
    if not isinstance(kind, str):
        raise ValueError(f"rope_type must be a string, got {kind!r}")
    kind = ALIASES.get(kind, kind)
    if kind == "yarn" and "short_factor" in params and "long_factor" in params:
        return "longrope"
    return kind


def _get(params: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = params.get(key)
    return default if value is None else value


def _required(kind: str, params: Mapping[str, Any], key: str) -> Any:
    value = params.get(key)
    if value is None:
        raise ValueError(f"{kind} scaling needs {key!r} in the rope parameters, got {dict(params)!r}")
    return value


def _original_length(kind: str, params: Mapping[str, Any], max_position_embeddings: int | None) -> int:
    """``original_max_position_embeddings``, defaulting to ``max_position_embeddings`` as Hugging Face does."""
    value = _get(params, "original_max_position_embeddings", max_position_embeddings)
    if value is None:
        raise ValueError(
            f"{kind} scaling needs 'original_max_position_embeddings' in the rope parameters (or "
            f"max_position_embeddings to default it to), got {dict(params)!r}"
        )
    return value


def _build(kind: str, params: Mapping[str, Any], max_positions: int | None) -> Any:
    if kind == "linear":
        return Linear(_required(kind, params, "factor"))
    if kind == "ntk":
        return NTK(_required(kind, params, "factor"))
    if kind == "dynamic":
        if max_positions is None:
            raise ValueError(
                "dynamic scaling needs max_position_embeddings (the length up to which the frequencies are "
                "unchanged), got None"
            )
        return DynamicNTK(_required(kind, params, "factor"), max_positions)
    if kind == "proportional":
        return Proportional(_get(params, "partial_rotary_factor", 1.0), _get(params, "factor", 1.0))
    if kind == "llama3":
        return Llama3(
            _required(kind, params, "factor"),
            _required(kind, params, "low_freq_factor"),
            _required(kind, params, "high_freq_factor"),
            _original_length(kind, params, max_positions),
        )
    original = _original_length(kind, params, max_positions)
    factor = params.get("factor")
    if factor is None and max_positions is not None:
        factor = max_positions / check_length(kind, "original_max_position_embeddings", original)
    if kind == "yarn":
        if factor is None:
            raise ValueError(
                f"yarn scaling needs 'factor' (or max_position_embeddings to derive it from), got {dict(params)!r}"
            )
        return YaRN(
            factor,
            original,
            beta_fast=_get(params, "beta_fast", 32.0),
            beta_slow=_get(params, "beta_slow", 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=_get(params, "truncate", True),
        )
    return LongRoPE(
        _required(kind, params, "short_factor"),
        _required(kind, params, "long_factor"),
        original,
        factor=factor,
        attention_factor=params.get("attention_factor"),
    )


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
        A rule from :mod:`ropekit.scaling`.

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
    if kind not in RULE_KEYS:
        key = "rope_type" if params.get("rope_type") is not None else "type"
        raise ValueError(f"unknown {key} {kind!r}; known: {sorted(RULE_KEYS) + sorted(ALIASES)}")
    unknown = sorted(set(params) - RULE_KEYS[kind] - METADATA_KEYS)
    if unknown:
        found = ", ".join(f"{key!r}={params[key]!r}" for key in unknown)
        raise ValueError(f"{kind} scaling does not take {found}; it reads {sorted(RULE_KEYS[kind])}")
    if max_position_embeddings is not None:
        max_position_embeddings = check_length(kind, "max_position_embeddings", max_position_embeddings)
    rule = _build(kind, params, max_position_embeddings)
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
    """``(inv_freq, attention_scale)`` for a rotary dimension and a scaling rule or rope dict.

    :func:`ropekit.rope.frequencies.inv_frequencies` (arguments, shapes and dtypes there), also
    taking ``scaling`` as a ``config.json`` rope dict (``{"rope_type": "yarn", "factor": 4.0,
    ...}``), which is mapped onto its rule by :func:`rule_from_dict`; a dict that describes plain
    RoPE gives the plain frequencies. This is ``ropekit.inv_frequencies``.
    """
    if isinstance(scaling, Mapping):
        if rope_type_of(scaling) in PLAIN_ROPE_TYPES and not set(scaling) & set().union(*RULE_KEYS.values()):
            scaling = None  # a rope dict that describes plain RoPE
        else:
            scaling = rule_from_dict(scaling)
    return _rule_inv_frequencies(rotary_dim, base, scaling, seq_len=seq_len)
