"""DeepSeek MLA's decoupled RoPE: the rope slice of every query head and one shared key head, rotated together.

A query head is ``[q_nope | q_pe]`` (``qk_nope_head_dim`` then ``rotary_dim`` channels) and the
keys' rotated part is one head ``k_pe`` broadcast over all heads (:mod:`ropekit.rope.mla`).
:func:`apply_rotary_mla` (tables broadcast against q_pe and k_pe) and :func:`rotate_mla` (full
tables, rows by position) rotate q_pe and k_pe in one kernel call and return the whole query
heads (``q_nope`` copied, ``q_pe`` rotated) and the rotated ``k_pe``; :func:`mla_keys` builds the
per-head keys ``[k_nope | k_pe]``.

Channel order. DeepSeek's checkpoints store q_pe and k_pe in interleaved pairs. Two ways to
rotate them, with the same scores:

- ``layout="interleaved"`` (``output_layout`` left None): rotate the pairs where they are, in
  place if asked (vLLM's ``is_neox_style=False``); the outputs keep the interleaved order;
- ``layout="interleaved", output_layout="half"``: transformers' ``apply_rotary_pos_emb_interleave``,
  whose outputs are de-interleaved (``[rotated evens | rotated odds]``): the rope channels are
  permuted once, on their way into the output, and rotated there in the half pairing. A model
  whose projections were permuted once (:func:`ropekit.mla.permute_mla_weight`) gives the same
  outputs with ``layout="half"``.

Built on the public rotations (:func:`ropekit.apply_rotary_qk`, :func:`ropekit.rotate_qk`, in
place on the outputs' rope slices), so every backend serves them, the eager ``"torch"`` one too,
and autograd reaches q and k_pe.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..functional import apply_rotary_qk, rotate_qk
from ..ops.memory import check_not_shared
from ..validation import check_float_tensor, check_inplace, check_layout


def pairs_view(t: Tensor, layout: str) -> Tensor:
    """``(..., r)`` viewed as ``(..., r // 2, 2)``: ``[..., i, 0]`` and ``[..., i, 1]`` are pair ``i`` in ``layout``."""
    half = t.shape[-1] // 2
    if layout == "interleaved":
        return t.unflatten(-1, (half, 2))
    return t.unflatten(-1, (2, half)).transpose(-1, -2)


def place_rope(dst: Tensor, src: Tensor, layout: str, output_layout: str) -> None:
    """Copy the rope channels ``src`` (pairing ``layout``) into ``dst`` in the pairing ``output_layout``."""
    if layout == output_layout:
        dst.copy_(src)
    else:
        pairs_view(dst, output_layout).copy_(pairs_view(src, layout))


def check_rotary_width(k_pe: Tensor, cos: Tensor, sin: Tensor, table: str = "cos") -> int:
    """``rotary_dim`` (k_pe's channels, all rotated) after checking that it is even and the tables' width fits it."""
    rotary_dim = k_pe.shape[-1] if k_pe.dim() else 0
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"k_pe must have a positive even number of channels (rotary_dim, all rotated), got shape "
                         f"{tuple(k_pe.shape)}")
    for name, t in ((table, cos), (table.replace("cos", "sin"), sin)):
        check_float_tensor(t, name)
        if t.dim() == 0 or t.shape[-1] != rotary_dim // 2:
            hint = (f"; full-width tables (transformers' form) must be sliced: {name}[..., :{rotary_dim // 2}]"
                    if t.dim() and t.shape[-1] == rotary_dim else "")
            raise ValueError(f"{name} must have rotary_dim // 2 = {rotary_dim // 2} entries per row (k_pe has "
                             f"{rotary_dim} channels), got shape {tuple(t.shape)}{hint}")
    return rotary_dim


