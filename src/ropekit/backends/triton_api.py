"""The Triton backend's entry points: ``rotate``, ``rotate_qk`` and their ``torch.library`` ops.

* :func:`rotate` is the backend contract of :mod:`ropekit.backends` (tables already
  expanded to ``x``'s rank, possibly broadcast with stride 0).
* :func:`rotate_qk` rotates q and k in one launch from the full ``(max_positions,
  rotary_dim/2)`` tables, gathering each token's row inside the kernel.

Both go through custom ops (``ropekit::triton_rotary[_]``, ``ropekit::triton_rotary_qk[_]``;
the trailing underscore mutates its inputs) with fake implementations and autograd
(the gradient is the same kernel rotating by ``-theta``), so ``torch.compile(fullgraph=True)``
traces each as one node. The ops run the Triton kernel on CUDA tensors, or on any device
under ``TRITON_INTERPRET=1``; otherwise, and for float64, they gather the table rows and run
the native CPU kernel (:mod:`ropekit.backends.cpu_native`) on CPU tensors, else the eager
torch kernel (:mod:`ropekit.backends.torch_eager`): all compute the same thing.

Shape checks happen in the Python wrappers (traceable); checks that need the values
(positions inside the tables, ``cu_seqlens`` consistent) happen inside the op, before launch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..validation import check_float_tensor, check_layout
from . import cpu_native, pair_of, torch_eager
from . import triton_rotary as kern

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _use_kernel(x: Tensor, rotary_dim: int) -> bool:
    return kern.can_launch(x) and x.dtype in KERNEL_DTYPES and rotary_dim > 0


# -- rotate: the backend contract ----------------------------------------------------------------
@torch.library.custom_op("ropekit::triton_rotary", mutates_args=())
def _rotary_op(x: Tensor, cos: Tensor, sin: Tensor, layout: str, conjugate: bool) -> Tensor:
    if not _use_kernel(x, 2 * cos.shape[-1]):
        return torch_eager.rotate(x, cos, sin, layout=layout, conjugate=conjugate, inplace=False)
    out = torch.empty_like(x)
    if x.numel():
        kern.launch_rotate(x, out, cos, sin, layout=layout, conjugate=conjugate, inplace=False)
    return out


@torch.library.custom_op("ropekit::triton_rotary_", mutates_args=("x",))
def _rotary_op_(x: Tensor, cos: Tensor, sin: Tensor, layout: str, conjugate: bool) -> None:
    if not _use_kernel(x, 2 * cos.shape[-1]):
        torch_eager.rotate(x, cos, sin, layout=layout, conjugate=conjugate, inplace=True)
    elif x.numel():
        kern.launch_rotate(x, x, cos, sin, layout=layout, conjugate=conjugate, inplace=True)


@_rotary_op.register_fake
def _(x, cos, sin, layout, conjugate):
    return torch.empty_like(x)


@_rotary_op_.register_fake
def _(x, cos, sin, layout, conjugate):
    return None


def _rotary_setup(ctx, inputs, output):
    _, cos, sin, layout, conjugate = inputs
    ctx.save_for_backward(cos, sin)
    ctx.layout, ctx.conjugate = layout, not conjugate


def _rotary_backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    return _rotary_op(grad, cos, sin, ctx.layout, ctx.conjugate), None, None, None, None


_rotary_op.register_autograd(_rotary_backward, setup_context=_rotary_setup)


def rotate(
    x: Tensor, cos: Tensor, sin: Tensor, *, layout: str, conjugate: bool = False, inplace: bool = False
) -> Tensor:
    """The backend contract (see :func:`ropekit.backends.torch_eager.rotate`) on the Triton kernel.

    Args:
        x: ``(..., head_dim)``, float32/float16/bfloat16 (float64 runs the eager kernel).
        cos, sin: float32 tables with ``x.dim()`` dimensions, broadcastable to
            ``x.shape[:-1] + (rotary_dim // 2,)``; stride-0 broadcast views are read in place.
        layout: ``"half"`` or ``"interleaved"``.
        conjugate: rotate by ``-theta``.
        inplace: write into ``x`` and return it; otherwise return a new tensor.

    Gradients reach ``x`` (not the tables; :func:`ropekit.apply_rotary` handles learned tables).
    """
    check_layout(layout)
    if cos.dim() != x.dim() or sin.shape != cos.shape:
        raise ValueError(
            f"cos and sin must have one shape with x.dim() = {x.dim()} dimensions, got {tuple(cos.shape)} "
            f"and {tuple(sin.shape)}"
        )
    if cos.device != x.device or sin.device != x.device:
        raise ValueError(f"cos/sin are on {cos.device}/{sin.device} but x is on {x.device}")
    if inplace:
        torch.ops.ropekit.triton_rotary_(x, cos, sin, layout, conjugate)
        return x
    return torch.ops.ropekit.triton_rotary(x, cos, sin, layout, conjugate)


# -- rotate_qk: checks ------------------------------------------------------------------------------
def _check_index_tensor(t: Tensor, name: str, device: torch.device) -> None:
    if not isinstance(t, Tensor) or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def _check_qk(q, k, cos, sin, positions, offsets, cu_seqlens, max_seqlen, seq_dim, layout):
    """Every check that needs only shapes and dtypes; returns ``(offset, offsets_tensor)``."""
    check_float_tensor(q, "q")
    check_float_tensor(k, "k")
    check_float_tensor(cos, "cos_table")
    check_float_tensor(sin, "sin_table")
    check_layout(layout)
    if q.dtype != k.dtype:
        raise TypeError(f"q and k must have one dtype, got {q.dtype} and {k.dtype}")
    for name, t in (("k", k), ("cos_table", cos), ("sin_table", sin)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if q.dim() != k.dim() or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same rank and head_dim, got {tuple(q.shape)} and {tuple(k.shape)}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] == 0:
        raise ValueError(
            "cos_table and sin_table must both have shape (max_positions, rotary_dim // 2) with rotary_dim > 0, "
            f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if 2 * cos.shape[1] > q.shape[-1]:
        raise ValueError(f"rotary_dim = 2 * {cos.shape[1]} exceeds head_dim = {q.shape[-1]}")
    batch_axis, seq_axis, _ = kern.qk_axes(q.dim(), seq_dim)
    for axis in (batch_axis, seq_axis):
        if axis is not None and q.shape[axis] != k.shape[axis]:
            raise ValueError(f"q and k differ along axis {axis}: {tuple(q.shape)} vs {tuple(k.shape)}")
    tokens = q.shape[seq_axis]
    if cu_seqlens is not None:
        _check_index_tensor(cu_seqlens, "cu_seqlens", q.device)
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0:
            raise ValueError(f"cu_seqlens must have shape (batch + 1,), got {tuple(cu_seqlens.shape)}")
        if seq_axis != 0 or q.dim() > 3:
            raise ValueError(f"cu_seqlens needs packed (tokens, heads, head_dim) q/k with seq_dim=0, got "
                             f"{tuple(q.shape)} with seq_dim={seq_dim}")
        if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int)):
            raise TypeError(f"max_seqlen must be an int or None, got {max_seqlen!r}")
        n_seq = cu_seqlens.numel() - 1
    else:
        if max_seqlen is not None:
            raise ValueError("max_seqlen goes with cu_seqlens; without it the sequence length is q's")
        n_seq = 1 if batch_axis is None else q.shape[batch_axis]
    if positions is not None:
        _check_index_tensor(positions, "positions", q.device)
        shapes = [(tokens,)] if cu_seqlens is not None else [(tokens,), (1, tokens), (n_seq, tokens)]
        if tuple(positions.shape) not in shapes:
            raise ValueError(f"positions must have shape {' or '.join(map(str, set(shapes)))}, "
                             f"got {tuple(positions.shape)}")
        if not (isinstance(offsets, int) and offsets == 0):
            raise ValueError("pass either positions or offsets, not both (offsets shift the default arange)")
    if isinstance(offsets, Tensor):
        _check_index_tensor(offsets, "offsets", q.device)
        if offsets.dim() > 1 or offsets.numel() not in (1, n_seq):
            raise ValueError(f"offsets must be an int or a ({n_seq},) tensor, got shape {tuple(offsets.shape)}")
        return 0, offsets.reshape(-1)
    if isinstance(offsets, bool) or not isinstance(offsets, int):
        raise TypeError(f"offsets must be an int or an integer (batch,) tensor, got {type(offsets).__name__}")
    if offsets < 0:
        raise ValueError(f"offsets must be >= 0 (positions index the tables), got {offsets}")
    if positions is None and cu_seqlens is None and tokens > 0 and offsets + tokens > cos.shape[0]:
        raise ValueError(f"positions (offsets + index) reach {offsets + tokens - 1}, outside the cos/sin tables "
                         f"of {cos.shape[0]} rows")
    return offsets, None


def _check_values(q, cos, positions, offsets, offset, cu_seqlens, max_seqlen, seq_dim) -> int | None:
    """Checks that read the tensors (one device sync); returns the longest packed sequence."""
    rows = cos.shape[0]
    stats: dict[str, Tensor] = {}
    lengths = None
    if cu_seqlens is not None:
        cu = cu_seqlens.long()
        lengths = cu[1:] - cu[:-1]
        stats["first"], stats["last"] = cu[0], cu[-1]
        if lengths.numel():
            stats["shortest"], stats["longest"] = lengths.min(), lengths.max()
    if positions is not None:
        if positions.numel():
            stats["lo"], stats["hi"] = positions.min(), positions.max()
    elif offsets is not None or lengths is not None:
        shift = torch.zeros(1, dtype=torch.long, device=q.device) if offsets is None else offsets.long()
        if lengths is None:
            tokens = q.shape[kern.qk_axes(q.dim(), seq_dim)[1]]
            last = offset + shift + tokens - 1 if tokens else shift[:0]
        else:
            shift = shift.expand(lengths.numel())
            last = (offset + shift + lengths - 1)[lengths > 0]
        if last.numel():
            stats["lo"], stats["hi"] = offset + shift.min(), last.max()
    values = torch.stack([t.long().cpu() for t in stats.values()]).tolist() if stats else []
    got = dict(zip(stats, values, strict=True))
    if cu_seqlens is not None:
        if got["first"] != 0 or got["last"] != q.shape[0] or got.get("shortest", 0) < 0:
            raise ValueError(f"cu_seqlens must start at 0, never decrease and end at the {q.shape[0]} tokens of "
                             f"q/k, got {cu_seqlens.tolist() if cu_seqlens.numel() <= 16 else cu_seqlens}")
        if max_seqlen is not None and got.get("longest", 0) > max_seqlen:
            raise ValueError(f"max_seqlen={max_seqlen} is shorter than the longest sequence ({got['longest']})")
    if "lo" in got and got["lo"] < 0 or "hi" in got and got["hi"] >= rows:
        source = "positions" if positions is not None else "positions (offsets + index within the sequence)"
        raise ValueError(f"{source} must lie in [0, {rows}) of the cos/sin tables, got {got.get('lo')} to "
                         f"{got.get('hi')}")
    return got.get("longest", 0) if cu_seqlens is not None else None


# -- rotate_qk: eager fallback, ops, wrapper ----------------------------------------------------------
def _eager_positions(x, positions, offsets, offset, cu_seqlens, seq_dim) -> Tensor:
    """Each token's table row, shaped to broadcast against ``x.shape[:-1]``."""
    batch_axis, seq_axis, _ = kern.qk_axes(x.dim(), seq_dim)
    shape = [1] * (x.dim() - 1)
    shape[seq_axis] = tokens = x.shape[seq_axis]
    steps = torch.arange(tokens, device=x.device)
    if positions is not None:
        pos = positions.long()
    elif cu_seqlens is not None:
        cu = cu_seqlens.long()
        seq_id = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=x.device), cu[1:] - cu[:-1])
        pos = steps - cu[seq_id] + offset
        if offsets is not None:
            pos = pos + offsets.long().expand(cu.numel() - 1)[seq_id]
    else:
        pos = steps + offset if offsets is None else offsets.long().reshape(-1, 1) + steps + offset
    if pos.dim() == 2 and batch_axis is not None:
        shape[batch_axis] = pos.shape[0]
    return pos.reshape(shape)


