"""The scales of FP8 KV caches: checked once for :func:`ropekit.rotate_into_cache`, and reading such a cache back.

vLLM's convention (``k_scale``/``v_scale`` of its attention layers): a cache entry ``q`` of a
``float8_e4m3fn`` or ``float8_e5m2`` cache stands for ``float(q) * scale``, and a value ``x`` is
stored as ``fp8(clamp(x / scale, -max, max))`` (:mod:`ropekit.ops.fp8`). A scale is one float32
number for the whole cache (per tensor) or one per kv head (per head).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..ops.fp8 import FP8_DTYPES, is_fp8

_SCALE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_scale(scale, name: str, cache: Tensor, cache_name: str, kv_heads: int) -> Tensor | None:
    """The float32 ``(kv_heads,)`` scale a backend takes for ``cache``, or None for a cache that is not FP8.

    ``scale``: None (1.0 for an FP8 cache, as vLLM), a Python number, or a floating tensor of
    shape ``()``, ``(1,)`` (per tensor) or ``(kv_heads,)`` (per head) on the cache's device.
    Every value, converted to float32, must be finite and > 0 (a CUDA tensor is read back).
    """
    if not is_fp8(cache.dtype):
        if scale is not None:
            raise ValueError(f"{name} is given but {cache_name} is {cache.dtype}: a scale applies to FP8 caches "
                             f"({', '.join(str(d) for d in FP8_DTYPES)}) only; pass {name}=None")
        return None
    if scale is None:
        scale = 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float, Tensor)):
        raise TypeError(f"{name} must be a float or a floating tensor, got {type(scale).__name__}")
    if not isinstance(scale, Tensor):
        value = float(torch.tensor(float(scale), dtype=torch.float32))  # what the kernels divide by
        if not (math.isfinite(value) and value > 0.0):
            raise ValueError(f"{name} must be finite and > 0 (as a float32), got {scale!r}")
        return torch.full((kv_heads,), value, dtype=torch.float32, device=cache.device)
    if scale.dtype not in _SCALE_DTYPES:
        raise TypeError(f"{name} must be a float32, float64, bfloat16 or float16 tensor, got {scale.dtype}")
    if tuple(scale.shape) not in ((), (1,), (kv_heads,)):
        raise ValueError(f"{name} must have shape () or (1,) (per tensor) or (kv_heads,) = ({kv_heads},) (per head), "
                         f"got {tuple(scale.shape)}")
    if scale.device != cache.device:
        raise ValueError(f"{name} is on {scale.device} but {cache_name} is on {cache.device}")
    values = scale.detach().to(torch.float32).reshape(-1)
    bad = ~(torch.isfinite(values) & (values > 0))
    if bool(bad.any()):
        raise ValueError(f"{name} must be finite and > 0 (as float32), got {values[bad][0].item()!r}"
                         + (f" for kv head {int(bad.nonzero()[0])}" if values.numel() > 1 else ""))
    return values.expand(kv_heads).contiguous()


def _per_head(scale: Tensor, kv_heads: int) -> Tensor:
    """The float32 ``(kv_heads,)`` values of a scale tensor of a checked signature (:func:`check_scale`'s)."""
    return scale.detach().to(torch.float32).reshape(-1).expand(kv_heads).contiguous()


def _source(scale, values: Tensor | None, kv_heads: int):
    """How a prepared call of the signature of ``scale`` gets the scale its backend takes, as :func:`check_scale`.

    None or a number: ``values``, the same on every call (the signature holds the number); a float32
    ``(kv_heads,)`` contiguous tensor: itself; another tensor: converted and expanded. The values
    are not checked here: the prepared call checks them (:meth:`ropekit.ops.Backend.prepared_scaled_cache_write`).
    """
    if not isinstance(scale, Tensor):
        return lambda s: values
    if scale.dtype == torch.float32 and tuple(scale.shape) == (kv_heads,) and scale.is_contiguous():
        return lambda s: s
    return lambda s: _per_head(s, kv_heads)


def scaled_call(write, k_scale, k_values: Tensor | None, v_scale, v_values: Tensor | None, kv_heads: int):
    """The prepared call of ``rotate_into_cache`` with FP8 caches: ``write`` given the scales as :func:`check_scale`.

    ``k_scale``/``v_scale`` are the checked call's scales and ``k_values``/``v_values`` what
    :func:`check_scale` made of them; the call takes the backend's cache-write arguments and the
    scales as the caller passes them (a later call of the same signature).
    """
    k_of, v_of = _source(k_scale, k_values, kv_heads), _source(v_scale, v_values, kv_heads)

    def run(k, v, cos, sin, k_cache, v_cache, slots, start, k_weight, k_scale, v_scale):
        write(k, v, cos, sin, k_cache, v_cache, slots, start, k_weight, k_of(k_scale), v_of(v_scale))

    return run


def dequantize_cache(cache: Tensor, scale: float | Tensor = 1.0, dtype: torch.dtype = torch.float32, *,
                     block_size: int | None = None) -> Tensor:
    """An FP8 KV cache read back: ``float(q) * scale``, as vLLM's attention reads it.

    Args:
        cache: a ``float8_e4m3fn`` or ``float8_e5m2`` cache as :func:`ropekit.rotate_into_cache`
            writes it: ``(batch, kv_heads, max_length, head_dim)``, or paged ``(num_blocks,
            block_size, kv_heads, head_dim)``.
        scale: the scale it was written with: a float, a ``()``/``(1,)`` tensor (per tensor) or a
            ``(kv_heads,)`` tensor (per head), finite and > 0.
        dtype: the floating dtype returned; the product is computed in float32 (float64 for
            float64) and rounded once to ``dtype``.
        block_size: None for the contiguous layout, the block size for the paged one (where the
            kv_heads axis is; it matters for per-head scales only).

    Returns:
        A new tensor of the cache's shape and ``dtype``.

    Raises:
        TypeError: a cache that is not FP8, or a ``dtype`` that is not floating.
        ValueError: a scale that is not finite and > 0 or of the wrong shape, a ``block_size``
            that does not fit the cache.
    """
    if not isinstance(cache, Tensor) or not is_fp8(cache.dtype):
        raise TypeError(f"cache must be a float8_e4m3fn or float8_e5m2 tensor, got "
                        f"{getattr(cache, 'dtype', type(cache).__name__)}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if cache.dim() != 4:
        raise ValueError(f"cache must be 4-D (batch, kv_heads, max_length, head_dim) or paged (num_blocks, block_size, "
                         f"kv_heads, head_dim), got shape {tuple(cache.shape)}")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                   or block_size != cache.shape[1]):
        raise ValueError(f"block_size must be None (contiguous) or the cache's block size {cache.shape[1]}, got "
                         f"{block_size!r}")
    head_axis = 1 if block_size is None else 2
    per_head = check_scale(scale, "scale", cache, "cache", cache.shape[head_axis])
    work = torch.float64 if dtype == torch.float64 else torch.float32
    shape = [1, 1, 1, 1]
    shape[head_axis] = -1
    return (cache.to(work) * per_head.to(work).view(shape)).to(dtype)