def _check_mla(q: Tensor, k_pe: Tensor, cos: Tensor, sin: Tensor, layout: str, output_layout: str | None,
               inplace: bool, table: str) -> tuple[int, str, str]:
    """``(nope_dim, layout, output_layout)`` after the checks every MLA rotation shares."""
    check_float_tensor(q, "q")
    check_float_tensor(k_pe, "k_pe")
    layout = check_layout(layout)
    output_layout = layout if output_layout is None else check_layout(output_layout, "output_layout")
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {type(inplace).__name__}")
    rotary_dim = check_rotary_width(k_pe, cos, sin, table)
    if q.dim() != k_pe.dim():
        raise ValueError(f"q and k_pe must have the same number of dimensions (k_pe: one head shared by all, e.g. "
                         f"(batch, 1, seq, rotary_dim) for q (batch, heads, seq, qk_head_dim)); got q "
                         f"{tuple(q.shape)} and k_pe {tuple(k_pe.shape)}")
    if q.shape[-1] < rotary_dim:
        raise ValueError(f"q has {q.shape[-1]} channels per head, fewer than k_pe's rotary_dim = {rotary_dim} (a "
                         f"query head is [q_nope | q_pe], q_pe as wide as k_pe)")
    if inplace:
        if output_layout != layout:
            raise ValueError(f"inplace=True rotates q_pe and k_pe where they are, in layout={layout!r}; "
                             f"output_layout={output_layout!r} reorders them: use inplace=False (one permuted copy) "
                             "or leave output_layout None")
        check_inplace(q, "q")
        check_inplace(k_pe, "k_pe")
        check_not_shared({"q": q, "k_pe": k_pe}, {"cos": cos, "sin": sin}, "inplace=True")
    return q.shape[-1] - rotary_dim, layout, output_layout


