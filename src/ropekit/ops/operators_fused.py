"""The fused forms as ``torch.library`` operators: schema, fake kernel and autograd, declared once.

Operators (``torch.ops.ropekit.<name>``; a trailing underscore works in place)::

    rms_norm_rotary(Tensor x, Tensor? weight, Tensor cos, Tensor sin, float eps, float weight_offset,
        bool per_token, str layout, str backend) -> Tensor
    rms_norm_rotary_(Tensor(a!) x, ...same...) -> ()
    rms_norm_rotary_qk(Tensor q, Tensor k, Tensor? q_weight, Tensor? k_weight, Tensor cos, Tensor sin,
        float eps, float weight_offset, bool per_token, str layout, str backend) -> (Tensor, Tensor)
    rms_norm_rotary_qk_(Tensor(a!) q, Tensor(b!) k, ...same...) -> ()
    rms_norm_rotary_backward(Tensor grad, Tensor x, Tensor? weight, Tensor cos, Tensor sin, float eps,
        float weight_offset, bool per_token, str layout, str backend) -> (Tensor grad_x, Tensor grad_weight)
    rotate_into_cache(Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache,
        Tensor? slots, int start, Tensor? k_weight, float? eps, float weight_offset, bool per_token,
        int block_size, str layout, str backend, Tensor? k_scale=None, Tensor? v_scale=None) -> ()

Each kernel is the named backend's method of the same name (:class:`ropekit.ops.Backend`; its
defaults compose torch ops, so every registered backend has every form). The out-of-place
norm + rotation operators are differentiable: the backward recomputes the norm from the saved
input (nothing else of its size is kept) and returns the gradients of the input and of the
weight; ``rms_norm_rotary_backward``'s ``grad_weight`` is an empty tensor when there is no
weight. The in-place forms and the cache write have no autograd (``ropekit.fused`` refuses them
for inputs that require grad). As for the rotations (:mod:`.operators`), a plain call with
nothing to record or trace goes straight to the backend.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import dispatch
from .operators import direct


def _norm_options(eps, weight_offset, per_token, layout):
    return dict(eps=eps, weight_offset=weight_offset, per_token=per_token, layout=layout)


@torch.library.custom_op("ropekit::rms_norm_rotary", mutates_args=())
def _rms_norm_rotary(x: Tensor, weight: Tensor | None, cos: Tensor, sin: Tensor, eps: float, weight_offset: float,
                     per_token: bool, layout: str, backend: str) -> Tensor:
    return dispatch.get(backend).rms_norm_rotary(x, weight, cos, sin, inplace=False,
                                                 **_norm_options(eps, weight_offset, per_token, layout))


@torch.library.custom_op("ropekit::rms_norm_rotary_", mutates_args=("x",))
def _rms_norm_rotary_(x: Tensor, weight: Tensor | None, cos: Tensor, sin: Tensor, eps: float, weight_offset: float,
                      per_token: bool, layout: str, backend: str) -> None:
    dispatch.get(backend).rms_norm_rotary(x, weight, cos, sin, inplace=True,
                                          **_norm_options(eps, weight_offset, per_token, layout))


@torch.library.custom_op("ropekit::rms_norm_rotary_qk", mutates_args=())
def _rms_norm_rotary_qk(q: Tensor, k: Tensor, q_weight: Tensor | None, k_weight: Tensor | None, cos: Tensor,
                        sin: Tensor, eps: float, weight_offset: float, per_token: bool, layout: str,
                        backend: str) -> tuple[Tensor, Tensor]:
    return dispatch.get(backend).rms_norm_rotary_qk(q, k, q_weight, k_weight, cos, sin, inplace=False,
                                                    **_norm_options(eps, weight_offset, per_token, layout))


@torch.library.custom_op("ropekit::rms_norm_rotary_qk_", mutates_args=("q", "k"))
def _rms_norm_rotary_qk_(q: Tensor, k: Tensor, q_weight: Tensor | None, k_weight: Tensor | None, cos: Tensor,
                         sin: Tensor, eps: float, weight_offset: float, per_token: bool, layout: str,
                         backend: str) -> None:
    dispatch.get(backend).rms_norm_rotary_qk(q, k, q_weight, k_weight, cos, sin, inplace=True,
                                             **_norm_options(eps, weight_offset, per_token, layout))


@torch.library.custom_op("ropekit::rms_norm_rotary_backward", mutates_args=())
def _rms_norm_rotary_backward(grad: Tensor, x: Tensor, weight: Tensor | None, cos: Tensor, sin: Tensor, eps: float,
                              weight_offset: float, per_token: bool, layout: str,
                              backend: str) -> tuple[Tensor, Tensor]:
    grad_x, grad_w = dispatch.get(backend).rms_norm_rotary_backward(
        grad, x, weight, cos, sin, **_norm_options(eps, weight_offset, per_token, layout))
    return grad_x, (x.new_empty(0) if grad_w is None else grad_w)


@torch.library.custom_op("ropekit::rotate_into_cache", mutates_args=("k_cache", "v_cache"))
def _rotate_into_cache(k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                       slots: Tensor | None, start: int, k_weight: Tensor | None, eps: float | None,
                       weight_offset: float, per_token: bool, block_size: int, layout: str, backend: str,
                       k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
    dispatch.get(backend).rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slots, start, k_weight=k_weight, eps=eps,
                                            weight_offset=weight_offset, per_token=per_token, block_size=block_size,
                                            layout=layout, **_scales(k_scale, v_scale))


def _scales(k_scale: Tensor | None, v_scale: Tensor | None) -> dict:
    """The FP8 scales as backend keywords: none at all when both are None (an older override takes no scales)."""
    return {} if k_scale is None and v_scale is None else dict(k_scale=k_scale, v_scale=v_scale)


_rms_norm_rotary.register_fake(lambda x, *args: torch.empty_like(x))
_rms_norm_rotary_qk.register_fake(lambda q, k, *args: (torch.empty_like(q), torch.empty_like(k)))
_rms_norm_rotary_backward.register_fake(
    lambda grad, x, weight, *args: (torch.empty_like(x),
                                    x.new_empty(0) if weight is None else torch.empty_like(weight)))
for _op in (_rms_norm_rotary_, _rms_norm_rotary_qk_, _rotate_into_cache):
    _op.register_fake(lambda *args: None)


def _backward_of(grad: Tensor | None, x: Tensor, weight: Tensor | None, cos: Tensor, sin: Tensor, options: tuple):
    """``(grad_x, grad_weight or None)`` through the backward operator."""
    if grad is None:
        grad = torch.zeros_like(x)
    grad_x, grad_w = torch.ops.ropekit.rms_norm_rotary_backward(grad, x, weight, cos, sin, *options)
    return grad_x, (None if weight is None else grad_w)


def _setup_one(ctx, inputs, output):
    x, weight, cos, sin, *options = inputs
    ctx.save_for_backward(x, weight, cos, sin)
    ctx.options = tuple(options)


def _backward_one(ctx, grad):
    x, weight, cos, sin = ctx.saved_tensors
    grad_x, grad_w = _backward_of(grad, x, weight, cos, sin, ctx.options)
    return grad_x, grad_w, None, None, None, None, None, None, None


def _setup_pair(ctx, inputs, output):
    q, k, q_weight, k_weight, cos, sin, *options = inputs
    ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
    ctx.options = tuple(options)


def _backward_pair(ctx, grad_q, grad_k):
    q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
    gq, gqw = _backward_of(grad_q, q, q_weight, cos, sin, ctx.options)
    gk, gkw = _backward_of(grad_k, k, k_weight, cos, sin, ctx.options)
    return gq, gk, gqw, gkw, None, None, None, None, None, None, None


_rms_norm_rotary.register_autograd(_backward_one, setup_context=_setup_one)
_rms_norm_rotary_qk.register_autograd(_backward_pair, setup_context=_setup_pair)


# -- what ropekit.fused calls (arguments validated there) ---------------------------------------------
def direct_with_weights(*tensors: Tensor, weights: tuple = ()) -> bool:
    """Nothing for the operators to do: :func:`.operators.direct` for the tensors, and no gradient to record.

    The weights may also be ``nn.Parameter`` (a module's weight: nothing a kernel must know about).
    """
    if not direct(*tensors):
        return False
    grad = torch.is_grad_enabled()
    return all(w is None or (type(w) in (Tensor, torch.nn.Parameter) and not (grad and w.requires_grad))
               for w in weights)


def rms_norm_rotary(x: Tensor, weight: Tensor | None, cos: Tensor, sin: Tensor, *, eps: float, weight_offset: float,
                    per_token: bool, layout: str, backend: str, inplace: bool) -> Tensor:
    """Normalise and rotate ``x`` on ``backend`` (a resolved name); in place only without autograd."""
    if direct_with_weights(x, cos, sin, weights=(weight,)):
        return dispatch.get(backend).rms_norm_rotary(x, weight, cos, sin, inplace=inplace,
                                                     **_norm_options(eps, weight_offset, per_token, layout))
    args = (cos, sin, eps, weight_offset, per_token, layout, backend)
    if not inplace:
        return torch.ops.ropekit.rms_norm_rotary(x, weight, *args)
    torch.ops.ropekit.rms_norm_rotary_(x, weight, *args)
    return x


def rms_norm_rotary_qk(q: Tensor, k: Tensor, q_weight: Tensor | None, k_weight: Tensor | None, cos: Tensor,
                       sin: Tensor, *, eps: float, weight_offset: float, per_token: bool, layout: str, backend: str,
                       inplace: bool) -> tuple[Tensor, Tensor]:
    """:func:`rms_norm_rotary` of q and k in one call."""
    if direct_with_weights(q, k, cos, sin, weights=(q_weight, k_weight)):
        return dispatch.get(backend).rms_norm_rotary_qk(q, k, q_weight, k_weight, cos, sin, inplace=inplace,
                                                        **_norm_options(eps, weight_offset, per_token, layout))
    args = (cos, sin, eps, weight_offset, per_token, layout, backend)
    if not inplace:
        return torch.ops.ropekit.rms_norm_rotary_qk(q, k, q_weight, k_weight, *args)
    torch.ops.ropekit.rms_norm_rotary_qk_(q, k, q_weight, k_weight, *args)
    return q, k


def rotate_into_cache(k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                      slots: Tensor | None, start: int, *, k_weight: Tensor | None, eps: float | None,
                      weight_offset: float, per_token: bool, block_size: int, layout: str, backend: str,
                      k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
    """Keys rotated (normalised first with ``eps``) and values copied into the cache slots, one pass.

    ``k_scale``/``v_scale``: float32 ``(kv_heads,)`` scales of FP8 caches (None otherwise).
    """
    tensors = (k, v, cos, sin, k_cache, v_cache, *(t for t in (slots, k_scale, v_scale) if t is not None))
    if direct_with_weights(*tensors, weights=(k_weight,)):
        dispatch.get(backend).rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slots, start, k_weight=k_weight,
                                                eps=eps, weight_offset=weight_offset, per_token=per_token,
                                                block_size=block_size, layout=layout, **_scales(k_scale, v_scale))
        return
    torch.ops.ropekit.rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slots, start, k_weight, eps, weight_offset,
                                        per_token, block_size, layout, backend, k_scale, v_scale)