def _rotate_qk_any(q, k, cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen, seq_dim, layout,
                   conjugate, inplace):
    """Check the values, then run the kernel (or the eager fallback); returns ``(q_out, k_out)``."""
    longest = _check_values(q, cos, positions, offsets, offset, cu_seqlens, max_seqlen, seq_dim)
    if not _use_kernel(q, 2 * cos.shape[1]):  # gather the rows, then the best kernel for the device
        pos = _eager_positions(q, positions, offsets, offset, cu_seqlens, seq_dim)
        c, s = cos[pos], sin[pos]
        rotate = cpu_native.rotate if q.is_cpu and cpu_native.is_available() else torch_eager.rotate
        return pair_of(rotate)(q, k, c, s, c, s, layout=layout, conjugate=conjugate, inplace=inplace)
    q_out, k_out = (q, k) if inplace else (torch.empty_like(q), torch.empty_like(k))
    if q.numel() + k.numel():
        kern.launch_rotate_qk(q, k, q_out, k_out, cos, sin, positions, offsets, offset, cu_seqlens,
                              max_seqlen if longest is None or max_seqlen is not None else longest,
                              seq_dim=seq_dim, layout=layout, conjugate=conjugate, inplace=inplace)
    return q_out, k_out


@torch.library.custom_op("ropekit::triton_rotary_qk", mutates_args=())
def _rotary_qk_op(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None, offsets: Tensor | None,
    offset: int, cu_seqlens: Tensor | None, max_seqlen: int | None, seq_dim: int, layout: str, conjugate: bool,
) -> tuple[Tensor, Tensor]:
    return _rotate_qk_any(q, k, cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen, seq_dim, layout,
                          conjugate, False)


