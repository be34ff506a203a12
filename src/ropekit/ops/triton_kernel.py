"""The fused rotary kernel in Triton, and the launchers that feed it strides.

One kernel does every variant; each is a flag of the same code path:

* ``INTERLEAVED``: pairs ``(2i, 2i+1)`` instead of ``(i, i + rotary_dim/2)``;
* ``CONJUGATE``: rotate by ``-theta`` (the backward pass);
* ``GATHER``: cos/sin rows are looked up by token position in a full
  ``(max_positions, rotary_dim/2)`` table, else addressed by strides like ``x``;
* ``HAS_POSITIONS`` / ``HAS_OFFSETS`` / ``VARLEN``: where a token's position comes from
  (a positions tensor; ``offset + index``, with a per-sequence offsets tensor; the index
  within its sequence of a packed batch described by ``cu_seqlens``);
* ``COPY_TAIL``: copy the channels past ``rotary_dim`` (out-of-place calls);
* ``INT64``: index arithmetic in 64 bits (tensors whose offsets reach 2**31).

Every tensor is seen through a ``(batch, seq, heads, channels)`` view given by four
strides, so ``(b, s, h, d)``, ``(b, h, s, d)``, packed ``(tokens, h, d)`` and slices
of a fused qkv projection are all read in place. One launch rotates q and k: the
program's head index runs over ``heads_q + heads_k``.

The grid is one-dimensional, ``batch * cdiv(seq, BLOCK_S) * (heads_q + heads_k)``
programs (no 65535 limit on any axis); heads vary fastest so that the programs
sharing cos/sin rows run together. Each program rotates a ``BLOCK_S x BLOCK_R`` tile
of pairs of one head, in float32, and stores in the output dtype.

Validation lives in :mod:`ropekit.functional` and :mod:`ropekit.ops.positions`; :func:`launch` trusts its
arguments. Importing this module never fails: without Triton, :func:`is_available`
is False and nothing here may be launched.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from .positions import qk_axes

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is not installed
    triton = None
    tl = None

INT32_LIMIT = 2**31 - 1


def is_available() -> bool:
    """True when Triton imports (the kernel can run on CUDA, or interpreted on CPU)."""
    return triton is not None


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1``: kernels run in Triton's CPU interpreter."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def can_launch(x: torch.Tensor) -> bool:
    """True when the kernel can run on ``x``'s device now (CUDA, or any device interpreted)."""
    return is_available() and (x.is_cuda or interpreting())


