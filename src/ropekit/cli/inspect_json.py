"""What ``ropekit inspect`` says about a config, as one JSON-ready dict (:func:`describe`).

``ropekit inspect --json`` prints it and the lab's report shows it; the numbers come from
:mod:`ropekit.rope.analysis` (wavelengths, base bound, similarity margin) and, for multi-axis
configs, :func:`ropekit.cli.inspect_axes.axis_summary`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..config import LayerSchedule, RopeConfig
from ..rope.analysis import (
    base_lower_bound,
    bound_positions,
    first_negative_position,
    pair_regimes,
    rotations,
    wavelengths,
)
from ..rope.frequencies import base_inv_freq
from ..rope.scaling import ScalingRule, rope_type_of_rule
from ..validation import check_context
from .inspect_axes import axis_summary

__all__ = ["DEFAULT_CONTEXT", "default_context", "describe", "layer_schedule", "rule_parameters"]

#: Context assumed for a config that does not say (no ``max_position_embeddings``).
DEFAULT_CONTEXT = 4096


def rule_parameters(rule: ScalingRule | None) -> dict[str, Any]:
    """The rule's fields as a JSON-ready dict (tuples become lists; empty for plain RoPE)."""
    if rule is None:
        return {}
    return {key: list(value) if isinstance(value, tuple) else value for key, value in dataclasses.asdict(rule).items()}


def layer_schedule(schedule: LayerSchedule | None) -> dict[str, Any] | None:
    """A :class:`ropekit.LayerSchedule` as a JSON-ready dict (``None`` when every layer rotates).

    Keys: ``layers``, ``rope_layers`` and ``nope_layers`` (indices), ``attention_chunk_size``
    (Llama 4's chunked attention on the RoPE layers, or ``None``) and ``temperature_tuning``
    (``{"floor_scale", "attn_scale"}`` on the NoPE layers, or ``None``).
    """
    if schedule is None:
        return None
    tuning = schedule.temperature_tuning
    return {
        "layers": schedule.num_layers,
        "rope_layers": list(schedule.rope_layers),
        "nope_layers": list(schedule.nope_layers),
        "attention_chunk_size": schedule.attention_chunk_size,
        "temperature_tuning": None if tuning is None else {"floor_scale": tuning[0], "attn_scale": tuning[1]},
    }


def _finite(values: torch.Tensor) -> list[float | None]:
    """A float64 tensor as a JSON-ready list (``inf`` becomes ``None``)."""
    return [value if math.isfinite(value) else None for value in values.tolist()]


def default_context(config: RopeConfig) -> tuple[int, str]:
    """The context window a config is meant for, and where that number comes from.

    ``max(max_positions, factor * original_max_position_embeddings)`` for a rule that has both
    (Qwen2.5's YaRN recipe keeps ``max_position_embeddings`` at the original 32768), else
    ``max_positions``, else :data:`DEFAULT_CONTEXT` (``"assumed"``).
    """
    rule = config.scaling
    factor = getattr(rule, "factor", None)
    original = getattr(rule, "original_max_position_embeddings", None)
    extended = round(factor * original) if factor and original else 0
    if extended > (config.max_positions or 0):
        return extended, "factor x original_max_position_embeddings"
    if config.max_positions:
        return config.max_positions, "max_position_embeddings"
    return DEFAULT_CONTEXT, "assumed"


