"""The multi-axis plans of named models, built from their few numbers (see docs/multiaxis.md).

Each function returns an :class:`~ropekit.rope.axes.AxisPlan`; its defaults are the published
model's. The pairing (``layout``) is the model's business, not the plan's: Qwen's language and
vision towers (Qwen2.5-Omni's thinker too) and DINOv3 pair channels ``(i, i + d/2)`` (``"half"``);
Flux, HunyuanVideo, Wan, CogVideoX, EVA-02 / timm, rope-vit, GLM-4.1V and ERNIE-4.5-VL pair
``(2i, 2i+1)`` (``"interleaved"``). :data:`LAYOUTS` records which.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ..validation import check_even_positive
from .axes import AxisPlan, axial, mrope, single_axis
from .frequencies import base_inv_freq


def qwen2_vl(head_dim: int = 128, base: float = 1e6, section: Sequence[int] = (16, 24, 24)) -> AxisPlan:
    """Qwen2-VL / Qwen2.5-VL language model: contiguous M-RoPE sections over ``base^(-2k/head_dim)``."""
    return mrope(base_inv_freq(head_dim, base), section)


def qwen3_vl(head_dim: int = 128, base: float = 5e6, section: Sequence[int] = (24, 20, 20)) -> AxisPlan:
    """Qwen3-VL language model: the same ladder, t/h/w assigned pair by pair (interleaved M-RoPE)."""
    return mrope(base_inv_freq(head_dim, base), section, interleaved=True)


def hw_alternating_mrope(inv_freq: Any, section: Sequence[int], *, attention_scale: float = 1.0) -> AxisPlan:
    """ERNIE-4.5-VL's M-RoPE over one ladder: h and w alternate over the first pairs, t takes the last.

    With ``section = (s_h, s_w, s_t)`` (ERNIE's ``mrope_section``, in that order; ``s_h == s_w``):
    pair ``j < s_h + s_w`` reads h when ``j`` is even and w when it is odd, the last ``s_t`` pairs
    read t; every pair keeps its frequency ``inv_freq[j]`` (transformers'
    ``Ernie4_5_VLMoeTextRotaryEmbedding`` permutes the ladder and un-permutes it when it recomposes
    the tables: the two steps cancel to this map). Axes ``("t", "h", "w")``, as the positions come.

    Args:
        inv_freq: the 1-D ladder, float64 ``(pairs,)``.
        section: ``(s_h, s_w, s_t)``, adding up to ``pairs``.
        attention_scale: factor on cos and sin.
    """
    freq = single_axis(inv_freq).inv_freq  # checked: a non-empty ladder of finite numbers >= 0
    valid = (not isinstance(section, (str, bytes)) and isinstance(section, Sequence) and len(section) == 3
             and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section))
    if not valid or section[0] != section[1] or sum(section) != len(freq):
        raise ValueError(f"ERNIE-4.5-VL's mrope_section must be three ints (h, w, t) >= 0 with h == w, adding up "
                         f"to the {len(freq)} pairs (rotary_dim // 2), got {section!r}")
    axis = [1 + j % 2 for j in range(2 * section[0])] + [0] * section[2]
    return AxisPlan(freq, axis, ("t", "h", "w"), attention_scale=attention_scale)


def glm4v(head_dim: int = 128, base: float = 10000.0, section: Sequence[int] = (8, 12, 12),
          partial_rotary_factor: float = 0.5) -> AxisPlan:
    """GLM-4.1V / GLM-4.5V language model: contiguous M-RoPE sections over the rotated channels' ladder.

    Only ``int(head_dim * partial_rotary_factor)`` channels rotate (the ladder is theirs:
    ``base^(-2k/rotary_dim)``), the rest pass through. GLM-4.1V (``glm4v``) pairs them ``(2i, 2i+1)``,
    GLM-4.5V (``glm4v_moe``) ``(i, i + rotary_dim/2)``: the same plan, another ``layout``.
    """
    check_even_positive(head_dim, "head_dim")
    return mrope(base_inv_freq(check_even_positive(int(head_dim * partial_rotary_factor), "rotary_dim"), base),
                 section)


def ernie4_5_vl(head_dim: int = 128, base: float = 500000.0, section: Sequence[int] = (22, 22, 20)) -> AxisPlan:
    """ERNIE-4.5-VL language model: :func:`hw_alternating_mrope` over ``base^(-2k/head_dim)``."""
    return hw_alternating_mrope(base_inv_freq(head_dim, base), section)


def _two_halves(head_dim: int, base: float, names: tuple[str, str]) -> AxisPlan:
    check_even_positive(head_dim, "head_dim")
    if head_dim % 4:
        raise ValueError(f"2-D axial RoPE splits head_dim in two even halves: head_dim must be a multiple of 4, "
                         f"got {head_dim}")
    return axial((head_dim // 2, head_dim // 2), base, axis_names=names)


def qwen_vl_vision(head_dim: int = 80, base: float = 10000.0) -> AxisPlan:
    """Qwen2-VL / 2.5-VL / 3-VL vision towers: pairs ``[0, d/4)`` on the row, ``[d/4, d/2)`` on the column."""
    return _two_halves(head_dim, base, ("h", "w"))


def eva02(head_dim: int = 64, base: float = 10000.0) -> AxisPlan:
    """EVA-02 / timm ``RotaryEmbeddingCat`` (``in_pixels=False``, ``grid_indexing='ij'``): row, then column."""
    return _two_halves(head_dim, base, ("h", "w"))


def rope_vit_axial(head_dim: int = 64, base: float = 100.0) -> AxisPlan:
    """RoPE-Axial of Heo et al. 2024 (rope-vit, timm ``*_rope_*`` with ``grid_indexing='xy'``): x, then y."""
    return _two_halves(head_dim, base, ("x", "y"))


def dinov3(head_dim: int = 64, base: float = 100.0) -> AxisPlan:
    """DINOv3: ``2 pi base^(-4k/head_dim)`` per axis (periods), on centred coordinates in ``[-1, 1]``."""
    plan = _two_halves(head_dim, base, ("h", "w"))
    return plan.with_frequencies(plan.inv_freq * (2 * math.pi))


def flux(axes_dims: Sequence[int] = (16, 56, 56), base: float = 10000.0) -> AxisPlan:
    """FLUX.1 (``axes_dims_rope``): axis 0 the image index (0 for text and the generated image), then row, column."""
    return axial(axes_dims, base, axis_names=("index", "h", "w"))


def flux2(axes_dims: Sequence[int] = (32, 32, 32, 32), base: float = 2000.0) -> AxisPlan:
    """FLUX.2 (``axes_dims_rope``, ``rope_theta``): axes (t, h, w, l)."""
    return axial(axes_dims, base, axis_names=("t", "h", "w", "l"))


def hunyuan_video(axes_dims: Sequence[int] = (16, 56, 56), base: float = 256.0) -> AxisPlan:
    """HunyuanVideo (``rope_axes_dim`` / ``rope_dim_list``, ``rope_theta``): frame, row, column of the latent grid."""
    return axial(axes_dims, base, axis_names=("t", "h", "w"))


def wan_axes_dims(head_dim: int) -> tuple[int, int, int]:
    """Wan's split of a head: ``h = w = 2 * (head_dim // 6)``, ``t`` the rest (44, 42, 42 for 128)."""
    check_even_positive(head_dim, "head_dim")
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def wan(head_dim: int = 128, base: float = 10000.0) -> AxisPlan:
    """Wan 2.x: axial (t, h, w) with :func:`wan_axes_dims`."""
    return axial(wan_axes_dims(head_dim), base, axis_names=("t", "h", "w"))


def cogvideox_axes_dims(head_dim: int) -> tuple[int, int, int]:
    """CogVideoX's split: ``t = head_dim // 4``, ``h = w = head_dim // 8 * 3`` (16, 24, 24 for 64)."""
    check_even_positive(head_dim, "head_dim")
    dims = (head_dim // 4, head_dim // 8 * 3, head_dim // 8 * 3)
    if sum(dims) != head_dim or any(d % 2 for d in dims):
        raise ValueError(f"CogVideoX splits head_dim into (d/4, 3d/8, 3d/8): head_dim must be a multiple of 16, "
                         f"got {head_dim} -> {dims}")
    return dims


def cogvideox(head_dim: int = 64, base: float = 10000.0) -> AxisPlan:
    """CogVideoX (``use_rotary_positional_embeddings``): axial (t, h, w) with :func:`cogvideox_axes_dims`."""
    return axial(cogvideox_axes_dims(head_dim), base, axis_names=("t", "h", "w"))


#: Plan builders by name (``ropekit.multiaxis.named_plan``).
NAMED_PLANS: dict[str, Callable[..., AxisPlan]] = {
    "qwen2-vl": qwen2_vl,
    "qwen2.5-vl": qwen2_vl,
    "qwen3-vl": qwen3_vl,
    "qwen2.5-omni": qwen2_vl,
    "glm4v": glm4v,
    "ernie4.5-vl": ernie4_5_vl,
    "qwen-vl-vision": qwen_vl_vision,
    "eva02": eva02,
    "rope-vit-axial": rope_vit_axial,
    "dinov3": dinov3,
    "flux": flux,
    "flux2": flux2,
    "hunyuan-video": hunyuan_video,
    "wan": wan,
    "cogvideox": cogvideox,
}
#: The pairing each named plan is used with.
LAYOUTS = {name: ("half" if name.startswith("qwen") or name == "dinov3" else "interleaved") for name in NAMED_PLANS}


def named_plan(name: str, **kwargs: Any) -> AxisPlan:
    """The plan of a named model, e.g. ``named_plan("flux")`` or ``named_plan("wan", head_dim=128)``.

    Keyword arguments go to the builder (``head_dim``, ``base``, ``section``, ``axes_dims``).
    """
    if name not in NAMED_PLANS:
        raise ValueError(f"unknown plan {name!r}; known: {', '.join(NAMED_PLANS)}")
    return NAMED_PLANS[name](**kwargs)
