"""The public rotations: validate every argument once, then call an operator (:mod:`ropekit.ops`).

- :func:`apply_rotary` / :func:`apply_rotary_qk`: tables broadcast against x (or q and k);
- :func:`rotate` / :func:`rotate_qk`: full tables, each token's row looked up by position
  (per-token ``positions``, ``offsets``, packed ``cu_seqlens``), flash-attention's and vLLM's forms.

Each function calls the operator of its own name (``torch.ops.ropekit.<name>``), whose kernel is
the backend method of that name (docs/api.md, "Vocabulary"). ``backend`` names a registered
backend (:func:`ropekit.ops.available`); ``"auto"`` picks by device. Autograd: the gradient is
the rotation by ``-theta`` (nothing of the inputs' size is saved); learned tables (``cos``/``sin``
requiring grad) take a composite path that differentiates them too.

``inverse=True`` on every form rotates by ``-theta`` with the same tables: it undoes the rotation
(``R(-theta) R(theta) x = x``; DeepSeek-V4-style de-rotation of an attention output), and its
gradient is the rotation by ``+theta``. The operators and backends call it ``conjugate``.
``torch.compile(fullgraph=True)`` traces every entry point as one operator node.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .ops import operators, prepared, prepared_keys
from .ops.backend import prepared_call
from .ops.dispatch import check_runs, resolve
from .ops.dispatch import get as get_backend
from .ops.eager import apply_rotary_differentiable
from .ops.memory import check_not_shared
from .ops.positions import check_shapes, qk_axes
from .validation import check_float_tensor, check_inplace, check_layout, check_tables, resolve_seq_dim


def _check_options(layout: str, inplace: bool, inverse: bool = False) -> None:
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {type(inplace).__name__}")
    _check_inverse(inverse)


def _check_inverse(inverse: bool) -> None:
    if not isinstance(inverse, bool):
        raise TypeError(f"inverse must be a bool, got {type(inverse).__name__}")


def apply_rotary_qk(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    layout: str = "half",
    inplace: bool = False,
    inverse: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """:func:`apply_rotary` for queries and keys sharing one pair of tables, in one kernel call.

    What transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` does, with ropekit's
    half-width tables. On the CPU q and k cross into the C++ kernel once (their rows split
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
        inverse: rotate by ``-theta`` (undo a rotation with the same tables).
        backend: ``"auto"`` or a name from :func:`ropekit.ops.available`.

    Returns:
        ``(q_rotated, k_rotated)`` with the shapes and dtypes of q and k.
    """
    key, run = prepared_keys.apply_rotary_qk(q, k, cos, sin, layout, inplace, inverse, backend)  # layout as given
    if run is not None:
        return run(q, k, cos, sin)
    layout = check_layout(layout)
    check_float_tensor(q, "q")
    check_float_tensor(k, "k")
    _check_options(layout, inplace, inverse)
    if q.dim() == 0 or k.dim() == 0 or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim, got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    if not (q.is_cpu and k.is_cpu) and q.device != k.device:
        raise ValueError(f"q is on {q.device} but k is on {k.device}")
    if inplace:
        if q is k:
            raise ValueError("inplace=True needs distinct q and k tensors (the same tensor would be rotated twice)")
        check_inplace(q, "q")
        check_inplace(k, "k")
    check_tables(q, cos, sin)
    check_tables(k, cos, sin)
    if inplace:
        check_not_shared({"q": q, "k": k}, {"cos": cos, "sin": sin}, "inplace=True")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return (apply_rotary(q, cos, sin, layout=layout, inplace=inplace, inverse=inverse, backend=backend),
                apply_rotary(k, cos, sin, layout=layout, inplace=inplace, inverse=inverse, backend=backend))
    name = resolve(backend, q.device.type)
    check_runs(backend, name, {"q": q, "k": k})
    if k.dim() != q.dim():  # tables viewed for q do not fit k: one call each
        return (operators.apply_rotary(q, cos, sin, layout=layout, backend=name, inplace=inplace, conjugate=inverse),
                operators.apply_rotary(k, cos, sin, layout=layout, backend=name, inplace=inplace, conjugate=inverse))
    if operators.direct(q, k, cos, sin):
        prepared.keep(key, prepared_call(get_backend(name), "prepared", (q, k, cos, sin), layout=layout,
                                         inplace=inplace, conjugate=inverse), (q, k, cos, sin))
    return operators.apply_rotary_qk(q, k, cos, sin, layout=layout, backend=name, inplace=inplace, conjugate=inverse)


def apply_rotary(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    layout: str = "half",
    inplace: bool = False,
    inverse: bool = False,
    backend: str = "auto",
) -> Tensor:
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
            channels past it are left untouched (partial rotary). transformers' full-width
            tables (``rotary_dim`` wide) are refused with a ``ValueError`` naming the slice to
            pass (``cos[..., :rotary_dim // 2]``) where their width exceeds ``head_dim // 2``.
        layout: ``"half"`` pairs channels ``(i, i + rotary_dim/2)`` (GPT-NeoX, HF; aliases
            ``"neox"``, ``"gpt-neox"``, ``"rotate_half"``); ``"interleaved"`` pairs ``(2i, 2i+1)``
            (RoFormer, Meta, GPT-J; aliases ``"gptj"``, ``"gpt-j"``, ``"meta"``, ``"complex"``).
        inplace: rotate ``x`` itself and return it; allocates nothing of ``x``'s size.
        inverse: rotate by ``-theta`` instead (``s -> -s`` above): undoes the rotation by the same
            tables, ``apply_rotary(apply_rotary(x, cos, sin), cos, sin, inverse=True) == x`` up to
            rounding (tables carrying an attention scale scale both ways).
        backend: ``"auto"`` or a name from :func:`ropekit.ops.available`.

    Returns:
        Tensor of ``x``'s shape and dtype (``x`` itself when ``inplace``). Arithmetic is
        float32 (float64 for float64 inputs), rounded once to ``x.dtype``.

    Autograd: gradients flow to ``x`` through the rotation by ``-theta`` (``+theta`` for
    ``inverse``; no saved activations). When ``cos``/``sin`` require grad (learned frequencies)
    a composite path is used that also differentiates the tables.
    """
    key, run = prepared_keys.apply_rotary(x, cos, sin, layout, inplace, inverse, backend)  # the layout as given
    if run is not None:
        return run(x, cos, sin)
    layout = check_layout(layout)
    check_float_tensor(x, "x")
    _check_options(layout, inplace, inverse)
    if inplace:
        check_inplace(x, "x")
    check_tables(x, cos, sin)
    if inplace:
        check_not_shared({"x": x}, {"cos": cos, "sin": sin}, "inplace=True")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        sin = -sin if inverse else sin  # sin(-theta) = -sin(theta), exactly
        if not inplace:
            return apply_rotary_differentiable(x, cos, sin, layout=layout)
        return x.copy_(apply_rotary_differentiable(x.clone(), cos, sin, layout=layout))
    name = resolve(backend, x.device.type)
    check_runs(backend, name, {"x": x})
    if operators.direct(x, cos, sin):
        prepared.keep(key, prepared_call(get_backend(name), "prepared", (x, cos, sin), layout=layout, inplace=inplace,
                                         conjugate=inverse), (x, cos, sin))
    return operators.apply_rotary(x, cos, sin, layout=layout, backend=name, inplace=inplace, conjugate=inverse)


def _unflatten_heads(t: Tensor, head_size: int, name: str) -> Tensor:
    """``(..., heads * head_size)`` viewed as ``(..., heads, head_size)`` (vLLM's flat q/k)."""
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size <= 0:
        raise TypeError(f"head_size must be a positive int or None, got {head_size!r}")
    check_float_tensor(t, name)
    if t.dim() == 0 or t.shape[-1] % head_size:
        raise ValueError(f"{name} of shape {tuple(t.shape)} is not (..., heads * head_size) with head_size={head_size}")
    return t.unflatten(-1, (t.shape[-1] // head_size, head_size))


def _by_position_checks(q: Tensor, k: Tensor | None, cos_table: Tensor, sin_table: Tensor, inplace: bool,
                        position_tensors: dict) -> None:
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {type(inplace).__name__}")
    if inplace:
        if q is k:
            raise ValueError("inplace=True needs distinct q and k tensors (the same tensor would be rotated twice)")
        check_inplace(q, "q" if k is not None else "x")
        if k is not None:
            check_inplace(k, "k")
        written = {"q": q, "k": k} if k is not None else {"x": q}
        check_not_shared(written, {"cos_table": cos_table, "sin_table": sin_table, **position_tensors}, "inplace=True")
    if torch.is_grad_enabled() and (cos_table.requires_grad or sin_table.requires_grad):
        raise ValueError("rotation by position does not differentiate cos_table/sin_table; use apply_rotary for "
                         "learned tables")


def rotate(
    x: Tensor,
    cos_table: Tensor,
    sin_table: Tensor,
    *,
    positions: Tensor | None = None,
    offsets: int | Tensor = 0,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    tensor_format: str | None = None,
    seq_dim: int | None = None,
    layout: str = "half",
    inplace: bool = False,
    inverse: bool = False,
    backend: str = "auto",
) -> Tensor:
    r"""Rotate one tensor by token position, looking each token's row up in the full tables.

    flash-attention's ``apply_rotary_emb(x, cos, sin, interleaved, inplace, seqlen_offsets,
    cu_seqlens, max_seqlen)`` with ropekit's names: token ``t`` of sequence ``b`` is rotated by
    row ``p`` of the tables, ``p = positions[(b,) t]`` if given, else ``p = offsets (or
    offsets[b]) + t``; with ``cu_seqlens``, ``t`` counts from the start of its own sequence.
    Per rotary pair :math:`y_1 = x_1 c_p - x_2 s_p,\; y_2 = x_2 c_p + x_1 s_p`.

    Args:
        x: ``(batch, heads, seq, head_dim)`` (``tensor_format="bhsd"``), ``(batch, seq, heads,
            head_dim)`` (``"bshd"``), ``(seq, batch, heads, head_dim)`` (``"sbhd"``), packed
            ``(tokens, heads, head_dim)`` (``"thd"``), or, with ``seq_dim``, without the batch or
            head axis; any strides and float dtype.
        cos_table, sin_table: ``(max_positions, rotary_dim // 2)`` (float32 from
            :func:`ropekit.cos_sin`); channels past ``rotary_dim`` are left as they are.
        positions: integer ``(seq,)`` or ``(batch, seq)``; with ``cu_seqlens``, ``(tokens,)``.
        offsets: int, or integer ``(batch,)`` tensor (a KV cache's lengths; not with ``positions``).
        cu_seqlens: integer ``(batch + 1,)`` boundaries of the sequences packed in x (``seq_dim=0``).
        max_seqlen: longest packed sequence (computed when omitted).
        tensor_format: the order of x's axes: ``"bhsd"``, ``"bshd"``, ``"sbhd"`` or ``"thd"``
            (TransformerEngine's names); this or ``seq_dim`` is required.
        seq_dim: the sequence (or packed token) axis, the low-level spelling of ``tensor_format``
            (``2``, ``1``, ``0``, ``0``); both given must agree.
        layout: ``"half"`` or ``"interleaved"`` (flash-attention's ``interleaved=True``), or an
            alias (``"neox"``, ``"gptj"``, ...: :data:`ropekit.validation.LAYOUT_ALIASES`).
        inplace: rotate x itself and return it.
        inverse: rotate by ``-theta`` (``s_p -> -s_p``): undoes ``rotate`` at the same positions.
        backend: ``"auto"`` or a name from :func:`ropekit.ops.available`.

    Returns:
        Tensor of ``x``'s shape and dtype; gradients reach x (not the tables).

    Raises:
        ValueError: bad shapes, or positions outside the tables (checked before any kernel runs).
    """
    layout = check_layout(layout)
    seq_dim = resolve_seq_dim(getattr(x, "ndim", 0), tensor_format, seq_dim, name="x")
    where = check_shapes(x, None, cos_table, sin_table, positions, offsets, cu_seqlens, max_seqlen, seq_dim, layout)
    _by_position_checks(x, None, cos_table, sin_table, inplace,
                        {"positions": positions, "offsets": offsets, "cu_seqlens": cu_seqlens})
    _check_inverse(inverse)
    name = resolve(backend, x.device.type)
    check_runs(backend, name, {"x": x})
    return operators.rotate(x, cos_table, sin_table, where, layout=layout, backend=name, inplace=inplace,
                            conjugate=inverse)


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
    tensor_format: str | None = None,
    seq_dim: int | None = None,
    head_size: int | None = None,
    layout: str = "half",
    inplace: bool = False,
    inverse: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Rotate q and k by token position, looking each token's row up in the full tables.

    :func:`rotate` for queries and keys together (one kernel call; on CUDA one Triton launch
    with the lookup inside the kernel, on the CPU the rows are gathered and the C++ kernel
    runs). The flash-attention / vLLM form: ``cos_table``/``sin_table`` are the whole
    ``(max_positions, rotary_dim // 2)`` tables (e.g. :meth:`ropekit.RotaryEmbedding.tables`)
    and the positions come from ``positions``, from ``offsets`` (an int, or one per sequence:
    a KV cache's lengths), or from ``cu_seqlens`` for variable-length sequences packed into
    ``(tokens, heads, head_dim)``.

    Args:
        q, k: ``(batch, heads, seq, head_dim)`` (``tensor_format="bhsd"``), ``(batch, seq, heads,
            head_dim)`` (``"bshd"``), ``(seq, batch, heads, head_dim)`` (``"sbhd"``), packed
            ``(tokens, heads, head_dim)`` (``"thd"``); any strides; ``k`` may have another head
            count (GQA/MQA). With ``head_size``, vLLM's flat ``(..., heads * head_size)`` q and k
            (e.g. ``(tokens, 32 * 128)``, ``tensor_format="thd"`` naming the unflattened order).
        cos_table, sin_table: float32 ``(max_positions, rotary_dim // 2)``.
        positions: integer ``(seq,)`` or ``(batch, seq)``; with ``cu_seqlens``, ``(tokens,)``.
        offsets: int, or integer ``(batch,)`` tensor (not with ``positions``).
        cu_seqlens: integer ``(batch + 1,)`` sequence boundaries in packed q/k.
        max_seqlen: longest packed sequence (computed when omitted).
        tensor_format: the order of q's and k's axes: ``"bhsd"``, ``"bshd"``, ``"sbhd"`` or ``"thd"``;
            this or ``seq_dim`` is required.
        seq_dim: the sequence (or packed token) axis (``2``, ``1``, ``0``, ``0`` for the formats
            above); both given must agree.
        head_size: channels per head when q and k come flat (vLLM's ``forward(positions, query, key)``).
        layout: ``"half"`` or ``"interleaved"`` (or an alias: ``"neox"``, ``"gptj"``, ...).
        inplace: rotate q and k themselves.
        inverse: rotate by ``-theta``: undoes ``rotate_qk`` at the same positions.
        backend: ``"auto"`` or a name from :func:`ropekit.ops.available`.

    Returns:
        ``(q_rotated, k_rotated)`` with the shapes of q and k; gradients reach q and k (not the tables).

    Raises:
        ValueError: bad shapes, or positions outside the tables (checked before the kernel runs).
    """
    key = None
    if positions is None and cu_seqlens is None and max_seqlen is None and head_size is None:  # one int offset
        key, run = prepared_keys.rotate_qk(q, k, cos_table, sin_table, offsets, tensor_format, seq_dim, layout,
                                           inplace, inverse, backend)  # the layout as given
        if run is not None:
            return run(q, k, cos_table, sin_table, offsets)
    layout = check_layout(layout)
    if head_size is not None:  # vLLM's flat (tokens, heads * head_size) q and k
        q_heads, k_heads = _unflatten_heads(q, head_size, "q"), _unflatten_heads(k, head_size, "k")
        seq_dim = resolve_seq_dim(q_heads.dim(), tensor_format, seq_dim, name="q (heads unflattened)")
        if isinstance(seq_dim, int) and not isinstance(seq_dim, bool) and -q.dim() <= seq_dim < q.dim() - 1:
            seq_dim %= q.dim()
        q_out, k_out = rotate_qk(q_heads, k_heads, cos_table, sin_table, positions=positions, offsets=offsets,
                                 cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, seq_dim=seq_dim, layout=layout,
                                 inplace=inplace, inverse=inverse, backend=backend)
        return (q, k) if inplace else (q_out.flatten(-2), k_out.flatten(-2))
    seq_dim = resolve_seq_dim(getattr(q, "ndim", 0), tensor_format, seq_dim)
    where = check_shapes(q, k, cos_table, sin_table, positions, offsets, cu_seqlens, max_seqlen, seq_dim, layout)
    _by_position_checks(q, k, cos_table, sin_table, inplace,
                        {"positions": positions, "offsets": offsets, "cu_seqlens": cu_seqlens})
    _check_inverse(inverse)
    name = resolve(backend, q.device.type)
    check_runs(backend, name, {"q": q, "k": k})
    if key is not None and operators.direct(q, k, cos_table, sin_table):
        prepared.keep(key, prepared_call(get_backend(name), "prepared_by_offset", (q, k, cos_table, sin_table),
                                         seq_dim=seq_dim, layout=layout, inplace=inplace, conjugate=inverse),
                      (q, k, cos_table, sin_table), cos_table.shape[0], q.shape[qk_axes(q.dim(), seq_dim)[1]])
    return operators.rotate_qk(q, k, cos_table, sin_table, where, layout=layout, backend=name, inplace=inplace,
                               conjugate=inverse)
