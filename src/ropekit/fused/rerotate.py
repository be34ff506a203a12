"""Moving cached keys: keys rotated at position ``p`` become the keys of ``p + delta``, in place.

A cached key holds ``R(p) k``. Rotations compose, ``R(delta) R(p) = R(p + delta)``, so the key of
position ``p + delta`` is the cached key turned by ``delta``: the unrotated key is not needed. This
is llama.cpp's context shift (``llama_kv_self_seq_add``: the positions of a range of cells move by
``delta`` and their keys are re-rotated), StreamingLLM's attention sinks (the keys of a sliding
window shifted left over the tokens it evicts), and moving a cached prefix to another offset.

- :func:`rerotate_cache`: the keys at chosen positions turned by ``delta`` (one for all, one per
  sequence, or one per key), in a contiguous cache ``(batch, kv_heads, max_length, head_dim)`` /
  ``(batch, max_length, kv_heads, head_dim)`` or a paged one ``(num_blocks, block_size, kv_heads,
  head_dim)`` addressed through a block table;
- :func:`context_shift`: StreamingLLM's step on a contiguous cache: keep ``n_keep`` sink tokens,
  drop the next ``n_discard``, move the rest left and re-rotate their keys by ``-n_discard``.

The rotation by ``delta`` is one rotation in float32 (float64 for float64 caches) by the tables'
row ``|delta|`` (``sin -> -sin`` for a negative ``delta``, exact), float32 from float64 angles, and
one rounding to the cache's dtype; it runs on the backends' ``apply_rotary`` in place, on a view of
the cache where the keys are one run of slots and on gathered rows otherwise.

Precision (``docs/guide.md``, "Moving cached keys"): against rotating the unrotated keys at
``p + delta`` directly, every element is within one ulp of its pair's magnitude
``|(k_i, k_j)|`` in a bfloat16 or float16 cache (the cached key was rounded once already: that
error, up to half an ulp of the pair's larger member, is turned into both members), and within
three ulps of it in a float32 cache (both routes compute in float32 from float32 tables, each
some 1.7 ulps from the exact rotation at worst).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..functional import apply_rotary
from ..ops.dispatch import check_runs, resolve
from ..ops.memory import check_not_shared
from ..rope.frequencies import rotation_angles
from ..validation import check_float_tensor, check_inplace, check_layout
from .cache import slot_mapping

_SEQ_AXIS = {"bhsd": 2, "bshd": 1}  # the contiguous cache orders and their sequence axis


def _check_cache(k_cache: Tensor, name: str = "k_cache") -> None:
    check_float_tensor(k_cache, name)
    if k_cache.dim() != 4:
        raise ValueError(f"{name} must be 4-D (a contiguous (batch, kv_heads, max_length, head_dim) or (batch, "
                         f"max_length, kv_heads, head_dim) cache, or a paged (num_blocks, block_size, kv_heads, "
                         f"head_dim) one), got shape {tuple(k_cache.shape)}")
    check_inplace(k_cache, name)
    if torch.is_grad_enabled() and k_cache.requires_grad:
        raise ValueError(f"{name} requires grad: moving cached keys is a cache write without autograd; call it under "
                         "torch.no_grad() (or pass a detached cache)")


def _seq_axis(tensor_format: str | None, paged: bool) -> int:
    """The sequence axis of a contiguous cache (``"bhsd"`` when None); -1 for a paged cache."""
    if paged:
        if tensor_format is not None:
            raise ValueError(f"tensor_format must be None with block_table: a paged cache is (num_blocks, block_size, "
                             f"kv_heads, head_dim), got tensor_format={tensor_format!r}")
        return -1
    fmt = "bhsd" if tensor_format is None else tensor_format
    if not isinstance(fmt, str) or fmt not in _SEQ_AXIS:
        raise ValueError(f"tensor_format must be 'bhsd' ((batch, kv_heads, max_length, head_dim), the default) or "
                         f"'bshd' ((batch, max_length, kv_heads, head_dim)) for a contiguous cache, got "
                         f"{tensor_format!r}")
    return _SEQ_AXIS[fmt]


def _check_rotation(cos_table: Tensor | None, sin_table: Tensor | None, inv_freq: Tensor | None,
                    k_cache: Tensor) -> int | None:
    """Check the source of the rotation; returns the tables' rows (None: ``inv_freq`` has no limit)."""
    if (cos_table is not None or sin_table is not None) == (inv_freq is not None):
        raise ValueError("pass the rotation as cos_table and sin_table, or as inv_freq: exactly one of the two")
    if inv_freq is not None:
        if not isinstance(inv_freq, Tensor) or not inv_freq.dtype.is_floating_point:
            raise TypeError(f"inv_freq must be a float tensor of shape (rotary_dim // 2,), got "
                            f"{getattr(inv_freq, 'dtype', type(inv_freq).__name__)}")
        if inv_freq.dim() != 1 or inv_freq.numel() == 0:
            raise ValueError(f"inv_freq must have shape (rotary_dim // 2,), got {tuple(inv_freq.shape)}")
        half, rows = inv_freq.numel(), None
    else:
        if cos_table is None or sin_table is None:
            raise ValueError(f"cos_table and sin_table go together, got only "
                             f"{'cos_table' if sin_table is None else 'sin_table'}")
        for name, table in (("cos_table", cos_table), ("sin_table", sin_table)):
            check_float_tensor(table, name)
            if table.dtype not in (torch.float32, torch.float64):
                raise TypeError(f"{name} must be float32 or float64 (tables from float64 angles, as ropekit.cos_sin "
                                f"makes them), got {table.dtype}")
            if table.dim() != 2 or table.shape[0] == 0:
                raise ValueError(f"{name} must have shape (max_positions, rotary_dim // 2) with at least one row, got "
                                 f"{tuple(table.shape)}")
            if table.device != k_cache.device:
                raise ValueError(f"{name} is on {table.device} but k_cache is on {k_cache.device}")
        if cos_table.shape != sin_table.shape:
            raise ValueError(f"cos_table and sin_table must have the same shape, got {tuple(cos_table.shape)} and "
                             f"{tuple(sin_table.shape)}")
        if not (bool((cos_table[0] == 1).all()) and bool((sin_table[0] == 0).all())):
            raise ValueError("cos_table's row 0 is not cos(0) = 1 (or sin_table's not 0): tables that carry an "
                             "attention scale (YaRN, LongRoPE) would scale the keys a second time; re-rotate with "
                             "unscaled tables (ropekit.cos_sin(positions, inv_freq)) or pass inv_freq=")
        half, rows = cos_table.shape[1], cos_table.shape[0]
    if 2 * half > k_cache.shape[-1]:
        raise ValueError(f"rotary_dim = {2 * half} exceeds k_cache's head_dim {k_cache.shape[-1]}")
    return rows