def _outputs(q: Tensor, k_pe: Tensor, nope: int, layout: str, output_layout: str) -> tuple[Tensor, Tensor]:
    """New q (``q_nope`` copied, ``q_pe`` placed in ``output_layout``) and k_pe (placed), not yet rotated."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if nope:
        q_out[..., :nope].copy_(q[..., :nope])
    place_rope(q_out[..., nope:], q[..., nope:], layout, output_layout)
    k_out = torch.empty(k_pe.shape, dtype=k_pe.dtype, device=k_pe.device)
    place_rope(k_out, k_pe, layout, output_layout)
    return q_out, k_out


def apply_rotary_mla(
    q: Tensor,
    k_pe: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    layout: str,
    output_layout: str | None = None,
    inplace: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    r"""Rotate the rope slice of every query head and the shared key head, with broadcast tables.

    DeepSeek-V2/V3's (and Kimi K2's, GLM's MLA) decoupled RoPE: the last ``rotary_dim`` channels
    of each query head, ``q_pe``, and ``k_pe`` are rotated in one kernel call; the first
    ``qk_nope_head_dim`` channels of q are left as they are. Per rotary pair
    :math:`y_1 = x_1 \cos\theta - x_2 \sin\theta,\; y_2 = x_2 \cos\theta + x_1 \sin\theta`.

    Args:
        q: queries ``(..., qk_nope_head_dim + rotary_dim)``, e.g. ``(batch, heads, seq, 192)`` or
            ``(tokens, heads, 192)``; any strides and float dtype. ``qk_nope_head_dim`` may be 0
            (q is then q_pe alone, as transformers' attention passes it).
        k_pe: the shared rotated key ``(..., rotary_dim)`` with q's number of dimensions and a
            head axis of 1, e.g. ``(batch, 1, seq, 64)`` or ``(tokens, 1, 64)``.
        cos, sin: half-width tables ``(..., rotary_dim // 2)`` broadcast against q_pe and k_pe as
            for :func:`ropekit.apply_rotary_qk`, e.g. ``(batch, 1, seq, 32)``; for DeepSeek's YaRN
            scaled by :func:`ropekit.mla.attention_factor` (``ropekit.cos_sin(..., attention_scale=)``).
        layout: the pairing q_pe and k_pe are stored in: ``"interleaved"`` for DeepSeek's
            checkpoints (``rope_interleave: true``), ``"half"`` for rows in the half pairing.
        output_layout: the pairing of the outputs' rope channels; None: ``layout`` (rotated where
            they are). ``"half"`` with ``layout="interleaved"`` gives transformers'
            ``apply_rotary_pos_emb_interleave`` order.
        inplace: rotate q's rope slice and k_pe themselves and return them (only with
            ``output_layout`` None or equal to ``layout``).
        backend: ``"auto"`` or a name from :func:`ropekit.ops.available`.

    Returns:
        ``(q_rotated, k_pe_rotated)``, shapes and dtypes of q and k_pe (new contiguous tensors,
        or q and k_pe themselves in place). Gradients reach q and k_pe (not the tables).

    Raises:
        ValueError / TypeError: naming the argument (k_pe not even-wide, tables not
        ``rotary_dim // 2`` wide, q narrower than k_pe, ranks that differ, ...).
    """
    nope, layout, output_layout = _check_mla(q, k_pe, cos, sin, layout, output_layout, inplace, "cos")
    if inplace:
        apply_rotary_qk(q[..., nope:], k_pe, cos, sin, layout=layout, inplace=True, backend=backend)
        return q, k_pe
    q_out, k_out = _outputs(q, k_pe, nope, layout, output_layout)
    apply_rotary_qk(q_out[..., nope:], k_out, cos, sin, layout=output_layout, inplace=True, backend=backend)
    return q_out, k_out


def rotate_mla(
    q: Tensor,
    k_pe: Tensor,
    cos_table: Tensor,
    sin_table: Tensor,
    *,
    positions: Tensor | None = None,
    offsets: int | Tensor = 0,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    tensor_format: str | None = None,
    seq_dim: int | None = None,
    layout: str,
    output_layout: str | None = None,
    inplace: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """:func:`apply_rotary_mla` with the full tables, each token's row looked up by position.

    vLLM's form (``rotary_emb(positions, q[..., qk_nope_head_dim:], k_pe)``) and flash-attention's:
    the positions come from ``positions``, ``offsets`` (an int or one per sequence) or
    ``cu_seqlens``, exactly as for :func:`ropekit.rotate_qk`.

    Args:
        q: ``(batch, heads, seq, qk_head_dim)`` (``tensor_format="bhsd"``), ``(batch, seq, heads,
            qk_head_dim)`` (``"bshd"``), ``(seq, batch, heads, qk_head_dim)`` (``"sbhd"``) or packed
            ``(tokens, heads, qk_head_dim)`` (``"thd"``); rope channels last.
        k_pe: the same order with one head: ``(batch, 1, seq, rotary_dim)``, ..., ``(tokens, 1, rotary_dim)``.
        cos_table, sin_table: float32 ``(max_positions, rotary_dim // 2)``.
        positions, offsets, cu_seqlens, max_seqlen, tensor_format, seq_dim: as for :func:`ropekit.rotate_qk`.
        layout, output_layout, inplace, backend: as for :func:`apply_rotary_mla`.

    Returns:
        ``(q_rotated, k_pe_rotated)`` as :func:`apply_rotary_mla` returns them.

    Raises:
        ValueError / TypeError: naming the argument; positions outside the tables (checked before
            anything is written).
    """
    nope, layout, output_layout = _check_mla(q, k_pe, cos_table, sin_table, layout, output_layout, inplace,
                                             "cos_table")
    where = dict(positions=positions, offsets=offsets, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                 tensor_format=tensor_format, seq_dim=seq_dim, backend=backend)
    if inplace:
        rotate_qk(q[..., nope:], k_pe, cos_table, sin_table, layout=layout, inplace=True, **where)
        return q, k_pe
    q_out, k_out = _outputs(q, k_pe, nope, layout, output_layout)
    rotate_qk(q_out[..., nope:], k_out, cos_table, sin_table, layout=output_layout, inplace=True, **where)
    return q_out, k_out


def mla_keys(k_nope: Tensor, k_pe: Tensor) -> Tensor:
    """The keys of every head, ``[k_nope | k_pe]``: the per-head part and the shared rotated head.

    transformers' ``DeepseekV3Attention.expand_kv`` concatenation (after ``kv_b_proj``).

    Args:
        k_nope: ``(..., heads, seq, qk_nope_head_dim)`` (any order: the leading axes broadcast).
        k_pe: the rotated shared head, ``(..., 1, seq, rotary_dim)``, broadcast over the heads.

    Returns:
        a new ``(..., heads, seq, qk_nope_head_dim + rotary_dim)`` tensor of k_nope's dtype.

    Raises:
        TypeError / ValueError: not float tensors, different dtypes, devices or ranks, leading
            axes that do not broadcast.
    """
    check_float_tensor(k_nope, "k_nope")
    check_float_tensor(k_pe, "k_pe")
    if k_nope.dtype != k_pe.dtype or k_nope.device != k_pe.device:
        raise ValueError(f"k_nope and k_pe must have one dtype and device, got {k_nope.dtype} on {k_nope.device} and "
                         f"{k_pe.dtype} on {k_pe.device}")
    if k_nope.dim() != k_pe.dim() or k_nope.dim() < 2:
        raise ValueError(f"k_nope and k_pe must have the same number (>= 2) of dimensions, got {tuple(k_nope.shape)} "
                         f"and {tuple(k_pe.shape)}")
    try:
        lead = torch.broadcast_shapes(k_nope.shape[:-1], k_pe.shape[:-1])
    except RuntimeError:
        raise ValueError(f"k_nope {tuple(k_nope.shape)} and k_pe {tuple(k_pe.shape)} do not broadcast (all axes but "
                         "the last)") from None
    nope = k_nope.shape[-1]
    keys = k_nope.new_empty(*lead, nope + k_pe.shape[-1])
    keys[..., :nope].copy_(k_nope)
    keys[..., nope:].copy_(k_pe)
    return keys
