"""The fused forms composed of plain torch ops: the default of every backend (:class:`ropekit.ops.Backend`).

RMSNorm + rotation of one row ``x`` of ``n`` channels (a head vector, or per token all its heads)::

    r = 1 / sqrt(mean(x^2) + eps)        in float64 (squares of float32 values are exact there), rounded
                                         once to float32 (float64 for float64 x)
    y = (x * r) * g                      g = weight, weight_offset + weight (float32), or 1
    out = apply_rotary(y, cos, sin)      the backend's own rotation of the float32 y, then one
                                         rounding to x's dtype; channels past rotary_dim are y

Its backward (``gy = apply_rotary(grad, -theta)``, ``gyg = gy * g``)::

    grad_x = r * gyg - x * (r^3 * sum(gyg * x) / n)          grad_w = sum over rows of gy * x * r

These allocate float32 temporaries of x's size (the native kernels do not). Writing into a KV
cache copies the rotated keys and the values into their slots with indexing ops; an FP8 cache
gets the float32 rotated keys (values: converted exactly to float32) through one scaled
conversion (:func:`ropekit.ops.fp8.quantize`), never rounded to k's dtype first.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .fp8 import is_fp8, quantize


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision and float32 inputs, float64 for float64 (as the eager rotation)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def norm_dims(per_token: bool) -> tuple[int, ...]:
    """The axes one norm spans: the channels, or per token the heads and the channels."""
    return (-2, -1) if per_token else (-1,)


def inv_rms(xf: Tensor, eps: float, per_token: bool) -> Tensor:
    """``1 / sqrt(mean(xf^2) + eps)`` over the norm's axes (kept): float64 throughout, then ``xf``'s dtype."""
    ms = xf.double().square().mean(norm_dims(per_token), keepdim=True)
    return (1.0 / (ms + eps).sqrt()).to(xf.dtype)


def gains(weight: Tensor | None, weight_offset: float, work: torch.dtype) -> Tensor | None:
    """``weight_offset + weight`` in the compute dtype (None: no weight, the gains are 1)."""
    if weight is None:
        return None
    g = weight.to(work)
    return g + weight_offset if weight_offset != 0.0 else g


def normalize(x: Tensor, weight: Tensor | None, *, eps: float, weight_offset: float, per_token: bool) -> Tensor:
    """``(x * r) * g`` in float32 (float64 for float64 ``x``), a new tensor of x's shape."""
    xf = x.to(compute_dtype(x.dtype))
    y = xf * inv_rms(xf, eps, per_token)
    g = gains(weight, weight_offset, xf.dtype)
    return y * g if g is not None else y


def norm_rotate(backend, x: Tensor, weight: Tensor | None, cos: Tensor, sin: Tensor, *, eps: float,
                weight_offset: float, per_token: bool, layout: str, inplace: bool) -> Tensor:
    """RMSNorm, then ``backend.apply_rotary`` of the float32 result, rounded once into ``x`` or a new tensor."""
    y = normalize(x, weight, eps=eps, weight_offset=weight_offset, per_token=per_token)
    y = backend.apply_rotary(y, cos, sin, layout=layout, conjugate=False, inplace=True)
    return x.copy_(y) if inplace else torch.empty_like(x).copy_(y)


def norm_rotate_backward(backend, grad: Tensor, x: Tensor, weight: Tensor | None, cos: Tensor, sin: Tensor, *,
                         eps: float, weight_offset: float, per_token: bool,
                         layout: str) -> tuple[Tensor, Tensor | None]:
    """``(grad_x, grad_weight)`` of :func:`norm_rotate` (``grad_weight`` None without a weight)."""
    work = compute_dtype(x.dtype)
    xf = x.to(work)
    r = inv_rms(xf, eps, per_token)
    gy = backend.apply_rotary(grad.to(work), cos, sin, layout=layout, conjugate=True, inplace=False)
    g = gains(weight, weight_offset, work)
    gyg = gy * g if g is not None else gy
    n = x.shape[-1] * (x.shape[-2] if per_token else 1)
    dot = (gyg * xf).sum(norm_dims(per_token), keepdim=True)
    grad_x = (r * gyg - xf * ((r * r * r) * dot / n)).to(x.dtype)
    if weight is None:
        return grad_x, None
    grad_w = (gy * xf * r).reshape(-1, *weight.shape).sum(0)
    return grad_x, grad_w.to(weight.dtype)


