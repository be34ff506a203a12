"""``apply_rotary``: validate, pick a backend, rotate (out of place or in place) with autograd.

Decode fast path: a call whose signature (shapes, strides, dtypes and devices of every tensor,
and the options) matches one that already passed every check, with no gradient to record,
goes straight to the backend's prepared call (:func:`ropekit.backends.runner`). A decode loop
repeats one signature, so all that remains per step is the kernel and a few attribute reads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import backends
from .validation import check_float_tensor, check_layout

_FAST_CACHE_SIZE = 256
_fast_single: dict[tuple, Callable] = {}
_fast_pair: dict[tuple, Callable] = {}


def _remember(cache: dict[tuple, Callable], key: tuple | None, run: Callable | None) -> None:
    if key is not None and run is not None:
        if len(cache) >= _FAST_CACHE_SIZE:
            cache.clear()
        cache[key] = run


def _signature(tensors: tuple, options: tuple) -> tuple | None:
    """The fast-path key of plain CPU/GPU tensors, or None (subclasses, sparse, under compile)."""
    if torch.compiler.is_compiling():
        return None
    key: list = []
    for t in tensors:
        if type(t) is not torch.Tensor or t.layout is not torch.strided:
            return None
        key += (t.shape, t.stride(), t.dtype, t.is_cpu)
    return (*key, *options)


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


class _RotaryPair(torch.autograd.Function):
    """:class:`_Rotary` for q and k together (one kernel call each way)."""

    @staticmethod
    def forward(ctx, q, k, cos_q, sin_q, cos_k, sin_k, layout, inplace, pair):  # noqa: D102
        q_out, k_out = pair(q, k, cos_q, sin_q, cos_k, sin_k, layout=layout, conjugate=False, inplace=inplace)
        ctx.save_for_backward(cos_q, sin_q, cos_k, sin_k)
        ctx.layout = layout
        ctx.pair = pair
        if inplace:
            ctx.mark_dirty(q, k)
        return q_out, k_out

    @staticmethod
    def backward(ctx, grad_q, grad_k):  # noqa: D102
        cos_q, sin_q, cos_k, sin_k = ctx.saved_tensors
        if torch.is_grad_enabled():  # double backward: see _Rotary.backward
            grads = _RotaryPair.apply(grad_q, grad_k, cos_q, -sin_q, cos_k, -sin_k, ctx.layout, False, ctx.pair)
        else:
            grads = ctx.pair(grad_q, grad_k, cos_q, sin_q, cos_k, sin_k, layout=ctx.layout, conjugate=True,
                             inplace=False)
        return (*grads, None, None, None, None, None, None, None)


def apply_rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    layout: str = "half",
    inplace: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rotary` for queries and keys sharing one pair of tables, in one kernel call.

    What transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` does, with ropekit's
    half-width tables. On the CPU q and k cross into the native kernel once (their rows split
    over torch's threads together), which halves the fixed cost of a decode step; on CUDA they
    are one Triton launch. Results are those of two :func:`apply_rotary` calls.

    Args:
        q: queries of shape ``(..., head_dim)``, e.g. ``(batch, q_heads, seq, head_dim)``.
        k: keys of shape ``(..., head_dim)`` with the same ``head_dim``; any head count
            (GQA/MQA) as long as ``cos``/``sin`` broadcast against both.
        cos, sin: half-width tables broadcastable to ``q.shape[:-1] + (rotary_dim // 2,)``
            and to ``k.shape[:-1] + (rotary_dim // 2,)``, as for :func:`apply_rotary`.
        layout: ``"half"`` or ``"interleaved"``.
        inplace: rotate q and k themselves (they must be distinct tensors).
        backend: ``"auto"`` or a name from :func:`ropekit.backends.available`.

    Returns:
        ``(q_rotated, k_rotated)`` with the shapes and dtypes of q and k.
    """
    if type(q) is type(k) is type(cos) is type(sin) is torch.Tensor and not torch.compiler.is_compiling():
        try:
            run = _fast_pair.get((q.shape, q.stride(), q.dtype, q.is_cpu, k.shape, k.stride(), k.dtype, k.is_cpu,
                                  cos.shape, cos.stride(), cos.dtype, cos.is_cpu, sin.shape, sin.stride(), sin.dtype,
                                  sin.is_cpu, layout, inplace, backend))
        except (RuntimeError, TypeError):  # no strides (sparse), unhashable options
            run = None
        if run is not None and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                                 or cos.requires_grad or sin.requires_grad)):
            return run(q, k, cos, sin)
    check_float_tensor(q, "q")
    check_float_tensor(k, "k")
    check_layout(layout)
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {type(inplace).__name__}")
    if q.dim() == 0 or k.dim() == 0 or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim, got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    if inplace and q is k:
        raise ValueError("inplace=True needs distinct q and k tensors (the same tensor would be rotated twice)")
    if not (q.is_cpu and k.is_cpu) and q.device != k.device:
        raise ValueError(f"q is on {q.device} but k is on {k.device}")
    key = _signature((q, k, cos, sin), (layout, inplace, backend))
    cos_q, sin_q = _expand_tables(q, cos, sin)
    cos_k, sin_k = cos_q, sin_q
    if k.shape[:-1] != q.shape[:-1]:
        cos_k, sin_k = _expand_tables(k, cos, sin)  # checked against k too
        if k.dim() == q.dim():  # the same views: pass the same objects (one launch on Triton)
            cos_k, sin_k = cos_q, sin_q
    grad = torch.is_grad_enabled()
    if grad and (cos.requires_grad or sin.requires_grad):
        return (apply_rotary(q, cos, sin, layout=layout, inplace=inplace, backend=backend),
                apply_rotary(k, cos, sin, layout=layout, inplace=inplace, backend=backend))
    rotate = backends.select(backend, q)
    pair = backends.pair_of(rotate)
    if grad and (q.requires_grad or k.requires_grad):
        return _RotaryPair.apply(q, k, cos_q, sin_q, cos_k, sin_k, layout, inplace, pair)
    if key is not None:  # the expanded tables are views of cos/sin: the runner reads those
        _remember(_fast_pair, key, backends.pair_runner(rotate, q, k, cos_q, sin_q, cos_k, sin_k, layout=layout,
                                                        inplace=inplace))
    return pair(q, k, cos_q, sin_q, cos_k, sin_k, layout=layout, conjugate=False, inplace=inplace)


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
    if type(x) is type(cos) is type(sin) is torch.Tensor and not torch.compiler.is_compiling():
        try:
            run = _fast_single.get((x.shape, x.stride(), x.dtype, x.is_cpu, cos.shape, cos.stride(), cos.dtype,
                                    cos.is_cpu, sin.shape, sin.stride(), sin.dtype, sin.is_cpu, layout, inplace,
                                    backend))
        except (RuntimeError, TypeError):  # no strides (sparse), unhashable options
            run = None
        if run is not None and not (torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad
                                                                 or sin.requires_grad)):
            return run(x, cos, sin)
    check_float_tensor(x, "x")
    check_layout(layout)
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {type(inplace).__name__}")
    key = _signature((x, cos, sin), (layout, inplace, backend))
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
    if key is not None:  # the expanded tables are views of the caller's: the runner reads those
        _remember(_fast_single, key, backends.runner(rotate, x, cos, sin, layout=layout, inplace=inplace))
    return rotate(x, cos, sin, layout=layout, conjugate=False, inplace=inplace)