def describe(config: RopeConfig, *, context: int | None = None, seq_len: int | None = None,
             bound: bool = True) -> dict[str, Any]:
    """Everything ``ropekit inspect`` prints about a :class:`ropekit.RopeConfig`, JSON-ready.

    Args:
        config: a :class:`ropekit.RopeConfig`.
        context: the context window in tokens; default :func:`default_context` (its origin is
            reported as ``context_source``).
        seq_len: sequence length at which length-dependent rules (dynamic NTK, LongRoPE) are
            evaluated; default ``context``.
        bound: compute Men et al.'s base lower bound (a numeric search; seconds for 128K tokens).

    Returns:
        dict with the config (``head_dim``, ``rotary_dim``, ``base``, ``layout``, ``rope_type``,
        ``rope_parameters``, ``attention_scale`` -- the factor on cos and sin, ``logit_scale`` --
        its square), ``max_positions``, ``context``, per-pair lists (``theta`` unscaled,
        ``inv_freq``, ``wavelength``, ``rotations``, ``interpolation`` = theta / inv_freq,
        ``regime``) and the summary (``pairs_without_full_rotation``, ``pretraining``,
        ``base_lower_bound``, ``similarity_negative_at``); ``layer_schedule`` (:func:`layer_schedule`:
        which layers rotate, ``None`` when all do); ``axes`` (``None`` for 1-D RoPE) from
        :func:`ropekit.cli.inspect_axes.axis_summary` for a multi-axis config, whose base bound is
        only computed when its frequencies are the one ladder ``base^(-2i/d)`` (M-RoPE, not axial).

    Raises:
        TypeError: ``config`` is not a :class:`ropekit.RopeConfig`.
        ValueError: ``context`` or ``seq_len`` is not a positive int within the positions ropekit accepts.
    """
    if not isinstance(config, RopeConfig):
        raise TypeError(f"config must be a ropekit.RopeConfig, got {type(config).__name__}")
    source = "given"
    if context is None:
        context, source = default_context(config)
    check_context(context, "context")
    seq_len = context if seq_len is None else check_context(seq_len, "seq_len")
    inv_freq, scale = config.inv_frequencies(seq_len)
    theta = base_inv_freq(config.rotary_dim, config.base)
    axes = config.axes
    if axes is not None and config.scaling is None:
        theta = axes.inv_freq  # axial plans: each axis its own ladder, not base^(-2i/d) over the head
    one_ladder = axes is None or torch.allclose(theta, base_inv_freq(config.rotary_dim, config.base), rtol=1e-12)
    wavelength = wavelengths(inv_freq)
    original = getattr(config.scaling, "original_max_position_embeddings", None)
    interpolation = torch.where(inv_freq > 0, theta / inv_freq, torch.full_like(theta, math.inf))
    result = {
        "head_dim": config.head_dim,
        "rotary_dim": config.rotary_dim,
        "base": config.base,
        "layout": config.layout,
        "rope_type": rope_type_of_rule(config.scaling),
        "rope_parameters": rule_parameters(config.scaling),
        "attention_scale": scale,
        "logit_scale": scale * scale,
        "max_positions": config.max_positions,
        "context": context,
        "context_source": source,
        "seq_len": seq_len,
        "pairs": config.rotary_dim // 2,
        "theta": theta.tolist(),
        "inv_freq": inv_freq.tolist(),
        "wavelength": _finite(wavelength),
        "rotations": rotations(inv_freq, context).tolist(),
        "interpolation": _finite(interpolation),
        "regime": pair_regimes(config.scaling, config.rotary_dim, config.base),
        "pairs_without_full_rotation": int((wavelength > context).sum()),
        "pretraining": None,
    }
    if original is not None:
        result["pretraining"] = {
            "context": original,
            "pairs_without_full_rotation": int((wavelengths(theta) > original).sum()),
        }
    positions, _ = bound_positions(context)
    result["similarity_negative_at"] = first_negative_position(inv_freq, positions)
    bound = bound and one_ladder  # Men et al.'s bound is about one ladder base^(-2i/d)
    result["base_lower_bound"] = base_lower_bound(config.rotary_dim, context) if bound else None
    result["layer_schedule"] = layer_schedule(config.layer_schedule)
    result["axes"] = None
    if axes is not None:
        result["axes"] = axis_summary(config.axis_plan(seq_len), context)
    if bound and original is not None and original != context:
        result["pretraining"]["base_lower_bound"] = base_lower_bound(config.rotary_dim, original)
    return result