@torch.library.custom_op("ropekit::triton_rotary_qk_", mutates_args=("q", "k"))
def _rotary_qk_op_(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None, offsets: Tensor | None,
    offset: int, cu_seqlens: Tensor | None, max_seqlen: int | None, seq_dim: int, layout: str, conjugate: bool,
) -> None:
    _rotate_qk_any(q, k, cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen, seq_dim, layout,
                   conjugate, True)


@_rotary_qk_op.register_fake
def _(q, k, *args):
    return torch.empty_like(q), torch.empty_like(k)


@_rotary_qk_op_.register_fake
def _(q, k, *args):
    return None


def _rotary_qk_setup(ctx, inputs, output):
    cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen, seq_dim, layout, conjugate = inputs[2:]
    ctx.save_for_backward(cos, sin, positions, offsets, cu_seqlens)
    ctx.options = (offset, max_seqlen, seq_dim, layout, not conjugate)


def _rotary_qk_backward(ctx, grad_q, grad_k):
    cos, sin, positions, offsets, cu_seqlens = ctx.saved_tensors
    offset, max_seqlen, seq_dim, layout, conjugate = ctx.options
    grads = _rotary_qk_op(grad_q, grad_k, cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen,
                          seq_dim, layout, conjugate)
    return (*grads,) + (None,) * 10


