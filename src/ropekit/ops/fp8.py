"""FP8 cache entries: the scaled conversion every backend's cache write rounds with.

vLLM's convention for FP8 KV caches (``reshape_and_cache_flash``; its CUDA conversion
``scaled_vec_conversion`` in ``csrc/quantization/fp8/nvidia/quant_utils.cuh`` calls
``__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, ...)``): the stored entry is::

    q = fp8(clamp(x / scale, -fp8_max, fp8_max))        x: float32, scale: float32 (> 0)

a float32 division (not a multiplication by ``1 / scale``), saturated to the format's largest
finite value (448 for ``float8_e4m3fn``, 57344 for ``float8_e5m2``), rounded to nearest even;
NaN stays NaN (torch's ``clamp``). An entry reads back as ``float(q) * scale``.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: The cache dtypes written through a scale.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of :data:`FP8_DTYPES`."""
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype (448.0 or 57344.0)."""
    return float(torch.finfo(dtype).max)


def quantize(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``fp8(clamp(x / scale, -max, max))``: float32 ``x``, ``scale`` broadcast against it, one rounding."""
    if x.dtype != torch.float32:
        raise TypeError(f"x must be float32 (the one rounding is from float32), got {x.dtype}")
    limit = fp8_max(dtype)
    return (x / scale.to(torch.float32)).clamp(-limit, limit).to(dtype)
