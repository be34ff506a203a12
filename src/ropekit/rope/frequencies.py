"""Rotary frequencies and cos/sin tables: the bottom layer of ropekit.

RoPE rotates pair ``i`` of a query/key at position ``m`` by the angle ``m * theta_i`` with

    theta_i = base ** (-2 i / d),   i = 0 .. d/2 - 1          (RoFormer eq. 15)

where ``d`` is the rotary dimension. Everything here works in float64: angles
``m * theta_i`` for positions up to 1e7 and beyond keep ~1e-9 absolute accuracy,
where a float32 product (the recipe of most ports) is off by ``m * 6e-8`` radians.
Tables are handed out in float32, the precision every ropekit kernel computes in.
"""

from __future__ import annotations

from typing import Any

import torch

from .._deprecation import module_getattr, warn_once
from ..validation import check_even_positive, check_positions, check_positive_float

NO_FLOAT64 = ("mps",)  # device types without float64 tensors


def base_inv_freq(rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    """The unscaled RoPE frequencies ``theta_i = base ** (-2i / rotary_dim)``.

    Args:
        rotary_dim: number of rotated channels ``d`` (positive, even).
        base: the base ``b`` of the geometric progression (RoFormer: 10000).

    Returns:
        float64 tensor of shape ``(rotary_dim // 2,)`` on the CPU, decreasing from 1.
    """
    check_even_positive(rotary_dim, "rotary_dim")
    base = check_positive_float(base, "base")
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    return torch.pow(torch.tensor(base, dtype=torch.float64), -exponent)


def inv_freq_and_scale(
    rotary_dim: int,
    base: float = 10000.0,
    rule: Any = None,
    *,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scale of a scaling rule object (the maths layer's half of it).

    ``ropekit.inv_frequencies`` (:func:`ropekit.config.rules.inv_frequencies`) is the public
    function: it also takes a ``config.json`` rope dict, maps it onto its rule and calls this.

    Args:
        rotary_dim: number of rotated channels (positive, even).
        base: RoPE base ``b`` (``rope_theta`` in Hugging Face configs).
        rule: ``None`` for plain RoPE, or a rule from :mod:`ropekit.scaling` (any object with
            ``compute(rotary_dim, base, seq_len) -> (inv_freq, scale)``).
        seq_len: current sequence length; only rules that depend on it (dynamic
            NTK, LongRoPE) read it.

    Returns:
        ``(inv_freq, attention_scale)``: float64 tensor of shape ``(rotary_dim // 2,)``
        and a Python float that multiplies the cos/sin tables (1.0 for plain RoPE).

    Example:
        >>> inv_freq, scale = inv_freq_and_scale(4, 10000.0)
        >>> inv_freq.tolist(), scale
        ([1.0, 0.01], 1.0)
    """
    check_even_positive(rotary_dim, "rotary_dim")
    base = check_positive_float(base, "base")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0):
        raise ValueError(f"seq_len must be a non-negative int or None, got {seq_len!r}")
    if rule is None:
        return base_inv_freq(rotary_dim, base), 1.0
    compute = getattr(rule, "compute", None)
    if compute is None:
        raise TypeError(
            "scaling must be None, a ropekit.scaling rule or a config.json rope dict, "
            f"got {type(rule).__name__}"
        )
    inv_freq, scale = compute(rotary_dim, base, seq_len)
    return inv_freq.to(torch.float64), float(scale)


def rotation_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Angles ``positions[..., None] * inv_freq`` in float64.

    Args:
        positions: integer tensor of any shape ``P`` (token indices, >= 0).
        inv_freq: float tensor of shape ``(rotary_dim // 2,)``.

    Returns:
        float64 tensor of shape ``P + (rotary_dim // 2,)`` on ``positions.device``, or on
        the CPU for devices without float64 (MPS), where a float64 tensor cannot live.
    """
    check_positions(positions)
    if not isinstance(inv_freq, torch.Tensor):
        raise TypeError(f"inv_freq must be a torch.Tensor of shape (rotary_dim // 2,), got {type(inv_freq).__name__}")
    if inv_freq.dim() != 1:
        raise ValueError(f"inv_freq must be 1-D (rotary_dim // 2,), got shape {tuple(inv_freq.shape)}")
    device = positions.device
    work = device if device.type not in NO_FLOAT64 else torch.device("cpu")
    return positions.to(work, torch.float64).unsqueeze(-1) * inv_freq.to(work, torch.float64)


def cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    attention_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for the given positions, from float64 angles.

    ``cos[..., i] = attention_scale * cos(positions[...] * inv_freq[i])`` and likewise sin.
    These are the *half-width* tables every ropekit apply takes: one entry per
    rotary pair, not duplicated to ``rotary_dim``. Multi-axis RoPE has its own call,
    :meth:`ropekit.AxisPlan.cos_sin` (``plan.cos_sin(positions)``, positions ``(..., n_axes)``).

    Args:
        positions: integer tensor of shape ``P`` (e.g. ``(seq,)`` or ``(batch, seq)``), ``>= 0``.
        inv_freq: tensor of shape ``(rotary_dim // 2,)`` (float64 from :func:`ropekit.inv_frequencies`).
        attention_scale: factor folded into both tables (YaRN / LongRoPE mscale).

    Returns:
        ``(cos, sin)``, float32 tensors of shape ``P + (rotary_dim // 2,)``.
    """
    if callable(getattr(inv_freq, "cos_sin", None)) and hasattr(inv_freq, "axis_names"):  # an AxisPlan (0.x call)
        warn_once("ropekit.cos_sin(positions, plan)", "plan.cos_sin(positions)")
        if float(attention_scale) != 1.0:
            raise ValueError(
                f"attention_scale must be left at 1.0 with an AxisPlan (the plan carries its own, "
                f"{inv_freq.attention_scale:g}), got {attention_scale!r}"
            )
        return inv_freq.cos_sin(positions)
    angles = rotation_angles(positions, inv_freq)
    scale = float(attention_scale)
    cos = torch.cos(angles)
    sin = torch.sin(angles)
    if scale != 1.0:
        cos = cos * scale
        sin = sin * scale
    # round to float32 before moving: the angles may sit on the CPU (see rotation_angles)
    return cos.to(torch.float32).to(positions.device), sin.to(torch.float32).to(positions.device)


# 0.x names (one release): each warns once and names its replacement
__getattr__ = module_getattr(__name__, {
    "inv_frequencies": ("ropekit.rope.frequencies:inv_freq_and_scale",
                        "ropekit.inv_frequencies (rules and rope dicts), or "
                        "ropekit.rope.frequencies.inv_freq_and_scale (rule objects)"),
})
