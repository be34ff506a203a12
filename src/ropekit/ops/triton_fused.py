"""The fused Triton kernels: RMSNorm + rotation (forward, backward) and the rotation into a KV cache.

One forward kernel serves every form, each a flag of the same code path:

* ``NORM``: normalise each row first (else rotate only: the cache write without a norm, and,
  with no rotary channels, the copy of the values);
* ``PER_TOKEN``: one norm over a token's heads (a program then holds all of them);
* ``HAS_GAINS``: multiply by the gains ``weight_offset + weight`` (float32, precomputed);
* ``DEST``: where a token's output row goes: 0, ``OUT`` addressed like ``X``; 1, a contiguous
  cache, token ``s`` of row ``b`` at ``start_b + s`` (``start_b`` from ``SLOTS`` or ``start``);
  2, a paged cache, token ``s`` at ``SLOTS[s]`` (block, row), skipped when negative.

Tensors are seen as ``(batch, seq, heads, channels)`` through four strides. A program holds a
``BLOCK_S x BLOCK_H x BLOCK_R`` tile (tokens x heads x pairs) and the tail channels past
``rotary_dim``, so each element is read once and written once; the norm's sum of squares is a
reduction over the tile in float64 (the squares of float32 values are exact there), and
``r = 1 / sqrt(ms + eps)`` is computed in float64 and rounded once (as on the CPU; no ``rsqrt``
approximation), and the rotation is the one of
:mod:`.triton_kernel`. The backward kernel recomputes ``r`` and writes each program's share of the
weight gradient to a float32 buffer that the launcher sums.

* ``SCALED``: the output is an FP8 cache: ``clamp(y / scale[head], -max, max)`` of the float32
  result, rounded to the FP8 grid in float32 (:func:`_fp8_entry`), then stored.

Written for ``TRITON_INTERPRET=1`` too: no ``.to()`` on scalar arguments, no ``libdevice``.
"""

from __future__ import annotations

import functools

import torch

from . import triton_kernel as kern

triton, tl = kern.triton, kern.tl


def _tile(X, sx, b, s_idx, h_idx, first, second, tail, mask, tail_mask):
    """Load the pairs and the tail of a (tokens, heads) tile as float32."""
    base = X + b * sx[0] + s_idx[:, None, None] * sx[1] + h_idx[None, :, None] * sx[2]
    x1 = tl.load(base + first[None, None, :] * sx[3], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + second[None, None, :] * sx[3], mask=mask, other=0.0).to(tl.float32)
    xt = tl.load(base + tail[None, None, :] * sx[3], mask=tail_mask, other=0.0).to(tl.float32)
    return x1, x2, xt


def _add(a, b):
    """The reductions' combine function.

    Jitted with the kernels, for the mode they run in: ``tl.sum`` is jitted once, when Triton is
    imported, for that mode, and one process may run both (the tests do).
    """
    return a + b


def _inv_rms(x1, x2, xt, n, eps, PER_TOKEN: tl.constexpr):
    """``1 / sqrt(mean(x^2) + eps)`` per row (per token: over its heads), in float64, as float32 ``[S, H, 1]``."""
    a, b, t = x1.to(tl.float64), x2.to(tl.float64), xt.to(tl.float64)
    squares = tl.reduce(a * a, 2, _add) + tl.reduce(b * b, 2, _add) + tl.reduce(t * t, 2, _add)
    if PER_TOKEN:
        squares = tl.reduce(squares, 1, _add, keep_dims=True)
    return (1.0 / tl.sqrt(squares / n + eps)).to(tl.float32)[:, :, None]


_FP8_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}  # mantissa bits, least normal exponent


