"""``apply_rotary``: validate, pick a backend, rotate (out of place or in place) with autograd."""

from __future__ import annotations

import torch

from . import backends
from ._checks import check_float_tensor, check_layout


def _expand_tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the tables against ``x`` and view them with ``x.dim()`` dimensions.

    This runs on every call (decode steps included), so the common case costs a few
    attribute reads; the messages are only built when something is wrong.
    """
    check_float_tensor(cos, "cos")
    check_float_tensor(sin, "sin")
    table_shape, x_shape = cos.shape, x.shape
    if table_shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got {tuple(table_shape)} and {tuple(sin.shape)}")
    ndim, x_ndim = len(table_shape), len(x_shape)
    if ndim == 0:
        raise ValueError("cos must have at least one dimension (rotary_dim // 2,), got a scalar")
    if ndim > x_ndim:
        raise ValueError(
            f"cos has {ndim} dimensions, more than x ({x_ndim}): tables must broadcast against x; "
            f"got cos {tuple(table_shape)} and x {tuple(x_shape)}"
        )
    if 2 * table_shape[-1] > x_shape[-1]:
        raise ValueError(
            f"x has {x_shape[-1]} channels in its last dimension, fewer than rotary_dim = 2 * cos.shape[-1] = "
            f"{2 * table_shape[-1]}"
        )
    lead = x_ndim - ndim
    for axis in range(ndim - 1):
        t, n = table_shape[axis], x_shape[lead + axis]
        if t != 1 and t != n:
            raise ValueError(
                f"cos/sin of shape {tuple(table_shape)} do not broadcast against x of shape {tuple(x_shape)} "
                f"(axis {lead + axis}: {t} vs {n})"
            )
    if not (cos.is_cpu and x.is_cpu) and cos.device != x.device:
        raise ValueError(f"cos is on {cos.device} but x is on {x.device}")
    if lead:  # adding leading size-1 axes is always a view
        cos = cos.view((1,) * lead + tuple(table_shape))
        sin = sin.view((1,) * lead + tuple(table_shape))
    return cos, sin


class _Rotary(torch.autograd.Function):
    """Rotation with a hand-written backward: the gradient is rotated by ``-theta``.

    Nothing of ``x``'s size is saved for the backward pass, only the tables.
    """

    @staticmethod
    def forward(ctx, x, cos, sin, layout, inplace, rotate):  # noqa: D102
        out = rotate(x, cos, sin, layout=layout, conjugate=False, inplace=inplace)
        ctx.save_for_backward(cos, sin)
        ctx.layout = layout
        ctx.rotate = rotate
        if inplace:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        cos, sin = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True (double backward): the backward is itself a rotation (by -theta),
            # so express it through this Function to keep it differentiable; the raw kernel
            # cannot write a grad-requiring result into its preallocated output.
            grad_x = _Rotary.apply(grad, cos, -sin, ctx.layout, False, ctx.rotate)
        else:
            grad_x = ctx.rotate(grad, cos, sin, layout=ctx.layout, conjugate=True, inplace=False)
        return grad_x, None, None, None, None, None


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    layout: str = "half",
    inplace: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    r"""Rotate the first ``rotary_dim`` channels of ``x`` by the angles behind ``cos``/``sin``.

    For each rotary pair ``(x1, x2)``:
    :math:`y_1 = x_1 \cos\theta - x_2 \sin\theta,\; y_2 = x_2 \cos\theta + x_1 \sin\theta`
    (RoFormer eq. 34), i.e. ``y = R(theta) x`` without building ``R``.

    Args:
        x: query or key of shape ``(..., head_dim)``, any float dtype
            (e.g. ``(batch, heads, seq, head_dim)`` or ``(tokens, heads, head_dim)``).
        cos, sin: half-width tables of shape broadcastable to
            ``x.shape[:-1] + (rotary_dim // 2,)`` (from :func:`ropekit.cos_sin`), e.g.
            ``(seq, rotary_dim // 2)`` against ``(batch, heads, seq, head_dim)``.
            ``rotary_dim = 2 * cos.shape[-1]`` must not exceed ``head_dim``; the
            channels past it are left untouched (partial rotary).
        layout: ``"half"`` pairs channels ``(i, i + rotary_dim/2)`` (GPT-NeoX, HF);
            ``"interleaved"`` pairs ``(2i, 2i+1)`` (RoFormer, Meta, GPT-J).
        inplace: rotate ``x`` itself and return it; allocates nothing of ``x``'s size.
        backend: ``"auto"`` or a name from :func:`ropekit.backends.available`.

    Returns:
        Tensor of ``x``'s shape and dtype (``x`` itself when ``inplace``). Arithmetic is
        float32 (float64 for float64 inputs), rounded once to ``x.dtype``.

    Autograd: gradients flow to ``x`` through the rotation by ``-theta`` (no saved
    activations). When ``cos``/``sin`` require grad (learned frequencies) a composite
    path is used that also differentiates the tables.
    """
    check_float_tensor(x, "x")
    check_layout(layout)
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {type(inplace).__name__}")
    cos, sin = _expand_tables(x, cos, sin)
    rotate = backends.select(backend, x)
    tables_need_grad = torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)
    if tables_need_grad:
        from .backends.torch_eager import rotate_differentiable

        if not inplace:
            return rotate_differentiable(x, cos, sin, layout=layout)
        rotated = rotate_differentiable(x.clone(), cos, sin, layout=layout)
        return x.copy_(rotated)
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rotary.apply(x, cos, sin, layout, inplace, rotate)
    return rotate(x, cos, sin, layout=layout, conjugate=False, inplace=inplace)
