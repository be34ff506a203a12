"""The Triton backend ``"triton"``: every form on the fused kernel of :mod:`.triton_kernel`.

The kernel runs on CUDA tensors (and on any device under ``TRITON_INTERPRET=1``) for
float32/float16/bfloat16; elsewhere, and for float64, each form runs on the eager backend
(same results up to the rounding of the interpreter). Forms:

- ``apply_rotary``: one launch per tensor, tables addressed by strides (stride 0 where broadcast);
- ``apply_rotary_qk``: q and k in one launch when they differ at most along the heads axis and
  their other leading axes collapse to two, else one launch each;
- ``rotate`` / ``rotate_qk`` (by position): one launch that looks each token's row up
  in the full tables inside the kernel (positions, offsets, ``cu_seqlens``);
- ``rms_norm_rotary`` (one launch per tensor), its backward, and ``rotate_into_cache`` (one
  launch for the keys, one for the values) on the kernels of :mod:`.triton_fused`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import fused_eager
from . import triton_fused as fused
from . import triton_kernel as kern
from .backend import Backend
from .eager import EagerBackend, full_rank
from .fp8 import is_fp8

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _use_kernel(x: Tensor, rotary_dim: int) -> bool:
    return kern.can_launch(x) and x.dtype in KERNEL_DTYPES and rotary_dim > 0


class TritonBackend(Backend):
    """``backend="triton"``: see the module docstring."""

    name = "triton"

    def __init__(self) -> None:
        self._fallback = EagerBackend()

    def is_available(self) -> bool:  # noqa: D102
        return kern.is_available()

    def cannot_run(self, x: Tensor) -> str | None:
        """See :class:`ropekit.ops.Backend`: CUDA tensors (any device interpreted) of float32, float16 or bfloat16."""
        if kern.can_launch(x) and (x.dtype in KERNEL_DTYPES or is_fp8(x.dtype)):
            return None
        return (
            "CUDA tensors (any device under TRITON_INTERPRET=1) of dtype float32, float16 or bfloat16 (FP8 caches too)")

    def apply_rotary(self, x, cos, sin, *, layout, conjugate, inplace):
        """See :class:`ropekit.ops.Backend`."""
        if not _use_kernel(x, 2 * cos.shape[-1]):
            return self._fallback.apply_rotary(x, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)
        cos, sin = full_rank(x, cos, sin)
        out = x if inplace else torch.empty_like(x)
        if x.numel():
            kern.launch_apply_rotary(x, out, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)
        return out

    def apply_rotary_qk(self, q, k, cos, sin, *, layout, conjugate, inplace):
        """See :class:`ropekit.ops.Backend`."""
        if _use_kernel(q, 2 * cos.shape[-1]) and q.dtype == k.dtype:
            cos, sin = full_rank(q, cos, sin)
            q_out, k_out = (q, k) if inplace else (torch.empty_like(q), torch.empty_like(k))
            if kern.launch_apply_rotary_qk(q, k, q_out, k_out, cos, sin, layout=layout, conjugate=conjugate,
                                           inplace=inplace):
                return q_out, k_out
        return super().apply_rotary_qk(q, k, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)

    def rotate(self, x, cos_table, sin_table, where, *, layout, conjugate, inplace):
        """See :class:`ropekit.ops.Backend`."""
        if not _use_kernel(x, 2 * cos_table.shape[1]):
            return self._fallback.rotate(x, cos_table, sin_table, where, layout=layout, conjugate=conjugate,
                                         inplace=inplace)
        out = x if inplace else torch.empty_like(x)
        if x.numel():
            kern.launch_rotate_qk(x, None, out, None, cos_table, sin_table, where.positions, where.offsets,
                                  where.offset, where.cu_seqlens, where.max_seqlen, seq_dim=where.seq_dim,
                                  layout=layout, conjugate=conjugate, inplace=inplace)
        return out

    def rotate_qk(self, q, k, cos_table, sin_table, where, *, layout, conjugate, inplace):
        """See :class:`ropekit.ops.Backend`."""
        if not _use_kernel(q, 2 * cos_table.shape[1]):
            return self._fallback.rotate_qk(q, k, cos_table, sin_table, where, layout=layout, conjugate=conjugate,
                                            inplace=inplace)
        q_out, k_out = (q, k) if inplace else (torch.empty_like(q), torch.empty_like(k))
        if q.numel() + k.numel():
            kern.launch_rotate_qk(q, k, q_out, k_out, cos_table, sin_table, where.positions, where.offsets,
                                  where.offset, where.cu_seqlens, where.max_seqlen, seq_dim=where.seq_dim,
                                  layout=layout, conjugate=conjugate, inplace=inplace)
        return q_out, k_out

    # -- the fused forms -----------------------------------------------------------------------------------
    @staticmethod
    def _gains(weight, weight_offset):
        """float32 ``weight_offset + weight`` (contiguous), or None."""
        if weight is None:
            return None
        gains = weight.to(torch.float32)
        return (gains + weight_offset if weight_offset != 0.0 else gains).contiguous()

    def rms_norm_rotary(self, x, weight, cos, sin, *, eps, weight_offset, per_token, layout, inplace):
        """See :class:`ropekit.ops.Backend`."""
        if _use_kernel(x, 2 * cos.shape[-1]):
            cos, sin = full_rank(x, cos, sin)
            out = x if inplace else torch.empty_like(x)
            if fused.launch_norm_rotate(x, out, cos, sin, self._gains(weight, weight_offset), eps=eps,
                                        per_token=per_token, layout=layout):
                return out
        return super().rms_norm_rotary(x, weight, cos, sin, eps=eps, weight_offset=weight_offset,
                                       per_token=per_token, layout=layout, inplace=inplace)

    def rms_norm_rotary_backward(self, grad, x, weight, cos, sin, *, eps, weight_offset, per_token,
                                 layout):
        """See :class:`ropekit.ops.Backend`."""
        if _use_kernel(x, 2 * cos.shape[-1]) and grad.dtype == x.dtype:
            cos, sin = full_rank(x, cos, sin)
            grad_x = torch.empty_like(x)
            grad_w = fused.launch_backward(grad, x, grad_x, cos, sin, self._gains(weight, weight_offset), eps=eps,
                                           per_token=per_token, layout=layout)
            if grad_w is not False:
                return grad_x, (None if weight is None else grad_w.view(weight.shape).to(weight.dtype))
        return super().rms_norm_rotary_backward(grad, x, weight, cos, sin, eps=eps, weight_offset=weight_offset,
                                                per_token=per_token, layout=layout)

    def rotate_into_cache(self, k, v, cos, sin, k_cache, v_cache, slots, start, *, k_weight, eps, weight_offset,
                          per_token, block_size, layout, k_scale=None, v_scale=None):
        """See :class:`ropekit.ops.Backend`; FP8 caches are written by the same kernels through their scales."""
        scales = {} if k_scale is None and v_scale is None else dict(k_scale=k_scale, v_scale=v_scale)
        if _use_kernel(k, 2 * cos.shape[-1]) and v.dtype in KERNEL_DTYPES:
            fused_eager.check_slots(k, k_cache, slots, start, block_size)  # reads the slots back (one sync)
            slots = None if slots is None else slots.contiguous()
            if fused.launch_cache(k, v, cos, sin, k_cache, v_cache, slots, start, self._gains(k_weight, weight_offset),
                                  eps=eps, per_token=per_token, block_size=block_size, layout=layout, **scales):
                return None
        return super().rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slots, start, k_weight=k_weight, eps=eps,
                                         weight_offset=weight_offset, per_token=per_token, block_size=block_size,
                                         layout=layout, **scales)