def rotate_keys(backend, k: Tensor, cos: Tensor, sin: Tensor, *, k_weight: Tensor | None, eps: float | None,
                weight_offset: float, per_token: bool, block_size: int, layout: str) -> Tensor:
    """The keys as the cache stores them: rotated (normalised first when ``eps`` is given)."""
    if eps is None:
        return backend.apply_rotary(k, cos, sin, layout=layout, conjugate=False, inplace=False)
    if not per_token or block_size > 0:  # per head; or paged (tokens, kv_heads, head_dim): heads next to channels
        return backend.rms_norm_rotary(k, k_weight, cos, sin, eps=eps, weight_offset=weight_offset,
                                       per_token=per_token, layout=layout, inplace=False)
    lead = (1,) * (k.dim() - cos.dim())  # (batch, kv_heads, seq, head_dim): the norm spans axes 1 and 3
    cos, sin = cos.view(*lead, *cos.shape), sin.view(*lead, *sin.shape)
    out = backend.rms_norm_rotary(k.transpose(1, 2), k_weight, cos.transpose(1, 2), sin.transpose(1, 2), eps=eps,
                                  weight_offset=weight_offset, per_token=True, layout=layout, inplace=False)
    return out.transpose(1, 2)


def check_slots(k: Tensor, k_cache: Tensor, slots: Tensor | None, start: int, block_size: int) -> list[int] | Tensor:
    """Raise ValueError unless every slot fits the cache; returns the starts (contiguous) or the slots (paged)."""
    if block_size == 0:
        seq, length = k.shape[2], k_cache.shape[2]
        starts = [start] if slots is None else [int(s) for s in slots.reshape(-1).tolist()]
        for first in starts:
            if not 0 <= first <= length - seq:
                raise ValueError(f"slots: tokens [{first}, {first + seq}) do not fit in a cache of length {length}")
        return starts
    if slots is None:
        raise ValueError("slots: the paged layout needs a slot mapping (one slot per token)")
    index = slots.to(device=k_cache.device, dtype=torch.long)
    capacity = k_cache.shape[0] * block_size
    if index.numel() and int(index.max()) >= capacity:
        raise ValueError(f"slots: slot {int(index.max())} is outside a cache of {capacity} slots")
    return index


def cache_entries(x: Tensor, cache: Tensor, scale: Tensor | None, head_axis: int) -> Tensor:
    """``x`` as ``cache`` stores it: FP8 through ``scale`` (per head along ``head_axis``), else rounded to its dtype."""
    if not is_fp8(cache.dtype):
        return x.to(cache.dtype)
    if scale is None:
        raise ValueError(f"a {cache.dtype} cache needs a scale (a bug in ropekit: the public function gives one)")
    shape = [1] * x.dim()
    shape[head_axis] = -1
    return quantize(x.to(torch.float32), scale.reshape(shape) if scale.numel() > 1 else scale.reshape(()),
                    cache.dtype)


def rotate_scaled(backend, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                  slots: Tensor | None, start: int, *, k_scale: Tensor | None, v_scale: Tensor | None,
                  **options) -> None:
    """``Backend.rotate_into_cache`` with an FP8 cache: keys rotated in float32, each cache's entries made once."""
    check_slots(k, k_cache, slots, start, options["block_size"])  # before anything is computed or written
    k_rot = rotate_keys(backend, k.to(torch.float32), cos, sin, **options)  # bf16/fp16 -> float32 is exact
    head_axis = 1  # (batch, kv_heads, seq, head_dim) and (tokens, kv_heads, head_dim) alike
    write_slots(cache_entries(k_rot, k_cache, k_scale, head_axis), cache_entries(v, v_cache, v_scale, head_axis),
                k_cache, v_cache, slots, start, options["block_size"])


def write_slots(k_rot: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor | None, start: int,
                block_size: int) -> None:
    """Copy keys and values into their cache slots (see ``Backend.rotate_into_cache``); checks every slot first."""
    checked = check_slots(k_rot, k_cache, slots, start, block_size)
    if block_size == 0:
        seq = k_rot.shape[2]
        if len(checked) == 1:
            k_cache[:, :, checked[0]:checked[0] + seq].copy_(k_rot)
            v_cache[:, :, checked[0]:checked[0] + seq].copy_(v)
            return
        for b, first in enumerate(checked):
            k_cache[b, :, first:first + seq].copy_(k_rot[b])
            v_cache[b, :, first:first + seq].copy_(v[b])
        return
    keep = checked >= 0
    index = checked[keep]
    block, row = index // block_size, index % block_size
    k_cache[block, row] = k_rot[keep]
    v_cache[block, row] = v[keep]