def _fp8_entry(y, scale, FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
    """``clamp(y / scale, -max, max)`` rounded to the FP8 grid in float32 (the store's conversion is then exact).

    IEEE division (``div_rn``), then round to nearest even at the grid's spacing ``2^(e - MANT)``
    (``e`` the exponent, at least ``EMIN``: subnormals), sign and NaN kept. Rounding here rather
    than in the float32 -> FP8 conversion makes the CPU interpreter, whose conversion does not carry
    a rounding into the exponent, give the GPU's bits.
    """
    q = tl.math.div_rn(y, scale)
    q = tl.minimum(tl.maximum(q, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                   propagate_nan=tl.PropagateNan.ALL)
    bits = q.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)
    spacing = ((exponent - MANT + 127) << 23).to(tl.float32, bitcast=True)
    steps = tl.abs(q) / spacing  # exact (a power of two), below 2^(MANT + 1)
    steps = (steps + 12582912.0) - 12582912.0  # 1.5 * 2^23: round to nearest even
    rounded = (steps * spacing).to(tl.int32, bitcast=True) | (bits & -2147483648)
    return tl.where(q != q, q, rounded.to(tl.float32, bitcast=True))


def _forward_kernel(
    X, OUT, COS, SIN, GAINS, SLOTS, SCALE,
    seqlen, heads, seq_blocks, head_blocks, rotary_half, head_dim, n, eps, start, block_size,
    sx_b, sx_s, sx_h, sx_d, so_b, so_s, so_h, so_d, sc_b, sc_s, sc_h, sc_d, sn_b, sn_s, sn_h, sn_d, sg_h, sl_b,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
    INTERLEAVED: tl.constexpr, NORM: tl.constexpr, PER_TOKEN: tl.constexpr, HAS_GAINS: tl.constexpr,
    DEST: tl.constexpr, HAS_SLOTS: tl.constexpr,
    INT64: tl.constexpr, SCALED: tl.constexpr = False, FP8_MAX: tl.constexpr = 0.0, MANT: tl.constexpr = 0,
    EMIN: tl.constexpr = 0,
):
    """One program: BLOCK_S tokens x BLOCK_H heads, every channel (SCALED: into an FP8 cache, per-head SCALE)."""
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    pid_h = pid % head_blocks
    pid_s = (pid // head_blocks) % seq_blocks
    b = pid // head_blocks // seq_blocks
    s_idx = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    h_idx = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, BLOCK_R)
    if INTERLEAVED:
        first = pairs * 2
        second = first + 1
    else:
        first = pairs
        second = pairs + rotary_half
    tail = 2 * rotary_half + tl.arange(0, BLOCK_T)
    rows_ok = (s_idx < seqlen)[:, None] & (h_idx < heads)[None, :]
    if DEST == 2:  # paged: the token's slot
        slot = tl.load(SLOTS + s_idx, mask=s_idx < seqlen, other=-1)
        if INT64:
            slot = slot.to(tl.int64)
        rows_ok = rows_ok & (slot >= 0)[:, None]
        out_rows = (slot // block_size) * so_b + (slot % block_size) * so_s
    elif DEST == 1:  # contiguous cache: from the row's start on
        if HAS_SLOTS:
            first_slot = tl.load(SLOTS + b * sl_b)
        else:
            first_slot = start
        out_rows = b * so_b + (first_slot + s_idx) * so_s
    else:
        out_rows = b * so_b + s_idx * so_s
    mask = rows_ok[:, :, None] & (pairs < rotary_half)[None, None, :]
    tail_mask = rows_ok[:, :, None] & (tail < head_dim)[None, None, :]
    x1, x2, xt = _tile(X, (sx_b, sx_s, sx_h, sx_d), b, s_idx, h_idx, first, second, tail, mask, tail_mask)
    if NORM:
        inv = _inv_rms(x1, x2, xt, n, eps, PER_TOKEN)
        x1 = x1 * inv
        x2 = x2 * inv
        xt = xt * inv
        if HAS_GAINS:
            g_row = GAINS + h_idx[None, :, None] * sg_h
            x1 = x1 * tl.load(g_row + first[None, None, :], mask=mask, other=0.0)
            x2 = x2 * tl.load(g_row + second[None, None, :], mask=mask, other=0.0)
            xt = xt * tl.load(g_row + tail[None, None, :], mask=tail_mask, other=0.0)
    table = b * sc_b + s_idx[:, None, None] * sc_s + h_idx[None, :, None] * sc_h + pairs[None, None, :] * sc_d
    c = tl.load(COS + table, mask=mask, other=1.0).to(tl.float32)
    table = b * sn_b + s_idx[:, None, None] * sn_s + h_idx[None, :, None] * sn_h + pairs[None, None, :] * sn_d
    s = tl.load(SIN + table, mask=mask, other=0.0).to(tl.float32)
    o = OUT + out_rows[:, None, None] + h_idx[None, :, None] * so_h
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    if SCALED:
        scale = tl.load(SCALE + h_idx, mask=h_idx < heads, other=1.0)[None, :, None]
        y1 = _fp8_entry(y1, scale, FP8_MAX, MANT, EMIN)
        y2 = _fp8_entry(y2, scale, FP8_MAX, MANT, EMIN)
        xt = _fp8_entry(xt, scale, FP8_MAX, MANT, EMIN)
    tl.store(o + first[None, None, :] * so_d, y1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(o + second[None, None, :] * so_d, y2.to(OUT.dtype.element_ty), mask=mask)
    tl.store(o + tail[None, None, :] * so_d, xt.to(OUT.dtype.element_ty), mask=tail_mask)


def _backward_kernel(
    GRAD, X, GRAD_X, COS, SIN, GAINS, PARTIAL,
    seqlen, heads, seq_blocks, head_blocks, rotary_half, head_dim, n, eps,
    sg_b, sg_s, sg_h, sg_d, sx_b, sx_s, sx_h, sx_d, so_b, so_s, so_h, so_d,
    sc_b, sc_s, sc_h, sc_d, sn_b, sn_s, sn_h, sn_d, sw_h, partial_stride,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
    INTERLEAVED: tl.constexpr, PER_TOKEN: tl.constexpr, HAS_GAINS: tl.constexpr, INT64: tl.constexpr,
):
    """dL/dx of one tile, and its share of dL/dweight in row ``pid`` of PARTIAL."""
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    pid_h = pid % head_blocks
    pid_s = (pid // head_blocks) % seq_blocks
    b = pid // head_blocks // seq_blocks
    s_idx = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    h_idx = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, BLOCK_R)
    if INTERLEAVED:
        first = pairs * 2
        second = first + 1
    else:
        first = pairs
        second = pairs + rotary_half
    tail = 2 * rotary_half + tl.arange(0, BLOCK_T)
    rows_ok = (s_idx < seqlen)[:, None] & (h_idx < heads)[None, :]
    mask = rows_ok[:, :, None] & (pairs < rotary_half)[None, None, :]
    tail_mask = rows_ok[:, :, None] & (tail < head_dim)[None, None, :]
    x1, x2, xt = _tile(X, (sx_b, sx_s, sx_h, sx_d), b, s_idx, h_idx, first, second, tail, mask, tail_mask)
    go1, go2, got = _tile(GRAD, (sg_b, sg_s, sg_h, sg_d), b, s_idx, h_idx, first, second, tail, mask, tail_mask)
    inv = _inv_rms(x1, x2, xt, n, eps, PER_TOKEN)
    table = b * sc_b + s_idx[:, None, None] * sc_s + h_idx[None, :, None] * sc_h + pairs[None, None, :] * sc_d
    c = tl.load(COS + table, mask=mask, other=1.0).to(tl.float32)
    table = b * sn_b + s_idx[:, None, None] * sn_s + h_idx[None, :, None] * sn_h + pairs[None, None, :] * sn_d
    s = tl.load(SIN + table, mask=mask, other=0.0).to(tl.float32)
    gy1 = go1 * c + go2 * s
    gy2 = go2 * c - go1 * s
    gyt = got
    if HAS_GAINS:
        g_row = GAINS + h_idx[None, :, None] * sw_h
        g1 = tl.load(g_row + first[None, None, :], mask=mask, other=0.0)
        g2 = tl.load(g_row + second[None, None, :], mask=mask, other=0.0)
        gt = tl.load(g_row + tail[None, None, :], mask=tail_mask, other=0.0)
    else:
        g1 = 1.0
        g2 = 1.0
        gt = 1.0
    dot = tl.reduce(gy1 * g1 * x1, 2, _add) + tl.reduce(gy2 * g2 * x2, 2, _add) + tl.reduce(gyt * gt * xt, 2, _add)
    if PER_TOKEN:
        dot = tl.reduce(dot, 1, _add, keep_dims=True)
    coef = inv * inv * inv * (dot / n)[:, :, None]
    o = GRAD_X + b * so_b + s_idx[:, None, None] * so_s + h_idx[None, :, None] * so_h
    tl.store(o + first[None, None, :] * so_d, (inv * (gy1 * g1) - x1 * coef).to(GRAD_X.dtype.element_ty), mask=mask)
    tl.store(o + second[None, None, :] * so_d, (inv * (gy2 * g2) - x2 * coef).to(GRAD_X.dtype.element_ty), mask=mask)
    tl.store(o + tail[None, None, :] * so_d, (inv * (gyt * gt) - xt * coef).to(GRAD_X.dtype.element_ty),
             mask=tail_mask)
    if HAS_GAINS:
        part = PARTIAL + pid * partial_stride + h_idx[:, None] * sw_h
        head_ok = (h_idx < heads)[:, None]
        pair_ok = head_ok & (pairs < rotary_half)[None, :]
        tl.store(part + first[None, :], tl.reduce(gy1 * x1 * inv, 0, _add), mask=pair_ok)
        tl.store(part + second[None, :], tl.reduce(gy2 * x2 * inv, 0, _add), mask=pair_ok)
        tl.store(part + tail[None, :], tl.reduce(gyt * xt * inv, 0, _add), mask=head_ok & (tail < head_dim)[None, :])


@functools.cache
def _jit(interpret: bool):
    """The jitted kernels (decided per mode, as :func:`ropekit.ops.triton_kernel._jit` explains)."""
    del interpret
    add = triton.jit(_add)
    helpers = dict(_tile=triton.jit(_tile), _inv_rms=triton.jit(_with_scope(_inv_rms, _add=add)), _add=add,
                   _fp8_entry=triton.jit(_fp8_entry))
    return tuple(triton.jit(_with_scope(fn, **helpers)) for fn in (_forward_kernel, _backward_kernel))


def _with_scope(fn, **names):
    """``fn`` seeing ``names`` (the jitted helpers) in its globals; annotations kept (tl.constexpr)."""
    copy = type(fn)(fn.__code__, dict(fn.__globals__, **names), fn.__name__, fn.__defaults__)
    copy.__module__, copy.__qualname__, copy.__doc__ = fn.__module__, fn.__qualname__, fn.__doc__
    copy.__annotations__ = dict(fn.__annotations__)
    return copy


# -- launchers: tensors as (batch, seq, heads, channels) -------------------------------------------------
def _roles(x: torch.Tensor, others: list[torch.Tensor], head_axis: int | None) -> list[tuple[int, list[int]]] | None:
    """``[(size, [stride of x, of each other]) for batch, seq, heads]``, or None when they do not fit three.

    ``head_axis`` (per token) stays the heads role; the other leading axes collapse to batch and
    seq. Per head every leading axis is alike and they collapse to at most three.
    """
    tensors = [x, *others]
    lead = [a for a in range(x.dim() - 1) if a != head_axis]
    sizes = tuple(x.shape[a] for a in lead)
    axes = kern._collapse(sizes, [tuple(t.stride(a) for a in lead) for t in tensors])
    zero = [0] * len(tensors)
    if head_axis is not None:
        if len(axes) > 2:
            return None
        axes = [(1, zero)] * (2 - len(axes)) + axes
        return [*axes, (x.shape[head_axis], [t.stride(head_axis) for t in tensors])]
    if len(axes) > 3:
        return None
    if len(axes) == 1:  # a lone axis is the tiled one (seq)
        return [(1, zero), axes[0], (1, zero)]
    return axes + [(1, zero)] * (3 - len(axes))


def _blocks(seq: int, heads: int, rotary_half: int, per_token: bool) -> tuple[int, int, int]:
    block_r = kern._pow2(max(rotary_half, 1))
    block_h = kern._pow2(heads) if per_token else 1
    block_s = max(1, min(kern._pow2(seq), 64, 4096 // (block_r * block_h)))
    return block_s, block_h, block_r


def _strides(roles, i: int, tensor: torch.Tensor) -> tuple[int, int, int, int]:
    return (roles[0][1][i], roles[1][1][i], roles[2][1][i], tensor.stride(-1))


def launch_norm_rotate(x, out, cos, sin, gains, *, eps: float, per_token: bool, layout: str, norm: bool = True,
                       dest: int = 0, slots=None, start: int = 0, block_size: int = 0, out_roles=None,
                       scale=None) -> bool:
    """Normalise (``norm``) and rotate ``x`` into ``out``; False, having launched nothing, if the axes do not fit.

    ``cos``/``sin`` are expanded to ``x``'s leading shape; ``gains`` is None or float32
    ``(head_dim,)`` / ``(heads, head_dim)``. With ``dest`` 1 or 2, ``out`` is a cache and
    ``out_roles`` its (batch, seq, heads) strides; ``scale`` (float32 ``(heads,)``) with an FP8 ``out``.
    """
    half = cos.shape[-1]
    cos, sin = cos.expand(*x.shape[:-1], half), sin.expand(*x.shape[:-1], half)
    head_axis = x.dim() - 2 if per_token else None
    if out_roles is not None:  # a cache: x is (batch, seq, heads, channels) as it is, axis by axis
        roles = [(x.shape[a], [t.stride(a) for t in (x, cos, sin)]) for a in range(3)]
    else:
        roles = _roles(x, [out, cos, sin], head_axis)
    if roles is None:
        return False
    (batch, _), (seq, _), (heads, _) = roles
    if x.numel() == 0:
        return True
    sx = _strides(roles, 0, x)
    if out_roles is None:
        so = _strides(roles, 1, out)
        sc, sn = _strides(roles, 2, cos), _strides(roles, 3, sin)
    else:
        so = (*out_roles, out.stride(-1))
        sc, sn = _strides(roles, 1, cos), _strides(roles, 2, sin)
    block_s, block_h, block_r = _blocks(seq, heads, half, per_token)
    seq_blocks, head_blocks = triton.cdiv(seq, block_s), triton.cdiv(heads, block_h)
    tail = x.shape[-1] - 2 * half
    extents = kern._extents(x, out, cos, sin) + [batch * seq * heads * x.shape[-1]]
    forward, _ = _jit(kern.interpreting())
    fp8 = {} if scale is None else dict(SCALED=True, FP8_MAX=float(torch.finfo(out.dtype).max),
                                        MANT=_FP8_GRID[out.dtype][0], EMIN=_FP8_GRID[out.dtype][1])
    forward[(batch * seq_blocks * head_blocks,)](
        x, out, cos, sin, cos if gains is None else gains, cos if slots is None else slots,
        cos if scale is None else scale,
        seq, heads, seq_blocks, head_blocks, half, x.shape[-1], x.shape[-1] * (heads if per_token else 1), eps,
        start, max(block_size, 1), *sx, *so, *sc, *sn,
        0 if gains is None or gains.dim() == 1 else gains.stride(0), 0 if slots is None or slots.numel() == 1 else 1,
        BLOCK_S=block_s, BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_T=kern._pow2(max(tail, 1)),
        INTERLEAVED=layout == "interleaved", NORM=norm, PER_TOKEN=per_token, HAS_GAINS=gains is not None,
        DEST=dest, HAS_SLOTS=slots is not None, INT64=kern.needs_int64(*extents), **fp8,
    )
    return True


def launch_backward(grad, x, grad_x, cos, sin, gains, *, eps: float, per_token: bool, layout: str):
    """``grad_x`` filled; returns the float32 weight gradient (None without gains), or False if the axes do not fit."""
    half = cos.shape[-1]
    cos, sin = cos.expand(*x.shape[:-1], half), sin.expand(*x.shape[:-1], half)
    head_axis = x.dim() - 2 if per_token else None
    roles = _roles(x, [grad, grad_x, cos, sin], head_axis)
    if roles is None:
        return False
    (batch, _), (seq, _), (heads, _) = roles
    block_s, block_h, block_r = _blocks(seq, heads, half, per_token)
    seq_blocks, head_blocks = triton.cdiv(seq, block_s), triton.cdiv(heads, block_h)
    programs = batch * seq_blocks * head_blocks
    width = x.shape[-1] * (heads if per_token else 1)
    partial = torch.zeros(programs if gains is not None else 1, width, dtype=torch.float32, device=x.device)
    if x.numel():
        strides = [_strides(roles, i, t) for i, t in enumerate((x, grad, grad_x, cos, sin))]
        extents = kern._extents(x, grad, grad_x, cos, sin) + [programs * width]
        _, backward = _jit(kern.interpreting())
        backward[(programs,)](
            grad, x, grad_x, cos, sin, cos if gains is None else gains, partial,
            seq, heads, seq_blocks, head_blocks, half, x.shape[-1], width, eps,
            *strides[1], *strides[0], *strides[2], *strides[3], *strides[4],
            x.shape[-1] if per_token else 0, width,
            BLOCK_S=block_s, BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_T=kern._pow2(max(x.shape[-1] - 2 * half, 1)),
            INTERLEAVED=layout == "interleaved", PER_TOKEN=per_token, HAS_GAINS=gains is not None,
            INT64=kern.needs_int64(*extents),
        )
    return None if gains is None else partial.sum(0)


def launch_cache(k, v, cos, sin, k_cache, v_cache, slots, start, gains, *, eps, per_token, block_size,
                 layout, k_scale=None, v_scale=None) -> bool:
    """Keys (normalised with ``eps``) rotated and values copied into the cache slots; False if they do not fit.

    An FP8 cache comes with its float32 ``(kv_heads,)`` scale: ``clamp(y / scale)`` of the float32 result.
    """
    if block_size == 0:  # k (batch, kv_heads, seq, head_dim) -> roles (batch, seq, heads)
        k_view, v_view = k.transpose(1, 2), v.transpose(1, 2)
        lead = (1,) * (k.dim() - cos.dim())
        cos, sin = cos.view(*lead, *cos.shape).transpose(1, 2), sin.view(*lead, *sin.shape).transpose(1, 2)
        roles = [(c.stride(0), c.stride(2), c.stride(1)) for c in (k_cache, v_cache)]
        dest = 1
    else:  # k (tokens, kv_heads, head_dim) as (1, tokens, kv_heads); caches (blocks, block_size, kv_heads)
        k_view, v_view = k.unsqueeze(0), v.unsqueeze(0)
        lead = (1,) * (k_view.dim() - cos.dim())
        cos, sin = cos.view(*lead, *cos.shape), sin.view(*lead, *sin.shape)
        roles = [(c.stride(0), c.stride(1), c.stride(2)) for c in (k_cache, v_cache)]
        dest = 2
    options = dict(dest=dest, slots=slots, start=start, block_size=block_size, layout=layout)
    no_table = cos[..., :0]
    if not launch_norm_rotate(k_view, k_cache, cos, sin, gains, eps=0.0 if eps is None else eps, per_token=per_token,
                              norm=eps is not None, out_roles=roles[0], scale=k_scale, **options):
        return False
    launch_norm_rotate(v_view, v_cache, no_table, no_table, None, eps=0.0, per_token=False, norm=False,
                       out_roles=roles[1], scale=v_scale, **options)
    return True