def _rotate_head(
    X, OUT, sx_b, sx_s, sx_h, sx_d, so_b, so_s, so_h, so_d,
    pid_b, rows, head, token_mask, pairs, pair_mask, cos, sin, rotary_half, head_dim,
    INTERLEAVED: tl.constexpr, COPY_TAIL: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Rotate one head's tile of tokens (``rows``) in place or into ``OUT``."""
    if INTERLEAVED:
        first = pairs * 2
        second = first + 1
    else:
        first = pairs
        second = pairs + rotary_half
    x_row = X + pid_b * sx_b + rows[:, None] * sx_s + head * sx_h
    o_row = OUT + pid_b * so_b + rows[:, None] * so_s + head * so_h
    mask = token_mask[:, None] & pair_mask[None, :]
    x1 = tl.load(x_row + first[None, :] * sx_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + second[None, :] * sx_d, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    tl.store(o_row + first[None, :] * so_d, y1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(o_row + second[None, :] * so_d, y2.to(OUT.dtype.element_ty), mask=mask)
    if COPY_TAIL:
        tail = 2 * rotary_half + tl.arange(0, BLOCK_T)
        tail_mask = token_mask[:, None] & (tail < head_dim)[None, :]
        values = tl.load(x_row + tail[None, :] * sx_d, mask=tail_mask)
        tl.store(o_row + tail[None, :] * so_d, values, mask=tail_mask)


def _rotary_kernel(
    Q, Q_OUT, K, K_OUT, COS, SIN, POSITIONS, OFFSETS, CU_SEQLENS,
    seqlen, heads_q, heads_k, seq_blocks, rotary_half, head_dim, offset,
    sq_b, sq_s, sq_h, sq_d, soq_b, soq_s, soq_h, soq_d,
    sk_b, sk_s, sk_h, sk_d, sok_b, sok_s, sok_h, sok_d,
    sc_b, sc_s, sc_h, sc_d, ss_b, ss_s, ss_h, ss_d,
    sp_b, sp_s,
    BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
    INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr, GATHER: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, HAS_OFFSETS: tl.constexpr, VARLEN: tl.constexpr,
    COPY_TAIL: tl.constexpr, INT64: tl.constexpr,
):
    """One program: ``BLOCK_S`` tokens x all rotary pairs of one head of q or k."""
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    heads = heads_q + heads_k
    pid_h = pid % heads
    pid_s = (pid // heads) % seq_blocks
    pid_b = pid // heads // seq_blocks

    steps = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)  # index of each token within its sequence
    if VARLEN:
        start = tl.load(CU_SEQLENS + pid_b)
        length = tl.load(CU_SEQLENS + pid_b + 1) - start
        if INT64:
            start = start.to(tl.int64)
        rows = start + steps  # row of the packed tensor (its batch stride is 0)
    else:
        length = seqlen
        rows = steps
    if pid_s * BLOCK_S >= length:
        return
    token_mask = steps < length

    if HAS_POSITIONS:
        table_rows = tl.load(POSITIONS + pid_b * sp_b + rows * sp_s, mask=token_mask, other=0)
    elif GATHER:
        table_rows = steps + offset
        if HAS_OFFSETS:
            table_rows += tl.load(OFFSETS + pid_b)
    else:
        table_rows = rows  # cos/sin share x's (batch, seq, heads) axes, broadcast by stride 0
    if INT64:
        table_rows = table_rows.to(tl.int64)
    pairs = tl.arange(0, BLOCK_R)
    pair_mask = pairs < rotary_half
    mask = token_mask[:, None] & pair_mask[None, :]
    cos_ptrs = COS + pid_b * sc_b + table_rows[:, None] * sc_s + pid_h * sc_h + pairs[None, :] * sc_d
    sin_ptrs = SIN + pid_b * ss_b + table_rows[:, None] * ss_s + pid_h * ss_h + pairs[None, :] * ss_d
    cos = tl.load(cos_ptrs, mask=mask, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptrs, mask=mask, other=0.0).to(tl.float32)
    if CONJUGATE:
        sin = -sin

    if pid_h < heads_q:
        _rotate_head(
            Q, Q_OUT, sq_b, sq_s, sq_h, sq_d, soq_b, soq_s, soq_h, soq_d,
            pid_b, rows, pid_h, token_mask, pairs, pair_mask, cos, sin, rotary_half, head_dim,
            INTERLEAVED, COPY_TAIL, BLOCK_T,
        )
    else:
        _rotate_head(
            K, K_OUT, sk_b, sk_s, sk_h, sk_d, sok_b, sok_s, sok_h, sok_d,
            pid_b, rows, pid_h - heads_q, token_mask, pairs, pair_mask, cos, sin, rotary_half, head_dim,
            INTERLEAVED, COPY_TAIL, BLOCK_T,
        )


@functools.cache
def _jit(interpret: bool):
    """The jitted kernel, built on first use.

    ``triton.jit`` decides at decoration time between compiling and interpreting, from
    ``TRITON_INTERPRET``; deciding here, per mode, lets a process set the variable after
    importing ropekit (as test suites do) and still get the interpreter.
    """
    del interpret  # the cache key; triton.jit reads the same setting itself
    helper = triton.jit(_rotate_head)
    # The kernel resolves ``_rotate_head`` from its globals: point it at the jitted helper.
    kernel_globals = dict(_rotary_kernel.__globals__, _rotate_head=helper)
    kernel = type(_rotary_kernel)(
        _rotary_kernel.__code__, kernel_globals, _rotary_kernel.__name__, _rotary_kernel.__defaults__
    )
    kernel.__module__ = _rotary_kernel.__module__
    kernel.__qualname__ = _rotary_kernel.__qualname__
    kernel.__doc__ = _rotary_kernel.__doc__
    kernel.__annotations__ = dict(_rotary_kernel.__annotations__)  # which arguments are tl.constexpr
    return triton.jit(kernel)


@dataclass(frozen=True)
class View4:
    """A tensor seen as ``(batch, seq, heads, channels)`` through four element strides."""

    tensor: torch.Tensor
    strides: tuple[int, int, int, int]


def max_offset(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """Largest element offset a view reaches (0 for an empty view)."""
    if any(n == 0 for n in shape):
        return 0
    return sum((n - 1) * abs(s) for n, s in zip(shape, strides, strict=True))


def needs_int64(*extents: int) -> bool:
    """True when any element count or offset does not fit in a signed 32-bit index."""
    return any(e >= INT32_LIMIT for e in extents)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def launch(
    q: View4, q_out: View4, k: View4 | None, k_out: View4 | None, heads: tuple[int, int],
    cos: torch.Tensor, sin: torch.Tensor, cos_strides: tuple[int, ...], sin_strides: tuple[int, ...],
    *, batch: int, seqlen: int, rotary_dim: int, head_dim: int, layout: str, conjugate: bool,
    gather: bool, positions: torch.Tensor | None = None, positions_strides: tuple[int, int] = (0, 0),
    offsets: torch.Tensor | None = None, offset: int = 0, cu_seqlens: torch.Tensor | None = None,
    inplace: bool = False, int64: bool = False,
) -> None:
    """Run the kernel once over ``batch x seqlen x (heads_q + heads_k)`` tokens-heads.

    ``cos_strides``/``sin_strides`` are 4 strides ``(b, s, h, channel)``; with ``gather``
    the ``s`` stride is the table's row stride and the others are 0. ``seqlen`` is the
    sequence length, or with ``cu_seqlens`` the longest sequence. ``inplace`` means the
    outputs are the inputs: the channels past ``rotary_dim`` are then not copied.
    """
    heads_q, heads_k = heads
    if k is None:
        k, k_out = q, q_out
    if batch == 0 or seqlen == 0 or heads_q + heads_k == 0:
        return
    rotary_half = rotary_dim // 2
    block_r = _pow2(rotary_half)
    block_s = max(1, min(_pow2(seqlen), 64, 2048 // block_r))
    copy_tail = rotary_dim < head_dim and not inplace
    block_t = _pow2(head_dim - rotary_dim) if copy_tail else 1
    seq_blocks = triton.cdiv(seqlen, block_s)
    grid = (batch * seq_blocks * (heads_q + heads_k),)
    dummy = cos  # any tensor: the pointer of an absent optional input is never read
    kernel = _jit(interpreting())
    kernel[grid](
        q.tensor, q_out.tensor, k.tensor, k_out.tensor, cos, sin,
        dummy if positions is None else positions,
        dummy if offsets is None else offsets,
        dummy if cu_seqlens is None else cu_seqlens,
        seqlen, heads_q, heads_k, seq_blocks, rotary_half, head_dim, offset,
        *q.strides, *q_out.strides, *k.strides, *k_out.strides,
        *cos_strides, *sin_strides, *positions_strides,
        BLOCK_S=block_s, BLOCK_R=block_r, BLOCK_T=block_t,
        INTERLEAVED=layout == "interleaved", CONJUGATE=conjugate, GATHER=gather,
        HAS_POSITIONS=positions is not None, HAS_OFFSETS=offsets is not None,
        VARLEN=cu_seqlens is not None, COPY_TAIL=copy_tail, INT64=int64,
        num_warps=4 if block_s * block_r >= 512 else 2,
    )


# -- canonical views ---------------------------------------------------------------------------
def _view4(t: torch.Tensor, axes: tuple[int | None, int, int | None]) -> View4:
    batch, seq, head = axes
    strides = (0 if batch is None else t.stride(batch), t.stride(seq), 0 if head is None else t.stride(head))
    return View4(t, (*strides, t.stride(-1)))


def _extents(*tensors: torch.Tensor) -> list[int]:
    return [e for t in tensors for e in (t.numel(), max_offset(tuple(t.shape), tuple(t.stride())))]


def _collapse(sizes: tuple[int, ...], strides: list[tuple[int, ...]]) -> list[tuple[int, list[int]]]:
    """Merge adjacent axes that are contiguous with each other in every tensor; drop size-1 axes."""
    merged: list[tuple[int, list[int]]] = []
    for axis, n in enumerate(sizes):
        if n == 1:
            continue
        here = [s[axis] for s in strides]
        if merged and all(outer == inner * n for outer, inner in zip(merged[-1][1], here, strict=True)):
            merged[-1] = (merged[-1][0] * n, here)
        else:
            merged.append((n, here))
    return merged


# -- the two ways in ---------------------------------------------------------------------------
def launch_apply_rotary(
    x: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    *, layout: str, conjugate: bool, inplace: bool,
) -> None:
    """The backend contract: cos/sin broadcast against ``x`` (stride 0 where broadcast).

    The leading axes of ``x``, ``out``, ``cos`` and ``sin`` are collapsed together to at
    most three (the kernel's batch, seq and head axes); beyond three, axis 0 is looped.
    """
    lead = tuple(x.shape[:-1])
    half = cos.shape[-1]
    cos, sin = cos.expand(*lead, half), sin.expand(*lead, half)
    tensors = (x, out, cos, sin)
    axes = _collapse(lead, [t.stride()[:-1] for t in tensors])
    if len(axes) > 3:
        for i in range(x.shape[0]):
            launch_apply_rotary(x[i], out[i], cos[i], sin[i], layout=layout, conjugate=conjugate, inplace=inplace)
        return
    axes += [(1, [0, 0, 0, 0])] * (3 - len(axes))  # tokens tile the second axis
    (batch, sb), (seqlen, ss), (heads, sh) = axes
    views = [View4(t, (sb[i], ss[i], sh[i], t.stride(-1))) for i, t in enumerate(tensors)]
    launch(
        views[0], views[1], None, None, (heads, 0), cos, sin, views[2].strides, views[3].strides,
        batch=batch, seqlen=seqlen, rotary_dim=2 * half, head_dim=x.shape[-1], layout=layout,
        conjugate=conjugate, gather=False, inplace=inplace, int64=needs_int64(*_extents(*tensors)),
    )


def launch_rotate_qk(
    q: torch.Tensor, k: torch.Tensor | None, q_out: torch.Tensor, k_out: torch.Tensor | None,
    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None, offsets: torch.Tensor | None,
    offset: int, cu_seqlens: torch.Tensor | None, max_seqlen: int | None,
    *, seq_dim: int, layout: str, conjugate: bool, inplace: bool,
) -> None:
    """Rotate q and k (or q alone: ``k=None``) in one launch, rows gathered from the full tables by position."""
    batch_axis, seq_axis, head_axis = axes = qk_axes(q.dim(), seq_dim)
    heads = tuple(0 if t is None else 1 if head_axis is None else t.shape[head_axis] for t in (q, k))
    if cu_seqlens is not None:
        batch, seqlen = cu_seqlens.numel() - 1, max_seqlen
    else:
        batch, seqlen = (1 if batch_axis is None else q.shape[batch_axis]), q.shape[seq_axis]
    pos_strides = (0, 0)
    if positions is not None:
        batched = positions.dim() == 2 and positions.shape[0] > 1
        pos_strides = (positions.stride(0) if batched else 0, positions.stride(-1))
    if offsets is not None:
        offsets = offsets.expand(batch).contiguous()
    tensors = [t for t in (q, k, q_out, k_out, cos, sin, positions) if t is not None]
    launch(
        _view4(q, axes), _view4(q_out, axes), None if k is None else _view4(k, axes),
        None if k_out is None else _view4(k_out, axes), heads,
        cos, sin, (0, cos.stride(0), 0, cos.stride(1)), (0, sin.stride(0), 0, sin.stride(1)),
        batch=batch, seqlen=seqlen, rotary_dim=2 * cos.shape[1], head_dim=q.shape[-1], layout=layout,
        conjugate=conjugate, gather=True, positions=positions, positions_strides=pos_strides,
        offsets=offsets, offset=offset, cu_seqlens=cu_seqlens, inplace=inplace,
        int64=needs_int64(*_extents(*tensors), batch * seqlen * (heads[0] + heads[1])),
    )


def launch_apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, *, layout: str, conjugate: bool, inplace: bool,
) -> bool:
    """Rotate q and k with the same broadcast tables (``x.dim()`` dims each) in one launch.

    q and k may differ along one axis, the heads (GQA), where the tables must have size 1; the
    other leading axes must collapse to two (the kernel's batch and seq). Returns False, having
    launched nothing, when the shapes do not allow one launch.
    """
    if not q.dim() == k.dim() == cos.dim() or q.numel() == 0 or k.numel() == 0:
        return False
    differ = [axis for axis in range(q.dim() - 1) if q.shape[axis] != k.shape[axis]]
    if len(differ) > 1 or (differ and cos.shape[differ[0]] != 1):
        return False
    if differ:  # the heads axis next to the channels
        views = [t.movedim(differ[0], -2) for t in (q, q_out, k, k_out, cos, sin)]
    else:  # a heads axis of one for both
        views = [t.unsqueeze(-2) for t in (q, q_out, k, k_out, cos, sin)]
    lead = tuple(views[0].shape[:-2])
    half = cos.shape[-1]
    views[4:] = [t.expand(*lead, 1, half) for t in views[4:]]
    axes = _collapse(lead, [t.stride()[:-2] for t in views])
    if len(axes) > 2:
        return False
    axes = [(1, [0] * 6)] * (2 - len(axes)) + axes  # a lone axis is the tiled (seq) one
    (batch, sb), (seqlen, ss) = axes
    heads = (views[0].shape[-2], views[2].shape[-2])
    v4 = [View4(t, (sb[i], ss[i], 0 if i >= 4 else t.stride(-2), t.stride(-1))) for i, t in enumerate(views)]
    launch(
        v4[0], v4[1], v4[2], v4[3], heads, cos, sin, v4[4].strides, v4[5].strides,
        batch=batch, seqlen=seqlen, rotary_dim=2 * half, head_dim=q.shape[-1], layout=layout,
        conjugate=conjugate, gather=False, inplace=inplace,
        int64=needs_int64(*_extents(q, k, q_out, k_out, cos, sin), batch * seqlen * (heads[0] + heads[1])),
    )
    return True
