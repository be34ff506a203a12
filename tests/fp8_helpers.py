"""Oracles for the FP8 cache tests (a helper, not a test).

- ``one_rounding``: the stored entry by definition, ``fp8(clamp(x / scale, -max, max))`` of a
  float32 ``x``, written out here with torch ops (division, clamp, ``.to``), independent of
  ``ropekit.ops.fp8``;
- ``bracket``: the entries allowed when only a float64 value ``y64`` and a float32 error bound
  ``tol`` are known: the rounding is monotone, so the entry lies between the roundings of
  ``y64 - tol`` and ``y64 + tol`` (the same entry unless that interval straddles a rounding
  boundary of the FP8 grid);
- ``keys64``: the keys rotated (normalised first) in float64 with the exact rotation matrices
  (``ropekit.apply_reference``), and the float32 error bound of a backend's result;
- ``vllm_reference_cache``: vLLM's own test reference, ported (see its docstring).
"""

import torch

import ropekit
from fused_helpers import normalized64, pair_radius, ulp_at

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def per_head(scale, x, head_axis):
    """``scale`` (float, ``()`` or ``(heads,)``) as a float64 tensor broadcast along ``head_axis`` of ``x``."""
    s = torch.as_tensor(scale, dtype=torch.float32).double().reshape(-1)
    shape = [1] * x.dim()
    shape[head_axis] = -1
    return s.reshape(shape) if s.numel() > 1 else s.reshape(())


def one_rounding(x, scale, dtype, head_axis=1):
    """``fp8(clamp(x / scale, -max, max))``: float32 x, float32 scale, the float32 quotient rounded once."""
    assert x.dtype == torch.float32
    s = per_head(scale, x, head_axis).float()
    return (x / s).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)


def bracket(y64, tol, scale, dtype, head_axis=1):
    """``(low, high)`` float64 values of the entries an ``x`` within ``tol`` of ``y64`` may round to."""
    s = per_head(scale, y64, head_axis)

    def entry(x):  # float64 -> FP8 directly: one rounding (the quotient's float32 rounding is inside tol)
        return (x / s).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype).double()

    return entry(y64 - tol), entry(y64 + tol)


def keys64(k, cos_positions, inv_freq, *, layout, eps=None, weight=None, per_token=False):
    """``(y64, tol)``: keys in float64 (normalised with ``eps``) rotated by the exact matrices, and 8 float32
    ulps at each pair's radius (the float32 tables' and the kernels' own rounding)."""
    if eps is None:
        y = k.double()
    else:
        y = normalized64(k, weight, eps=eps, per_token=per_token)
    rotary = 2 * inv_freq.shape[0]
    rotated = ropekit.apply_reference(y[..., :rotary], cos_positions.expand(k.shape[:-1]), inv_freq, layout=layout)
    y64 = torch.cat((rotated, y[..., rotary:]), -1)
    return y64, 8 * ulp_at(pair_radius(y64, rotary, layout), torch.float32)


def vllm_reference_cache(key, slot_mapping, cache_shape, block_size, scale, dtype):
    """vLLM's reference for ``reshape_and_cache_flash`` (``tests/kernels/attention/test_cache.py``,
    ``test_reshape_and_cache_flash``, NHD layout), ported to pure torch: every token's key is copied
    into ``cache[slot // block_size, slot % block_size]`` of a float16 clone, and the test then
    compares that clone with the FP8 cache read back by ``convert_fp8`` (``float(q) * scale``),
    within ``atol=1e-3, rtol=0.1``. Returns the float16 clone (zeros elsewhere)."""
    ref = torch.zeros(cache_shape, dtype=torch.float16)
    block_indices = torch.div(slot_mapping, block_size, rounding_mode="floor").tolist()
    block_offsets = (slot_mapping % block_size).tolist()
    for i in range(key.shape[0]):
        ref[block_indices[i], block_offsets[i], :, :] = key[i]
    return ref


def convert_fp8_back(cache, scale):
    """vLLM's ``convert_fp8`` from FP8 to float16, per-tensor scale: ``half(float(half(q)) * scale)``."""
    return (cache.to(torch.float16).float() * float(scale)).to(torch.float16)
