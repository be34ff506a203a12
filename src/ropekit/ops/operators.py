"""The rotation forms as ``torch.library`` operators: schema, fake kernel and autograd, declared once.

Operators (``torch.ops.ropekit.<name>``, named like the public function of the same form and the
:class:`~ropekit.ops.Backend` method that runs it; a trailing underscore rotates its inputs in place)::

    apply_rotary(Tensor x, Tensor cos, Tensor sin, str layout, bool conjugate, str backend) -> Tensor
    apply_rotary_(Tensor(a!) x, Tensor cos, Tensor sin, str layout, bool conjugate, str backend) -> ()
    apply_rotary_qk(Tensor q, Tensor k, Tensor cos, Tensor sin, str layout, bool conjugate, str backend)
        -> (Tensor, Tensor)
    apply_rotary_qk_(Tensor(a!) q, Tensor(b!) k, ...same...) -> ()
    rotate(Tensor x, Tensor cos_table, Tensor sin_table, Tensor? positions, Tensor? offsets,
        int offset, Tensor? cu_seqlens, int? max_seqlen, int seq_dim, str layout, bool conjugate,
        str backend) -> Tensor
    rotate_(Tensor(a!) x, ...same...) -> ()
    rotate_qk(Tensor q, Tensor k, ...as rotate...) -> (Tensor, Tensor)
    rotate_qk_(Tensor(a!) q, Tensor(b!) k, ...) -> ()

``apply_rotary*`` take tables already broadcast against x (cos/sin gathered per token);
``rotate*`` take the full tables and look each token's row up by position.

``backend`` is a registered name (:mod:`.dispatch`; ``"auto"`` is resolved before the call), so
one set of operators serves every backend, third-party ones included. Each operator's kernel
calls that backend's form; its fake kernel returns ``empty_like`` outputs; the out-of-place
ones have autograd: the gradient is the same operator rotating by ``-theta`` (nothing of the
inputs' size is saved, only the tables and position tensors), itself differentiable.

The functions below are what :mod:`ropekit.functional` calls once it has validated everything
(``conjugate=True``: the public ``inverse=True``, rotation by ``-theta``):
under autograd (an input requires grad) or ``torch.compile`` they go through the operators; a
plain call with nothing to record or trace calls the backend directly, which leaves a decode
step nothing but the kernel. In place with autograd is the out-of-place operator followed by
``copy_`` (autograd tracks the copy).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import dispatch
from .positions import Positions, check_values


def direct(*tensors: Tensor) -> bool:
    """Nothing for the operators to do: plain tensors, no gradient to record, no graph to trace."""
    if torch.compiler.is_compiling():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if type(t) is not Tensor or (grad and t.requires_grad):
            return False
    return True


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# -- broadcast tables --------------------------------------------------------------------------
@torch.library.custom_op("ropekit::apply_rotary", mutates_args=())
def _apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, layout: str, conjugate: bool, backend: str) -> Tensor:
    return dispatch.get(backend).apply_rotary(x, cos, sin, layout=layout, conjugate=conjugate, inplace=False)


@torch.library.custom_op("ropekit::apply_rotary_", mutates_args=("x",))
def _apply_rotary_(x: Tensor, cos: Tensor, sin: Tensor, layout: str, conjugate: bool, backend: str) -> None:
    dispatch.get(backend).apply_rotary(x, cos, sin, layout=layout, conjugate=conjugate, inplace=True)


@torch.library.custom_op("ropekit::apply_rotary_qk", mutates_args=())
def _apply_rotary_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, layout: str, conjugate: bool,
                     backend: str) -> tuple[Tensor, Tensor]:
    return dispatch.get(backend).apply_rotary_qk(q, k, cos, sin, layout=layout, conjugate=conjugate, inplace=False)


@torch.library.custom_op("ropekit::apply_rotary_qk_", mutates_args=("q", "k"))
def _apply_rotary_qk_(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, layout: str, conjugate: bool,
                      backend: str) -> None:
    dispatch.get(backend).apply_rotary_qk(q, k, cos, sin, layout=layout, conjugate=conjugate, inplace=True)


# -- tables looked up by position --------------------------------------------------------------
def _where(x, cos_table, positions, offsets, offset, cu_seqlens, max_seqlen, seq_dim) -> Positions:
    return check_values(x, cos_table.shape[0], Positions(positions, offsets, offset, cu_seqlens, max_seqlen, seq_dim))


@torch.library.custom_op("ropekit::rotate", mutates_args=())
def _rotate(
    x: Tensor, cos_table: Tensor, sin_table: Tensor, positions: Tensor | None, offsets: Tensor | None, offset: int,
    cu_seqlens: Tensor | None, max_seqlen: int | None, seq_dim: int, layout: str, conjugate: bool, backend: str,
) -> Tensor:
    where = _where(x, cos_table, positions, offsets, offset, cu_seqlens, max_seqlen, seq_dim)
    return dispatch.get(backend).rotate(x, cos_table, sin_table, where, layout=layout, conjugate=conjugate,
                                        inplace=False)


@torch.library.custom_op("ropekit::rotate_", mutates_args=("x",))
def _rotate_(
    x: Tensor, cos_table: Tensor, sin_table: Tensor, positions: Tensor | None, offsets: Tensor | None, offset: int,
    cu_seqlens: Tensor | None, max_seqlen: int | None, seq_dim: int, layout: str, conjugate: bool, backend: str,
) -> None:
    where = _where(x, cos_table, positions, offsets, offset, cu_seqlens, max_seqlen, seq_dim)
    dispatch.get(backend).rotate(x, cos_table, sin_table, where, layout=layout, conjugate=conjugate, inplace=True)


@torch.library.custom_op("ropekit::rotate_qk", mutates_args=())
def _rotate_qk(
    q: Tensor, k: Tensor, cos_table: Tensor, sin_table: Tensor, positions: Tensor | None, offsets: Tensor | None,
    offset: int, cu_seqlens: Tensor | None, max_seqlen: int | None, seq_dim: int, layout: str, conjugate: bool,
    backend: str,
) -> tuple[Tensor, Tensor]:
    where = _where(q, cos_table, positions, offsets, offset, cu_seqlens, max_seqlen, seq_dim)
    return dispatch.get(backend).rotate_qk(q, k, cos_table, sin_table, where, layout=layout, conjugate=conjugate,
                                           inplace=False)


@torch.library.custom_op("ropekit::rotate_qk_", mutates_args=("q", "k"))
def _rotate_qk_(
    q: Tensor, k: Tensor, cos_table: Tensor, sin_table: Tensor, positions: Tensor | None, offsets: Tensor | None,
    offset: int, cu_seqlens: Tensor | None, max_seqlen: int | None, seq_dim: int, layout: str, conjugate: bool,
    backend: str,
) -> None:
    where = _where(q, cos_table, positions, offsets, offset, cu_seqlens, max_seqlen, seq_dim)
    dispatch.get(backend).rotate_qk(q, k, cos_table, sin_table, where, layout=layout, conjugate=conjugate,
                                    inplace=True)


# -- fake kernels and autograd -------------------------------------------------------------------
def _fake_one(x, *args):
    return torch.empty_like(x)


def _fake_two(q, k, *args):
    return torch.empty_like(q), torch.empty_like(k)


def _fake_none(*args):
    return None


for _op, _fake in ((_apply_rotary, _fake_one), (_rotate, _fake_one), (_apply_rotary_qk, _fake_two),
                   (_rotate_qk, _fake_two), (_apply_rotary_, _fake_none), (_apply_rotary_qk_, _fake_none),
                   (_rotate_, _fake_none), (_rotate_qk_, _fake_none)):
    _op.register_fake(_fake)


_SAVED = object()  # marks an argument kept with save_for_backward


def _setup(ctx, inputs, output):
    """Save what the backward rotation needs: every input but the rotated tensors (1 or 2)."""
    rotated = 2 if ctx.pair else 1
    rest = inputs[rotated:]
    tensors = [t for t in rest if isinstance(t, Tensor)]
    ctx.save_for_backward(*tensors)
    ctx.template = [_SAVED if isinstance(t, Tensor) else t for t in rest]


def _backward(op, pair: bool):
    def backward(ctx, *grads):
        saved = iter(ctx.saved_tensors)
        rest = [next(saved) if t is _SAVED else t for t in ctx.template]
        rest[-2] = not rest[-2]  # conjugate: rotate the gradient by -theta
        out = op(*grads, *rest)
        return (*(out if pair else (out,)), *([None] * len(rest)))

    return backward


for _op, _pair in ((_apply_rotary, False), (_apply_rotary_qk, True), (_rotate, False), (_rotate_qk, True)):
    def _setup_for(ctx, inputs, output, pair=_pair):
        ctx.pair = pair
        _setup(ctx, inputs, output)

    _op.register_autograd(_backward(_op, _pair), setup_context=_setup_for)


# -- what ropekit.functional calls -------------------------------------------------------------
def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, *, layout: str, backend: str, inplace: bool,
                 conjugate: bool = False) -> Tensor:
    """Rotate ``x`` with tables of ``x.dim()`` dims on ``backend`` (a resolved name); by ``-theta`` if ``conjugate``."""
    if direct(x, cos, sin):
        return dispatch.get(backend).apply_rotary(x, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)
    if not inplace:
        return torch.ops.ropekit.apply_rotary(x, cos, sin, layout, conjugate, backend)
    if _needs_grad(x):
        return x.copy_(torch.ops.ropekit.apply_rotary(x, cos, sin, layout, conjugate, backend))
    torch.ops.ropekit.apply_rotary_(x, cos, sin, layout, conjugate, backend)
    return x


def apply_rotary_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, layout: str, backend: str,
                    inplace: bool, conjugate: bool = False) -> tuple[Tensor, Tensor]:
    """Rotate q and k (one rank) with tables of that rank fitting both."""
    if direct(q, k, cos, sin):
        return dispatch.get(backend).apply_rotary_qk(q, k, cos, sin, layout=layout, conjugate=conjugate,
                                                     inplace=inplace)
    if not inplace:
        return torch.ops.ropekit.apply_rotary_qk(q, k, cos, sin, layout, conjugate, backend)
    if _needs_grad(q, k):
        q_out, k_out = torch.ops.ropekit.apply_rotary_qk(q, k, cos, sin, layout, conjugate, backend)
        return q.copy_(q_out), k.copy_(k_out)
    torch.ops.ropekit.apply_rotary_qk_(q, k, cos, sin, layout, conjugate, backend)
    return q, k


def _position_args(where: Positions) -> tuple:
    return (where.positions, where.offsets, where.offset, where.cu_seqlens, where.max_seqlen, where.seq_dim)


def rotate(x: Tensor, cos_table: Tensor, sin_table: Tensor, where: Positions, *, layout: str, backend: str,
           inplace: bool, conjugate: bool = False) -> Tensor:
    """Rotate ``x`` by the rows of the full tables that ``where`` names (by ``-theta`` if ``conjugate``)."""
    if direct(x, cos_table, sin_table):
        where = check_values(x, cos_table.shape[0], where)
        return dispatch.get(backend).rotate(x, cos_table, sin_table, where, layout=layout, conjugate=conjugate,
                                            inplace=inplace)
    args = (cos_table, sin_table, *_position_args(where), layout, conjugate, backend)
    if not inplace:
        return torch.ops.ropekit.rotate(x, *args)
    if _needs_grad(x):
        return x.copy_(torch.ops.ropekit.rotate(x, *args))
    torch.ops.ropekit.rotate_(x, *args)
    return x


def rotate_qk(q: Tensor, k: Tensor, cos_table: Tensor, sin_table: Tensor, where: Positions, *, layout: str,
              backend: str, inplace: bool, conjugate: bool = False) -> tuple[Tensor, Tensor]:
    """:func:`rotate` for q and k."""
    if direct(q, k, cos_table, sin_table):
        where = check_values(q, cos_table.shape[0], where)
        return dispatch.get(backend).rotate_qk(q, k, cos_table, sin_table, where, layout=layout, conjugate=conjugate,
                                               inplace=inplace)
    args = (cos_table, sin_table, *_position_args(where), layout, conjugate, backend)
    if not inplace:
        return torch.ops.ropekit.rotate_qk(q, k, *args)
    if _needs_grad(q, k):
        q_out, k_out = torch.ops.ropekit.rotate_qk(q, k, *args)
        return q.copy_(q_out), k.copy_(k_out)
    torch.ops.ropekit.rotate_qk_(q, k, *args)
    return q, k
