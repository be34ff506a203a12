"""The eager backend ``"torch"``: the rotation written with plain PyTorch ops (any device, any float dtype).

The rotation of pair ``(x1, x2)`` by the angle with tables ``(c, s)`` is

    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s                     (conjugate=True uses -s: rotation by -theta)

computed in float32 (float64 for float64 inputs) and rounded once to ``x.dtype``.
Work is done in chunks of the leading dimensions so that the float32 temporaries
stay a few MiB whatever the size of ``x``: in-place rotation allocates nothing of
``x``'s size.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .backend import Backend

CHUNK_ELEMENTS = 1 << 20


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision and float32 inputs, float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def split_pairs(x: torch.Tensor, rotary_dim: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(x1, x2)`` of shape ``(..., rotary_dim // 2)`` on the two members of each pair."""
    half = rotary_dim // 2
    if layout == "half":
        return x[..., :half], x[..., half:rotary_dim]
    pairs = x[..., :rotary_dim].unflatten(-1, (half, 2))
    return pairs[..., 0], pairs[..., 1]


def _leading_chunks(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dest: torch.Tensor, budget: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Split along leading axes into views of at most ``budget`` elements (or one row)."""
    if x.numel() <= budget or x.dim() <= 1:
        yield x, cos, sin, dest
        return
    rows = x.shape[0]
    per_row = max(1, x.numel() // max(rows, 1))
    step = max(1, budget // per_row)
    for start in range(0, rows, step):
        length = min(step, rows - start)
        if length == 1 and per_row > budget:
            yield from _leading_chunks(x[start], _row(cos, start), _row(sin, start), dest[start], budget)
            continue
        yield (
            x.narrow(0, start, length),
            _rows(cos, start, length),
            _rows(sin, start, length),
            dest.narrow(0, start, length),
        )


def _row(table: torch.Tensor, index: int) -> torch.Tensor:
    """Row ``index`` of a table whose first axis is either full or broadcast (size 1)."""
    return table[index] if table.shape[0] != 1 else table[0]


def _rows(table: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Rows ``start : start + length`` of a table whose first axis is either full or broadcast."""
    return table.narrow(0, start, length) if table.shape[0] != 1 else table


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    layout: str,
    conjugate: bool = False,
    inplace: bool = False,
) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` channels of ``x``; see the module docstring.

    Args:
        x: tensor of shape ``(..., head_dim)``.
        cos, sin: tables of shape broadcastable to ``x.shape[:-1] + (rotary_dim // 2,)``,
            already expanded to ``x.dim()`` dimensions by the caller.
        layout: ``"half"`` or ``"interleaved"``.
        conjugate: rotate by ``-theta`` (the backward pass).
        inplace: write into ``x`` and return it; otherwise return a new tensor.

    Returns:
        ``x`` itself (in place) or a new tensor with ``x``'s shape, dtype and strides.
    """
    rotary_dim = 2 * cos.shape[-1]
    work = compute_dtype(x.dtype)
    if inplace:
        dest = x
    else:
        dest = torch.empty_like(x)
        if rotary_dim < x.shape[-1]:
            dest[..., rotary_dim:].copy_(x[..., rotary_dim:])
    for xs, cs, ss, ds in _leading_chunks(x, cos, sin, dest, CHUNK_ELEMENTS):
        x1, x2 = split_pairs(xs, rotary_dim, layout)
        d1, d2 = split_pairs(ds, rotary_dim, layout)
        x1w, x2w = x1.to(work), x2.to(work)
        cw, sw = cs.to(work), ss.to(work)
        if conjugate:
            sw = -sw
        y1 = x1w * cw - x2w * sw
        y2 = x2w * cw + x1w * sw
        d1.copy_(y1)
        d2.copy_(y2)
    return dest


def apply_rotary_differentiable(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, layout: str
) -> torch.Tensor:
    """Out-of-place rotation built from differentiable ops (gradients reach cos/sin too).

    Used when the tables themselves require grad (learned frequencies); slower and
    allocates full-size temporaries.
    """
    rotary_dim = 2 * cos.shape[-1]
    work = torch.promote_types(compute_dtype(x.dtype), cos.dtype)
    x1, x2 = split_pairs(x, rotary_dim, layout)
    c, s = cos.to(work), sin.to(work)
    y1 = x1.to(work) * c - x2.to(work) * s
    y2 = x2.to(work) * c + x1.to(work) * s
    if layout == "half":
        rotated = torch.cat((y1, y2), dim=-1)
    else:
        rotated = torch.stack((y1, y2), dim=-1).flatten(-2)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def full_rank(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` viewed with ``x.dim()`` dims (leading axes of size 1 added: always a view)."""
    lead = x.dim() - cos.dim()
    if lead <= 0:
        return cos, sin
    return cos.view((1,) * lead + tuple(cos.shape)), sin.view((1,) * lead + tuple(sin.shape))


class EagerBackend(Backend):
    """``backend="torch"``: :func:`apply_rotary` on every device; q/k and by-position forms by the defaults."""

    name = "torch"

    def apply_rotary(self, x, cos, sin, *, layout, conjugate, inplace):  # noqa: D102
        cos, sin = full_rank(x, cos, sin)
        return apply_rotary(x, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)
