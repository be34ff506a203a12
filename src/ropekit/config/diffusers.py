"""Axial RoPE in diffusers transformer configs (``transformer/config.json``, ``_class_name``).

diffusers keeps the rotary embedding's numbers in the transformer's constructor arguments (some
of them hard-coded in the model's code, such as FLUX.1's theta 10000). Each reader below turns
one class's config into the keyword arguments of :class:`ropekit.RopeConfig`: head_dim, base,
``layout="interleaved"`` (diffusers' ``apply_rotary_emb(..., use_real_unbind_dim=-1)`` and Wan's
own apply pair channels ``(2i, 2i+1)``) and the axis plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..rope import plans
from ..rope.axes import AxisPlan


def _int(cfg: Mapping[str, Any], key: str, default: int) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key} must be a positive int, got {value!r}")
    return value


def _dims(cfg: Mapping[str, Any], key: str, default: tuple[int, ...]) -> tuple[int, ...]:
    value = cfg.get(key, default)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{key} must be a list of even ints (channels per axis), got {value!r}")
    return tuple(value)


def _theta(cfg: Mapping[str, Any], default: float) -> float:
    value = cfg.get("rope_theta", default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"rope_theta must be a number > 0, got {value!r}")
    return float(value)


def _flux(cfg: Mapping[str, Any]) -> tuple[int, float, AxisPlan]:
    base = 10000.0  # FluxTransformer2DModel builds FluxPosEmbed(theta=10000, ...)
    return _int(cfg, "attention_head_dim", 128), base, plans.flux(_dims(cfg, "axes_dims_rope", (16, 56, 56)), base)


def _flux2(cfg: Mapping[str, Any]) -> tuple[int, float, AxisPlan]:
    base = _theta(cfg, 2000.0)
    return _int(cfg, "attention_head_dim", 128), base, plans.flux2(_dims(cfg, "axes_dims_rope", (32, 32, 32, 32)), base)


def _hunyuan_video(cfg: Mapping[str, Any]) -> tuple[int, float, AxisPlan]:
    base = _theta(cfg, 256.0)
    dims = _dims(cfg, "rope_axes_dim", (16, 56, 56))
    return _int(cfg, "attention_head_dim", 128), base, plans.hunyuan_video(dims, base)


def _wan(cfg: Mapping[str, Any]) -> tuple[int, float, AxisPlan]:
    head_dim = _int(cfg, "attention_head_dim", 128)
    return head_dim, 10000.0, plans.wan(head_dim)  # WanRotaryPosEmbed(..., theta=10000.0)


def _cogvideox(cfg: Mapping[str, Any]) -> tuple[int, float, AxisPlan]:
    if not cfg.get("use_rotary_positional_embeddings", False):
        raise ValueError("this CogVideoX config has use_rotary_positional_embeddings false: its positions are "
                         "sinusoidal absolute embeddings, not RoPE")
    head_dim = _int(cfg, "attention_head_dim", 64)
    return head_dim, 10000.0, plans.cogvideox(head_dim)


#: diffusers ``_class_name`` -> reader.
READERS: dict[str, Callable[[Mapping[str, Any]], tuple[int, float, AxisPlan]]] = {
    "FluxTransformer2DModel": _flux,
    "Flux2Transformer2DModel": _flux2,
    "HunyuanVideoTransformer3DModel": _hunyuan_video,
    "WanTransformer3DModel": _wan,
    "CogVideoXTransformer3DModel": _cogvideox,
}


def diffusers_rope(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``RopeConfig`` keyword arguments for a diffusers transformer config (with ``_class_name``)."""
    name = cfg.get("_class_name")
    if name not in READERS:
        raise ValueError(f"diffusers model {name!r}: ropekit reads the rotary embedding of {sorted(READERS)}")
    head_dim, base, plan = READERS[name](cfg)
    if plan.rotary_dim != head_dim:
        raise ValueError(f"{name}: the rotary axes cover {plan.rotary_dim} channels ({plan!r}) but "
                         f"attention_head_dim is {head_dim}; they must be equal")
    return {"head_dim": head_dim, "base": base, "layout": "interleaved", "axes": plan}
