"""Oracles and yardsticks for the fused RMSNorm + rotation tests.

- ``unfused``: the composition the fused op replaces, torch's ``F.rms_norm`` then ropekit's rotation
  (two roundings to the dtype);
- ``reference64``: the same maths in float64 with the exact float64 rotation matrices
  (``ropekit.apply_reference``), rounded nowhere;
- ``radius_ulps``: a difference in units of the output dtype's ulp *at the rotated pair's
  magnitude* ``sqrt(y1^2 + y2^2)``: a rotation cancels (``y1 c - y2 s`` can be tiny while the pair
  is large), so an element's own ulp would count rounding at the pair's scale as thousands of ulps.
"""

import torch
import torch.nn.functional as F

import ropekit

MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}
MIN_EXPONENT = {torch.bfloat16: -126, torch.float16: -14, torch.float32: -126, torch.float64: -1022}


def effective_weight(weight, weight_offset):
    """What F.rms_norm gets for Gemma's form: ``weight_offset + weight`` added in float32."""
    if weight is None or weight_offset == 0.0:
        return weight
    return weight_offset + weight.float()


def normalized_shape(x, per_token):
    return tuple(x.shape[-2:]) if per_token else (x.shape[-1],)


def unfused(x, weight, cos, sin, *, eps, layout, weight_offset=0.0, per_token=False):
    """``ropekit.apply_rotary(F.rms_norm(x, ...), cos, sin)``: the composition the fused op replaces."""
    normed = F.rms_norm(x, normalized_shape(x, per_token), effective_weight(weight, weight_offset), eps)
    return ropekit.apply_rotary(normed, cos, sin, layout=layout)


def normalized64(x, weight, *, eps, weight_offset=0.0, per_token=False):
    """The normalised x in float64 (gains as the kernels use them: float32 ``weight_offset + weight``,
    float64 for float64 x)."""
    x64 = x.double()
    dims = (-2, -1) if per_token else (-1,)
    y = x64 * torch.rsqrt(x64.square().mean(dims, keepdim=True) + eps)
    if weight is None:
        return y
    if x.dtype == torch.float64:  # float64 inputs: float64 gains
        return y * (weight.double() + weight_offset)
    return y * effective_weight(weight, weight_offset).float().double()


def reference64(x, weight, positions, inv_freq, *, eps, layout, weight_offset=0.0, per_token=False):
    """float64 norm, then the float64 rotation matrices at ``positions`` (broadcast to x's rows)."""
    y = normalized64(x, weight, eps=eps, weight_offset=weight_offset, per_token=per_token)
    rotary = 2 * inv_freq.shape[0]
    rotated = ropekit.apply_reference(y[..., :rotary], positions.expand(x.shape[:-1]), inv_freq, layout=layout)
    return torch.cat((rotated, y[..., rotary:]), -1)


def pair_radius(y, rotary_dim, layout):
    """``sqrt(y1^2 + y2^2)`` of each element's rotary pair (the element's own magnitude on the tail)."""
    y = y.double()
    half = rotary_dim // 2
    if layout == "half":
        r = torch.sqrt(y[..., :half] ** 2 + y[..., half:rotary_dim] ** 2)
        r = torch.cat((r, r), -1)
    else:
        r = torch.sqrt(y[..., 0:rotary_dim:2] ** 2 + y[..., 1:rotary_dim:2] ** 2).repeat_interleave(2, -1)
    return torch.cat((r, y[..., rotary_dim:].abs()), -1)


def ulp_at(magnitude, dtype):
    exponent = torch.floor(torch.log2(magnitude.clamp_min(1e-300))).clamp_min(MIN_EXPONENT[dtype])
    return torch.exp2(exponent - MANTISSA[dtype])


def radius_ulps(a, b, y64, rotary_dim, layout):
    """``|a - b|`` in ulps of a's dtype at the pair radius of the exact result ``y64``."""
    return (a.double() - b.double()).abs() / ulp_at(pair_radius(y64, rotary_dim, layout), a.dtype)


def rotate64(y, cos, sin, layout):
    """The rotation written out in float64 with the given (float32) tables taken as exact; tail kept."""
    y, c, s = y.double(), cos.double(), sin.double()
    half = c.shape[-1]
    if layout == "half":
        a, b = y[..., :half], y[..., half:2 * half]
        rotated = torch.cat((a * c - b * s, b * c + a * s), -1)
    else:
        a, b = y[..., 0:2 * half:2], y[..., 1:2 * half:2]
        rotated = torch.stack((a * c - b * s, b * c + a * s), -1).flatten(-2)
    return torch.cat((rotated, y[..., 2 * half:]), -1)


def exact64(x, weight, cos, sin, *, eps, layout, weight_offset=0.0, per_token=False):
    """The fused op's maths in float64 on the same inputs (x, gains, the float32 tables): no rounding anywhere."""
    return rotate64(normalized64(x, weight, eps=eps, weight_offset=weight_offset, per_token=per_token), cos, sin,
                    layout)
