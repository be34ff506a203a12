"""The peers of ``ropekit bench`` beside the rotation: q/k RMSNorm + rotation, and keys rotated into a KV cache.

Each peer is what a model runs without ropekit, as transformers writes it:

- **q/k norm + rotation** (Qwen3, Gemma 3, OLMo 2): transformers' ``Qwen3RMSNorm`` on q and on k (float32
  inside, rounded to the activation dtype, times the weight) then ``apply_rotary_pos_emb``
  (:func:`norm_then_rotate`); ropekit's counterpart is :func:`ropekit.rms_norm_rotary_qk`, one pass.
- **rotate then copy into the cache** (a decode step with a static cache): the new keys rotated
  (``k * cos + rotate_half(k) * sin``) then keys and values written into their slot with ``index_copy_``,
  as transformers' ``StaticCache`` writes them (:func:`rotate_then_copy`); ropekit's counterpart is
  :func:`ropekit.rotate_into_cache`. Its floor is the ``index_copy_`` of k and v alone (:func:`copy_into_cache`).

Both are timed eager and, in the full run, compiled by ``torch.compile`` (once per case, warmed up, then
timed in the same interleaved rounds as every other row). Before anything is timed, :func:`check`
compares each row's result with the float64 reference (:func:`reference_rotation` of
:func:`reference_norm`): a peer that computes something else is refused with a ``RuntimeError``, not timed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ropekit import apply_reference

from .precision import rotate_half

__all__ = ["CACHE_SLOTS", "EPS", "TOLERANCE_EPS", "check", "copy_into_cache", "norm_then_rotate", "qwen3_norm",
           "reference_norm", "reference_rotation", "rotate_then_copy"]

#: The norms' epsilon (Qwen3's).
EPS = 1e-6
#: Slots of the KV cache the cache rows write into (the last one, every call).
CACHE_SLOTS = 256
#: A result is the reference's when within this many ``eps`` of its dtype, times the reference's largest magnitude:
#: a few roundings to the activation dtype (tables, normalised values, products) stay well inside it; a wrong
#: position, layout or norm is off by the order of the values themselves.
TOLERANCE_EPS = 8


def _rms_norm_recipe(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Transformers' ``Qwen3RMSNorm.forward``, the same code (for when transformers is not installed)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def qwen3_norm(weight: torch.Tensor, eps: float = EPS) -> Callable[[torch.Tensor], torch.Tensor]:
    """Transformers' ``Qwen3RMSNorm`` over the last axis with gains ``weight`` ``(head_dim,)`` (its dtype).

    The module itself when transformers is installed, else the same recipe.
    """
    try:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    except ImportError:
        return lambda x: _rms_norm_recipe(x, weight, eps)
    module = Qwen3RMSNorm(weight.shape[-1], eps=eps).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module


def norm_then_rotate(q_norm: Callable, k_norm: Callable, rotate: Callable) -> Callable:
    """``fn(q, k, cos, sin)``: the norms of q and k, then ``rotate(q, k, cos, sin)`` (transformers' order)."""

    def run(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return rotate(q_norm(q), k_norm(k), cos, sin)

    return run


def rotate_then_copy(k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, index: torch.Tensor) -> None:
    """The keys rotated, then keys and values copied into their cache slots (transformers' ``StaticCache``).

    ``k``, ``v``: ``(batch, kv_heads, seq, head_dim)``; ``cos``, ``sin``: full-width ``(seq, head_dim)``
    tables in the activation dtype; ``index``: the ``(seq,)`` slots along the caches' axis 2.
    """
    k_rotated = k * cos + rotate_half(k) * sin
    k_cache.index_copy_(2, index, k_rotated)
    v_cache.index_copy_(2, index, v)


def copy_into_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    index: torch.Tensor) -> None:
    """The floor of a cache write: keys and values copied into their slots, nothing rotated."""
    k_cache.index_copy_(2, index, k)
    v_cache.index_copy_(2, index, v)


def reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """float64 RMSNorm over the last axis: ``x / sqrt(mean(x²) + eps) * weight``."""
    x64 = x.to(torch.float64)
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.to(torch.float64)


def reference_rotation(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """float64 rotation of ``x`` ``(..., seq, head_dim)`` by ``positions`` ``(seq,)`` ("half" pairs)."""
    return apply_reference(x, positions, inv_freq, layout="half")


def check(name: str, results: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], *,
          relative: float = 0.0) -> None:
    """Raise ``RuntimeError`` naming the row ``name`` unless each result is its float64 reference.

    Within :data:`TOLERANCE_EPS` ``eps`` of the result's dtype, or ``relative`` if larger, times the
    reference's largest magnitude (a peer that computes its own tables from float32 angles is off by
    about ``position * 2**-24`` radians: ``relative`` allows for that).
    """
    for got, want in zip(results, expected, strict=True):
        if got.shape != want.shape:
            raise RuntimeError(f"bench row {name!r} computes a result of shape {tuple(got.shape)}, the reference "
                               f"{tuple(want.shape)}: it would be timed doing something else")
        scale = want.abs().max().item() if want.numel() else 0.0
        error = (got.to(torch.float64) - want.to(got.device)).abs().max().item() if got.numel() else 0.0
        if not error <= max(TOLERANCE_EPS * torch.finfo(got.dtype).eps, relative) * scale:
            raise RuntimeError(f"bench row {name!r} is off the float64 reference by {error:.3g} (largest value "
                               f"{scale:.3g}, {got.dtype}): it would be timed computing something else")