def _integer_tensor(t: object, name: str) -> Tensor:
    if not isinstance(t, Tensor) or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    return t


def _grid(positions: Tensor | None, delta: int | Tensor, batch: int, length: int | None,
          device: torch.device) -> tuple[Tensor, Tensor]:
    """int64 positions ``(1 or batch, n)`` and deltas ``(1 or batch, 1 or n)``, broadcasting to ``(batch, n)``.

    Positions None: every slot ``[0, length)`` of a contiguous cache.
    """
    if positions is None:
        if length is None:
            raise ValueError("positions is required with block_table: the (batch, n) positions of the keys to move")
        pos = torch.arange(length, device=device)
    else:
        pos = _integer_tensor(positions, "positions")
        if pos.device != device:
            raise ValueError(f"positions is on {pos.device} but k_cache is on {device}")
        if pos.dim() not in (1, 2) or (pos.dim() == 2 and pos.shape[0] != batch):
            raise ValueError(f"positions must have shape (n,) (every sequence) or (batch, n) = ({batch}, n), got "
                             f"{tuple(pos.shape)}")
    pos = pos.to(torch.int64).reshape(-1 if pos.dim() == 2 else 1, pos.shape[-1])
    if isinstance(delta, bool) or not isinstance(delta, (int, Tensor)):
        raise TypeError(f"delta must be an int or an integer tensor, got {type(delta).__name__}")
    if isinstance(delta, int):
        if not -2**62 < delta < 2**62:
            raise ValueError(f"delta must lie within +-2**62, got {delta}")
        return pos, torch.full((1, 1), delta, dtype=torch.int64, device=device)
    d = _integer_tensor(delta, "delta")
    if d.device != device:
        raise ValueError(f"delta is on {d.device} but k_cache is on {device}")
    n = pos.shape[1]
    if d.dim() == 0:
        return pos, d.to(torch.int64).reshape(1, 1)
    if d.dim() == 1 and d.shape[0] == batch:
        return pos, d.to(torch.int64)[:, None]
    if d.dim() == 2 and d.shape[0] in (1, batch) and d.shape[1] == n:
        return pos, d.to(torch.int64)
    raise ValueError(f"delta must be an int, or an integer tensor of shape () (every key), (batch,) = ({batch},) (one "
                     f"per sequence) or (batch, n) = ({batch}, {n}) (one per key), got {tuple(d.shape)}")