def rotate_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    seq_dim: int,
    layout: str = "half",
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by token position, looking each token's row up in the full tables.

    The flash-attention / vLLM form: ``cos_table``/``sin_table`` are the whole
    ``(max_positions, rotary_dim // 2)`` tables (e.g. :meth:`ropekit.RotaryEmbedding.tables`)
    and the positions come from ``positions``, from ``offsets`` (an int, or one per sequence:
    a KV cache's lengths), or from ``cu_seqlens`` for variable-length sequences packed into
    ``(tokens, heads, head_dim)``. On CUDA this is one Triton launch for q and k with the
    lookup inside the kernel; elsewhere the rows are gathered and the best kernel for the
    device runs (the native one on the CPU). ``torch.compile(fullgraph=True)`` traces it.

    Args:
        q, k: ``(batch, seq, heads, head_dim)`` (``seq_dim=1``), ``(batch, heads, seq,
            head_dim)`` (``seq_dim=2``), packed ``(tokens, heads, head_dim)`` (``seq_dim=0``);
            any strides; ``k`` may have another head count (GQA/MQA).
        cos_table, sin_table: float32 ``(max_positions, rotary_dim // 2)``.
        positions: integer ``(seq,)`` or ``(batch, seq)``; with ``cu_seqlens``, ``(tokens,)``.
        offsets: int, or integer ``(batch,)`` tensor (not with ``positions``).
        cu_seqlens: integer ``(batch + 1,)`` sequence boundaries in packed q/k.
        max_seqlen: longest packed sequence (computed when omitted).
        seq_dim: the sequence (or packed token) axis.
        layout: ``"half"`` or ``"interleaved"``.
        inplace: rotate q and k themselves.

    Returns:
        ``(q_rotated, k_rotated)``; gradients reach q and k (not the tables).

    Raises:
        ValueError: bad shapes, or positions outside the tables (checked before the kernel runs).

    See :func:`ropekit.backends.triton_api.rotate_qk` for the details.
    """
    from .backends import triton_api  # imports triton when installed (a fraction of a second, once)

    return triton_api.rotate_qk(q, k, cos_table, sin_table, positions=positions, offsets=offsets,
                                cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, seq_dim=seq_dim, layout=layout,
                                inplace=inplace)