_rotary_qk_op.register_autograd(_rotary_qk_backward, setup_context=_rotary_qk_setup)


def rotate_qk(
    q: Tensor,
    k: Tensor,
    cos_table: Tensor,
    sin_table: Tensor,
    *,
    positions: Tensor | None = None,
    offsets: int | Tensor = 0,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    seq_dim: int,
    layout: str,
    conjugate: bool = False,
    inplace: bool = False,
) -> tuple[Tensor, Tensor]:
    r"""Rotate queries and keys in one kernel launch, looking up each token's angle by position.

    Token ``t`` of sequence ``b`` is rotated by row ``p`` of the tables: ``p = positions[(b,) t]``
    if given, else ``p = offsets (or offsets[b]) + t``; with ``cu_seqlens``, ``t`` counts from
    the start of the token's own sequence. Per rotary pair
    :math:`y_1 = x_1 c_p - x_2 s_p,\; y_2 = x_2 c_p + x_1 s_p` (``s -> -s`` when ``conjugate``).

    Args:
        q, k: ``(batch, seq, heads, head_dim)`` (``seq_dim=1``), ``(batch, heads, seq, head_dim)``
            (``seq_dim=2``), packed ``(tokens, heads, head_dim)`` (``seq_dim=0``), or without the
            batch or head axis; any strides. ``k`` may have another head count (GQA/MQA).
            float32/float16/bfloat16 with float32 arithmetic; float64 runs the eager kernel.
        cos_table, sin_table: float32 ``(max_positions, rotary_dim // 2)``; ``rotary_dim`` is
            any even number ``<= head_dim``; channels past it are left as they are.
        positions: integer ``(seq,)`` or ``(batch, seq)``; with ``cu_seqlens``, ``(tokens,)``.
        offsets: int, or integer ``(batch,)`` tensor of per-sequence offsets (not with ``positions``).
        cu_seqlens: integer ``(batch + 1,)`` boundaries of the sequences packed in q/k
            (``seq_dim=0``), from 0 to ``tokens``, as in flash-attention.
        max_seqlen: longest sequence in ``cu_seqlens`` (computed when omitted).
        seq_dim: the sequence (or packed token) axis of q and k.
        layout: ``"half"`` or ``"interleaved"``.
        conjugate: rotate by ``-theta`` (undoes the rotation; the backward pass).
        inplace: rotate q and k in place and return them.

    Returns:
        ``(q_rotated, k_rotated)`` with the shapes and dtypes of q and k. Gradients reach q and
        k, not the tables.

    Raises:
        ValueError: bad shapes, or positions outside ``[0, max_positions)`` (checked before launch).
    """
    offset, offsets_t = _check_qk(q, k, cos_table, sin_table, positions, offsets, cu_seqlens, max_seqlen,
                                  seq_dim, layout)
    if not isinstance(conjugate, bool) or not isinstance(inplace, bool):
        raise TypeError(f"conjugate and inplace must be bools, got {conjugate!r} and {inplace!r}")
    if inplace and q is k:
        raise ValueError("inplace=True needs distinct q and k tensors (the same tensor would be rotated twice)")
    if torch.is_grad_enabled() and (cos_table.requires_grad or sin_table.requires_grad):
        raise ValueError("rotate_qk does not differentiate cos_table/sin_table; use apply_rotary for learned tables")
    args = (cos_table, sin_table, positions, offsets_t, offset, cu_seqlens, max_seqlen, seq_dim, layout, conjugate)
    if not inplace:
        return torch.ops.ropekit.triton_rotary_qk(q, k, *args)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        q_out, k_out = torch.ops.ropekit.triton_rotary_qk(q, k, *args)
        return q.copy_(q_out), k.copy_(k_out)
    torch.ops.ropekit.triton_rotary_qk_(q, k, *args)
    return q, k