def _check_moves(pos: Tensor, delta: Tensor, valid: Tensor, rows: int | None, limit: int, where: str) -> None:
    """Raise ValueError unless every key moves to a position in ``[0, limit)`` by a table row it has."""
    new = pos + delta
    pos, delta, valid = pos.expand_as(new), delta.expand_as(new), valid.expand_as(new)
    if int(torch.where(valid, new, 0).min()) < 0:
        b, t = (int(i) for i in ((new < 0) & valid).nonzero()[0])
        raise ValueError(f"delta moves the key at position {int(pos[b, t])} of sequence {b} by {int(delta[b, t])} to "
                         f"{int(new[b, t])}, below 0")
    if int(torch.where(valid, new, -1).max()) >= limit:
        b, t = (int(i) for i in ((new >= limit) & valid).nonzero()[0])
        raise ValueError(f"delta moves the key at position {int(pos[b, t])} of sequence {b} by {int(delta[b, t])} to "
                         f"{int(new[b, t])}, past {where}")
    if rows is not None:
        far = int(torch.where(valid, delta.abs(), 0).max())
        if far >= rows:
            raise ValueError(f"delta of magnitude {far} needs row {far} of cos_table, which has {rows} rows")


def _rotation(delta: Tensor, cos_table: Tensor | None, sin_table: Tensor | None, inv_freq: Tensor | None,
              dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` of ``delta * theta``, ``delta.shape + (rotary_dim // 2,)``, float32 (float64 caches: float64).

    Row ``|delta|`` of the tables, or the float64 angles of ``|delta|`` rounded once; the sign of
    ``delta`` multiplies sin (exact).
    """
    work = torch.float64 if dtype == torch.float64 else torch.float32
    steps = delta.abs().reshape(-1)
    if cos_table is not None:
        cos, sin = cos_table.index_select(0, steps).to(work), sin_table.index_select(0, steps).to(work)
    else:
        angles = rotation_angles(steps, inv_freq)
        cos, sin = torch.cos(angles).to(work).to(delta.device), torch.sin(angles).to(work).to(delta.device)
    sin = sin * torch.sign(delta).reshape(-1, 1).to(work)
    return cos.reshape(*delta.shape, -1), sin.reshape(*delta.shape, -1)


def _one_run(pos: Tensor) -> int | None:
    """The first position when every sequence moves one run ``p0, p0 + 1, ...`` of slots (no padding), else None."""
    if pos.shape[0] != 1 or pos.shape[1] == 0 or int(pos[0, 0]) < 0:
        return None
    first = int(pos[0, 0])
    return first if bool((pos[0] == torch.arange(first, first + pos.shape[1], device=pos.device)).all()) else None


def rerotate_cache(
    k_cache: Tensor,
    delta: int | Tensor,
    *,
    cos_table: Tensor | None = None,
    sin_table: Tensor | None = None,
    inv_freq: Tensor | None = None,
    positions: Tensor | None = None,
    tensor_format: str | None = None,
    block_table: Tensor | None = None,
    layout: str = "half",
    backend: str = "auto",
) -> Tensor:
    r"""Turn cached keys rotated at position ``p`` into the keys of position ``p + delta``, in place.

    Per rotary pair of each key moved: :math:`y = R(\delta\theta)\,x`, i.e.
    ``y1 = x1 c - x2 s, y2 = x2 c + x1 s`` with ``(c, s)`` the tables' row ``|delta|`` (``s``
    negated for ``delta < 0``), in float32, rounded once to the cache's dtype. Since
    ``R(delta) R(p) = R(p + delta)`` the result is the key rotated at ``p + delta``, up to the
    rounding the module docstring bounds (:mod:`ropekit.fused.rerotate`).

    Args:
        k_cache: the keys, rotated, written in place: contiguous ``(batch, kv_heads, max_length,
            head_dim)`` (``tensor_format="bhsd"``, the default) or ``(batch, max_length, kv_heads,
            head_dim)`` (``"bshd"``), the key of position ``p`` in slot ``p``; or paged
            ``(num_blocks, block_size, kv_heads, head_dim)`` with ``block_table``. Any float dtype.
        delta: how far each key moves: an int (every key), or an integer tensor of shape ``()``,
            ``(batch,)`` (one per sequence) or ``(batch, n)`` / ``(1, n)`` (one per key of ``positions``).
        cos_table, sin_table: float32 (or float64) ``(max_positions, rotary_dim // 2)`` tables
            without an attention scale (row 0 must be ``cos = 1, sin = 0``), e.g.
            :meth:`ropekit.RotaryEmbedding.tables` of a plain-RoPE module or :func:`ropekit.cos_sin`
            of ``arange(max_positions)``; every new position must be below ``max_positions``.
        inv_freq: instead of the tables, the ``(rotary_dim // 2,)`` frequencies (float64 from
            :func:`ropekit.inv_frequencies`); every new position must then lie in the cache
            (below ``max_length``; paged: below ``block_table.shape[1] * block_size``).
        positions: the current positions of the keys to move, integer ``(n,)`` (every sequence) or
            ``(batch, n)``; negative entries are padding (skipped). Default (contiguous only):
            every slot ``0 .. max_length - 1``.
        tensor_format: ``"bhsd"`` or ``"bshd"`` for a contiguous cache; None with ``block_table``.
        block_table: paged caches: integer ``(batch, max_blocks)``, the blocks of each sequence in
            order (vLLM's); the key of position ``p`` of sequence ``b`` is at slot
            :func:`ropekit.slot_mapping` ``(block_table, positions, block_size)``.
        layout: ``"half"`` or ``"interleaved"``: the pairing the keys were rotated with.
        backend: ``"auto"`` or a name from :func:`ropekit.ops.available`.

    Returns:
        ``k_cache`` (its keys moved). The keys of one run of slots shared by every sequence (the
        default, or ``positions=arange(p0, p1)``) are turned in place through a view; other
        positions are gathered, turned and written back. Positions and deltas are read back
        (one device synchronisation) and checked before anything is written.

    Raises:
        ValueError: a new position below 0 or past the tables (``inv_freq``: past the cache), a
            position outside the cache or listed twice (paged: two keys at one slot), shapes or
            devices that do not fit, tables with an attention scale, ``k_cache`` sharing memory
            with another argument or requiring grad.
        TypeError: non-integer ``delta``, ``positions`` or ``block_table``; tables other than
            float32/float64; a non-float cache.
    """
    layout = check_layout(layout)
    _check_cache(k_cache)
    paged = block_table is not None
    seq_axis = _seq_axis(tensor_format, paged)
    rows = _check_rotation(cos_table, sin_table, inv_freq, k_cache)
    check_not_shared({"k_cache": k_cache}, {"cos_table": cos_table, "sin_table": sin_table, "inv_freq": inv_freq,
                                            "delta": delta, "positions": positions, "block_table": block_table},
                     "rerotate_cache")
    name = resolve(backend, k_cache.device.type)
    check_runs(backend, name, {"k_cache": k_cache})
    if paged:
        block_table = _integer_tensor(block_table, "block_table")
        if block_table.device != k_cache.device:
            raise ValueError(f"block_table is on {block_table.device} but k_cache is on {k_cache.device}")
        if block_table.dim() != 2:
            raise ValueError(f"block_table must be (batch, max_blocks), got shape {tuple(block_table.shape)}")
        batch, block_size = block_table.shape[0], k_cache.shape[1]
        pos, delta = _grid(positions, delta, batch, None, k_cache.device)
        capacity = block_table.shape[1] * block_size
        where = (f"the tables (cos_table has {rows} rows)" if rows is not None else
                 f"the cache (block_table addresses {capacity} positions per sequence)")
    else:
        batch, length = k_cache.shape[0], k_cache.shape[seq_axis]
        pos, delta = _grid(positions, delta, batch, length, k_cache.device)
        where = (f"the tables (cos_table has {rows} rows)" if rows is not None else
                 f"the cache (k_cache holds {length} positions)")
        capacity = length
    valid = pos >= 0
    if not bool(valid.any()):
        return k_cache
    first = None
    if paged:
        slots = slot_mapping(block_table, pos.expand(batch, -1), block_size)  # negative positions: -1
        _check_unique(slots[slots >= 0], k_cache.shape[0] * block_size, "block_table")
    else:
        top = int(pos.max())
        if top >= length:
            raise ValueError(f"positions must be slots of k_cache, below its max_length {length}, got {top}")
        first = 0 if positions is None else _one_run(pos)
        if first is None:  # a run is listed once; other positions are checked
            rows_of = torch.arange(pos.shape[0], device=pos.device)[:, None] * length + pos
            _check_unique(rows_of[valid], None, "positions")
    _check_moves(pos, delta, valid, rows, rows if rows is not None else capacity, where)
    options = dict(layout=layout, inplace=True, backend=name)
    if first is not None:  # one run of slots: a view of the cache, turned in place
        view = k_cache.narrow(seq_axis, first, pos.shape[1])
        cos, sin = _rotation(delta, cos_table, sin_table, inv_freq, k_cache.dtype)  # (1 or batch, 1 or n, half)
        if delta.shape[1] == 1 or seq_axis == 1:  # one per sequence (or for all), or bshd: (., n or 1, 1, half)
            cos, sin = cos[:, :, None], sin[:, :, None]
        else:  # one per key of a bhsd view: (., 1, n, half)
            cos, sin = cos[:, None], sin[:, None]
        apply_rotary(view, cos, sin, **options)
        return k_cache
    valid = valid.expand(batch, -1)
    moved = delta.expand(batch, pos.shape[1])[valid] if delta.numel() > 1 else delta.reshape(1)
    cos, sin = _rotation(moved, cos_table, sin_table, inv_freq, k_cache.dtype)
    cos, sin = cos[:, None], sin[:, None]  # (keys or 1, 1, half) against the gathered (keys, kv_heads, head_dim)
    if paged:
        _move_rows(k_cache, slots[slots >= 0], block_size, cos, sin, options)
        return k_cache
    index = valid.nonzero(as_tuple=True)[0], pos.expand(batch, -1)[valid]
    if seq_axis == 2:
        index = (index[0], slice(None), index[1])
    keys = k_cache[index]  # gathered (keys, kv_heads, head_dim)
    k_cache[index] = apply_rotary(keys, cos, sin, **options)
    return k_cache


def _move_rows(k_cache: Tensor, slots: Tensor, block_size: int, cos: Tensor, sin: Tensor, options: dict) -> None:
    """Turn the keys of a paged cache at ``slots``: gathered, rotated in place, written back.

    Through a ``(num_blocks * block_size, kv_heads, head_dim)`` view with ``index_select`` /
    ``index_copy_`` where the blocks' axes merge (a contiguous cache: about twice as fast as
    indexing by block and row), else by block and row.
    """
    try:
        rows = k_cache.view(-1, *k_cache.shape[2:])
    except RuntimeError:  # blocks whose axes do not merge into one
        index = (slots // block_size, slots % block_size)
        k_cache[index] = apply_rotary(k_cache[index], cos, sin, **options)
        return
    rows.index_copy_(0, slots, apply_rotary(rows.index_select(0, slots), cos, sin, **options))


def _check_unique(slots: Tensor, capacity: int | None, name: str) -> None:
    """Raise ValueError when a slot is listed twice (it would be turned once), or lies past ``capacity``."""
    if capacity is not None and slots.numel() and int(slots.max()) >= capacity:
        raise ValueError(f"{name} addresses slot {int(slots.max())}, past a cache of {capacity} slots")
    if slots.unique().numel() != slots.numel():
        what = ("positions repeat, or two sequences share a block (a shared prefix cannot move for one sequence "
                "alone)" if name == "block_table" else "a position is listed twice for one sequence")
        raise ValueError(f"{name}: two keys to move live in one slot ({what}); each key must be moved once")


def context_shift(
    k_cache: Tensor,
    v_cache: Tensor,
    n_keep: int,
    n_discard: int,
    *,
    lengths: int | Tensor,
    cos_table: Tensor | None = None,
    sin_table: Tensor | None = None,
    inv_freq: Tensor | None = None,
    tensor_format: str | None = None,
    layout: str = "half",
    backend: str = "auto",
) -> int | Tensor:
    """StreamingLLM's / llama.cpp's context shift on a contiguous cache: drop tokens, move the rest left.

    For each sequence of ``L`` cached tokens: the first ``n_keep`` (attention sinks) stay; the
    next ``n_discard`` are dropped; the tokens at ``[n_keep + n_discard, L)`` move to ``[n_keep,
    L - n_discard)``, their keys re-rotated by ``-n_discard`` (as :func:`rerotate_cache` does) and
    their values copied. Slots from ``L - n_discard`` on keep stale entries past the new length.

    Args:
        k_cache, v_cache: ``(batch, kv_heads, max_length, head_dim)`` (``tensor_format="bhsd"``,
            the default) or ``(batch, max_length, kv_heads, head_dim)`` (``"bshd"``), the key of
            position ``p`` in slot ``p``; written in place. ``v_cache`` may have another head_dim.
        n_keep: sink tokens kept at the front (an int >= 0).
        n_discard: tokens dropped after them (an int >= 0).
        lengths: the tokens each sequence holds: an int (every sequence) or an integer ``(batch,)``
            tensor; each at least ``n_keep + n_discard`` and at most ``max_length``.
        cos_table, sin_table, inv_freq, layout, backend: as for :func:`rerotate_cache` (the tables
            must have more than ``n_discard`` rows).
        tensor_format: ``"bhsd"`` or ``"bshd"``.

    Returns:
        The new lengths, ``lengths - n_discard`` (an int, or a tensor like ``lengths``).

    Raises:
        ValueError: a length below ``n_keep + n_discard`` or past the cache, negative counts, caches
            of different geometry or sharing memory, tables as :func:`rerotate_cache` refuses them.
    """
    layout = check_layout(layout)
    _check_cache(k_cache)
    _check_cache(v_cache, "v_cache")
    seq_axis = _seq_axis(tensor_format, False)
    if k_cache.shape[:-1] != v_cache.shape[:-1] or k_cache.device != v_cache.device:
        raise ValueError(f"k_cache and v_cache must hold the same sequences on one device, got shapes "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)} on {k_cache.device} and {v_cache.device}")
    for name, count in (("n_keep", n_keep), ("n_discard", n_discard)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{name} must be an int >= 0, got {count!r}")
    rows = _check_rotation(cos_table, sin_table, inv_freq, k_cache)
    check_not_shared({"k_cache": k_cache, "v_cache": v_cache},
                     {"cos_table": cos_table, "sin_table": sin_table, "inv_freq": inv_freq, "lengths": lengths},
                     "context_shift")
    name = resolve(backend, k_cache.device.type)
    check_runs(backend, name, {"k_cache": k_cache, "v_cache": v_cache})
    batch, length = k_cache.shape[0], k_cache.shape[seq_axis]
    if isinstance(lengths, bool) or not isinstance(lengths, (int, Tensor)):
        raise TypeError(f"lengths must be an int or an integer (batch,) tensor, got {type(lengths).__name__}")
    if isinstance(lengths, Tensor):
        _integer_tensor(lengths, "lengths")
        if tuple(lengths.shape) != (batch,):
            raise ValueError(f"lengths must have shape (batch,) = ({batch},), got {tuple(lengths.shape)}")
        each = [int(n) for n in lengths.tolist()]
    else:
        each = [lengths] * batch
    for b, n in enumerate(each):
        if not n_keep + n_discard <= n <= length:
            raise ValueError(f"lengths: sequence {b} holds {n} tokens; a shift that keeps {n_keep} and drops "
                             f"{n_discard} needs at least {n_keep + n_discard}, and the cache holds at most {length}")
    if rows is not None and n_discard >= rows:
        raise ValueError(f"n_discard = {n_discard} needs row {n_discard} of cos_table, which has {rows} rows")
    if n_discard == 0:
        return lengths
    steps = torch.tensor([n_discard], device=k_cache.device)
    cos, sin = _rotation(steps, cos_table, sin_table, inv_freq, k_cache.dtype)  # (1, half): by +n_discard
    # the rotation by -n_discard is the inverse of the rotation by +n_discard (the same bits as sin -> -sin)
    options = dict(layout=layout, inverse=True, backend=name)
    runs = [(slice(None), each[0])] if isinstance(lengths, int) else [(b, n) for b, n in enumerate(each)]
    axis = seq_axis if isinstance(lengths, int) else seq_axis - 1
    for b, n in runs:
        moved = n - n_keep - n_discard
        if moved == 0:
            continue
        k_seq, v_seq = k_cache[b], v_cache[b]
        keys = apply_rotary(k_seq.narrow(axis, n_keep + n_discard, moved), cos, sin, **options)  # a new tensor
        k_seq.narrow(axis, n_keep, moved).copy_(keys)
        v_seq.narrow(axis, n_keep, moved).copy_(v_seq.narrow(axis, n_keep + n_discard, moved).clone())
    return lengths - n_discard
