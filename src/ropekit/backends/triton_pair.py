"""q and k in one Triton launch with broadcast tables: the pair form of :func:`.triton_api.rotate`.

``ropekit::triton_rotary_pair`` (new outputs) and ``ropekit::triton_rotary_pair_`` (mutates q
and k) run :func:`.triton_rotary.launch_rotate_pair` when q and k differ at most along their
heads axis (GQA) and their other axes collapse to two; otherwise, and where the kernel cannot
run (CPU without the interpreter, float64), each tensor goes through the single-tensor op. Both
ops have fake implementations, and the out-of-place one autograd (the gradient is the pair
rotated by ``-theta``), so ``torch.compile(fullgraph=True)`` traces them as one node each.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import triton_api
from . import triton_rotary as kern


def _pair_any(q: Tensor, k: Tensor, q_out: Tensor, k_out: Tensor, cos: Tensor, sin: Tensor, layout: str,
              conjugate: bool, inplace: bool) -> None:
    """Rotate q into q_out and k into k_out: one launch when possible, else one op each."""
    if triton_api._use_kernel(q, 2 * cos.shape[-1]) and q.dtype == k.dtype and kern.launch_rotate_pair(
        q, k, q_out, k_out, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace
    ):
        return
    for x, out in ((q, q_out), (k, k_out)):
        if inplace:
            torch.ops.ropekit.triton_rotary_(x, cos, sin, layout, conjugate)
        else:
            out.copy_(torch.ops.ropekit.triton_rotary(x, cos, sin, layout, conjugate))


@torch.library.custom_op("ropekit::triton_rotary_pair", mutates_args=())
def _pair_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, layout: str, conjugate: bool) -> tuple[Tensor, Tensor]:
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    _pair_any(q, k, q_out, k_out, cos, sin, layout, conjugate, False)
    return q_out, k_out


@torch.library.custom_op("ropekit::triton_rotary_pair_", mutates_args=("q", "k"))
def _pair_op_(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, layout: str, conjugate: bool) -> None:
    _pair_any(q, k, q, k, cos, sin, layout, conjugate, True)


@_pair_op.register_fake
def _(q, k, cos, sin, layout, conjugate):
    return torch.empty_like(q), torch.empty_like(k)


@_pair_op_.register_fake
def _(q, k, cos, sin, layout, conjugate):
    return None


def _pair_setup(ctx, inputs, output):
    _, _, cos, sin, layout, conjugate = inputs
    ctx.save_for_backward(cos, sin)
    ctx.layout, ctx.conjugate = layout, not conjugate


def _pair_backward(ctx, grad_q, grad_k):
    cos, sin = ctx.saved_tensors
    return (*_pair_op(grad_q, grad_k, cos, sin, ctx.layout, ctx.conjugate), None, None, None, None)


_pair_op.register_autograd(_pair_backward, setup_context=_pair_setup)


def rotate_pair(
    q: Tensor, k: Tensor, cos_q: Tensor, sin_q: Tensor, cos_k: Tensor, sin_k: Tensor, *, layout: str,
    conjugate: bool = False, inplace: bool = False,
) -> tuple[Tensor, Tensor]:
    """The pair contract (see :func:`ropekit.backends.pair_of`) on the Triton kernel.

    One launch when ``cos_k``/``sin_k`` are ``cos_q``/``sin_q`` themselves (what
    :func:`ropekit.apply_rotary_qk` passes whenever q and k have one rank) and the shapes allow
    it; otherwise :func:`.triton_api.rotate` on each tensor.
    """
    same_tables = cos_k is cos_q and sin_k is sin_q
    if not same_tables or q.device != k.device or cos_q.device != q.device or sin_q.device != q.device:
        return (triton_api.rotate(q, cos_q, sin_q, layout=layout, conjugate=conjugate, inplace=inplace),
                triton_api.rotate(k, cos_k, sin_k, layout=layout, conjugate=conjugate, inplace=inplace))
    if inplace:
        torch.ops.ropekit.triton_rotary_pair_(q, k, cos_q, sin_q, layout, conjugate)
        return q, k
    return torch.ops.ropekit.triton_rotary_pair(q, k, cos_q, sin_q, layout, conjugate)
