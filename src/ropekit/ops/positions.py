"""Token positions for the by-position forms: where each token's row of the full tables comes from.

Token ``t`` of sequence ``b`` is rotated by row ``p`` of ``(max_positions, rotary_dim // 2)``
tables: ``p = positions[(b,) t]`` when given, else ``p = offset + offsets[b] + t``; with
``cu_seqlens`` (packed ``(tokens, heads, head_dim)``), ``t`` counts from the start of the
token's own sequence, as in flash-attention's ``apply_rotary_emb``.

:class:`Positions` carries that description through the operators to a backend;
:func:`check_shapes` validates it against q/k (shapes only: traceable), :func:`check_values`
reads the tensors (one device sync) before any kernel runs, and :meth:`Positions.table_rows`
is the eager lookup a backend without a native by-position kernel uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..validation import check_float_tensor, check_layout, full_width_message


def qk_axes(ndim: int, seq_dim: int) -> tuple[int | None, int, int | None]:
    """``(batch_axis, seq_axis, head_axis)`` of a q/k of ``ndim`` dims (None: absent axis).

    The channel axis is last and ``seq_dim`` names the sequence axis; of the other axes
    the later is the head axis and the earlier the batch axis. A lone other axis is the
    batch axis before the sequence axis (``(batch, seq, d)``) and the head axis after it
    (packed ``(tokens, heads, d)``).
    """
    if not 2 <= ndim <= 4:
        raise ValueError(f"q and k must have 2 to 4 dimensions (..., seq, ..., head_dim), got {ndim}")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or not -ndim <= seq_dim < ndim or (
        seq_dim % ndim == ndim - 1
    ):
        raise ValueError(f"seq_dim must name an axis of q/k other than the last, got {seq_dim!r} for {ndim}-D q/k")
    seq = seq_dim % ndim
    others = [axis for axis in range(ndim - 1) if axis != seq]
    if len(others) == 2:
        return others[0], seq, others[1]
    if len(others) == 1:
        return (others[0], seq, None) if others[0] < seq else (None, seq, others[0])
    return None, seq, None


@dataclass(frozen=True)
class Positions:
    """Where each token's table row comes from (see the module docstring).

    ``offsets`` is an integer ``(batch,)`` (or ``(1,)``) tensor and ``offset`` an int added to
    it; ``max_seqlen`` is the longest packed sequence once :func:`check_values` has run.
    """

    positions: Tensor | None
    offsets: Tensor | None
    offset: int
    cu_seqlens: Tensor | None
    max_seqlen: int | None
    seq_dim: int

    def table_rows(self, x: Tensor) -> Tensor:
        """int64 row of each token of ``x``, shaped to broadcast against ``x.shape[:-1]``.

        Per-row positions and offsets are ``(batch, seq)`` whatever the order of x's axes: row
        ``[b, t]`` goes to x's batch index ``b`` and sequence index ``t`` (for ``(seq, batch, heads,
        head_dim)`` x that is a transpose, not a reshape).
        """
        batch_axis, seq_axis, _ = qk_axes(x.dim(), self.seq_dim)
        shape = [1] * (x.dim() - 1)
        shape[seq_axis] = tokens = x.shape[seq_axis]
        steps = torch.arange(tokens, device=x.device)
        if self.positions is not None:
            rows = self.positions.long()
        elif self.cu_seqlens is not None:
            cu = self.cu_seqlens.long()
            seq_id = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=x.device), cu[1:] - cu[:-1])
            rows = steps - cu[seq_id] + self.offset
            if self.offsets is not None:
                rows = rows + self.offsets.long().expand(cu.numel() - 1)[seq_id]
        elif self.offsets is None:
            rows = steps + self.offset
        else:
            rows = self.offsets.long().reshape(-1, 1) + steps + self.offset
        if rows.dim() == 2 and batch_axis is not None:
            shape[batch_axis] = rows.shape[0]
            if batch_axis > seq_axis:  # (seq, batch, ...): rows are (batch, seq), x's axes the other way round
                rows = rows.transpose(0, 1)
        return rows.reshape(shape)


def _check_index_tensor(t: Tensor, name: str, device: torch.device) -> None:
    if not isinstance(t, Tensor) or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def check_tables(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Full ``(max_positions, rotary_dim // 2)`` tables that fit ``x``'s head_dim and device."""
    check_float_tensor(cos, "cos_table")
    check_float_tensor(sin, "sin_table")
    for name, t in (("cos_table", cos), ("sin_table", sin)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but q is on {x.device}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] == 0:
        raise ValueError(
            "cos_table and sin_table must both have shape (max_positions, rotary_dim // 2) with rotary_dim > 0, "
            f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    too_wide = full_width_message(cos.shape[1], x.shape[-1], "cos_table")
    if too_wide is not None:
        raise ValueError(f"rotary_dim = 2 * {cos.shape[1]} exceeds head_dim = {x.shape[-1]}: {too_wide}")


def check_shapes(q: Tensor, k: Tensor | None, cos: Tensor, sin: Tensor, positions, offsets, cu_seqlens,
                 max_seqlen, seq_dim: int, layout: str) -> Positions:
    """Every check that needs only shapes and dtypes; returns the normalized :class:`Positions`."""
    check_float_tensor(q, "q" if k is not None else "x")
    check_layout(layout)
    if k is not None:
        check_float_tensor(k, "k")
        if q.dtype != k.dtype:
            raise TypeError(f"q and k must have one dtype, got {q.dtype} and {k.dtype}")
        if k.device != q.device:
            raise ValueError(f"k is on {k.device} but q is on {q.device}")
        if q.dim() != k.dim() or q.shape[-1] != k.shape[-1]:
            raise ValueError(f"q and k must have the same rank and head_dim, got {tuple(q.shape)} and {tuple(k.shape)}")
    check_tables(q, cos, sin)
    batch_axis, seq_axis, _ = qk_axes(q.dim(), seq_dim)
    for axis in (batch_axis, seq_axis):
        if k is not None and axis is not None and q.shape[axis] != k.shape[axis]:
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
        return Positions(positions, offsets.reshape(-1), 0, cu_seqlens, max_seqlen, seq_dim)
    if isinstance(offsets, bool) or not isinstance(offsets, int):
        raise TypeError(f"offsets must be an int or an integer (batch,) tensor, got {type(offsets).__name__}")
    if offsets < 0:
        raise ValueError(f"offsets must be >= 0 (positions index the tables), got {offsets}")
    if positions is None and cu_seqlens is None and tokens > 0 and offsets + tokens > cos.shape[0]:
        raise ValueError(f"positions (offsets + index) reach {offsets + tokens - 1}, outside the cos/sin tables "
                         f"of {cos.shape[0]} rows")
    return Positions(positions, None, offsets, cu_seqlens, max_seqlen, seq_dim)


def check_values(x: Tensor, table_rows: int, where: Positions) -> Positions:
    """Checks that read the tensors (one device sync); returns ``where`` with ``max_seqlen`` set."""
    stats: dict[str, Tensor] = {}
    lengths = None
    if where.cu_seqlens is not None:
        cu = where.cu_seqlens.long()
        lengths = cu[1:] - cu[:-1]
        stats["first"], stats["last"] = cu[0], cu[-1]
        if lengths.numel():
            stats["shortest"], stats["longest"] = lengths.min(), lengths.max()
    if where.positions is not None:
        if where.positions.numel():
            stats["lo"], stats["hi"] = where.positions.min(), where.positions.max()
    elif where.offsets is not None or lengths is not None:
        offsets = where.offsets
        shift = torch.zeros(1, dtype=torch.long, device=x.device) if offsets is None else offsets.long()
        if lengths is None:
            tokens = x.shape[qk_axes(x.dim(), where.seq_dim)[1]]
            last = where.offset + shift + tokens - 1 if tokens else shift[:0]
        else:
            shift = shift.expand(lengths.numel())
            last = (where.offset + shift + lengths - 1)[lengths > 0]
        if last.numel():
            stats["lo"], stats["hi"] = where.offset + shift.min(), last.max()
    values = torch.stack([t.long().cpu() for t in stats.values()]).tolist() if stats else []
    got = dict(zip(stats, values, strict=True))
    if where.cu_seqlens is not None:
        if got["first"] != 0 or got["last"] != x.shape[0] or got.get("shortest", 0) < 0:
            cu = where.cu_seqlens
            raise ValueError(f"cu_seqlens must start at 0, never decrease and end at the {x.shape[0]} tokens of "
                             f"q/k, got {cu.tolist() if cu.numel() <= 16 else cu}")
        if where.max_seqlen is not None and got.get("longest", 0) > where.max_seqlen:
            raise ValueError(f"max_seqlen={where.max_seqlen} is shorter than the longest sequence ({got['longest']})")
    if "lo" in got and got["lo"] < 0 or "hi" in got and got["hi"] >= table_rows:
        source = "positions" if where.positions is not None else "positions (offsets + index within the sequence)"
        raise ValueError(f"{source} must lie in [0, {table_rows}) of the cos/sin tables, got {got.get('lo')} to "
                         f"{got.get('hi')}")
    if where.cu_seqlens is not None and where.max_seqlen is None:
        return Positions(where.positions, where.offsets, where.offset, where.cu_seqlens, got.get("longest", 0),
                         where.seq_dim)
    return where
