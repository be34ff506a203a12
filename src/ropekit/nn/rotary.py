"""``RotaryEmbedding``: cached cos/sin tables plus the apply, as a ``torch.nn.Module``."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from .._deprecation import deprecated_method
from ..config.rules import inv_frequencies
from ..functional import apply_rotary, apply_rotary_qk, rotate, rotate_qk
from ..ops import prepared, prepared_keys
from ..ops.positions import qk_axes
from ..rope.frequencies import cos_sin
from ..validation import (
    TENSOR_FORMATS,
    check_even_positive,
    check_layout,
    check_positions,
    check_positive_float,
    format_hint,
    is_dtensor,
    resolve_seq_dim,
    spell_format,
)

_MIN_TABLE = 256
# The cached tables never grow past this many rows (32 MiB at rotary_dim 128); rows of farther
# positions are computed for the tokens that need them, so no position id can make the module
# allocate more than the tokens it rotates.
MAX_CACHED_POSITIONS = 1 << 16
# Every change of a module's tables, or of an attribute a call depends on (_CALL_STATE), takes a
# new number from here: the signature of a prepared call holds it, so a call prepared for other
# tables or options is never found (a copy of a module shares the number only while nothing of it
# has changed since).
_TABLE_VERSIONS = itertools.count()
_CALL_STATE = frozenset(("layout", "backend", "head_dim", "max_cached_positions", "scaling"))


def position_batch_axis(ndim: int, seq_axis: int) -> int | None:
    """The axis of x that the batch of ``(batch, seq)`` positions goes with (None: x has none).

    For 2- to 4-D x the axis :func:`ropekit.rotate` takes (``(seq, batch, heads, head_dim)``
    puts it after the sequence axis); for more dims axis 0, which must precede the sequence axis.
    """
    if 2 <= ndim <= 4:
        return qk_axes(ndim, seq_axis)[0]
    return 0 if seq_axis > 0 else None


def against_x(x: torch.Tensor, values: torch.Tensor, seq_axis: int) -> torch.Tensor:
    """Per-token ``values`` ``(seq, c)`` or ``(batch, seq, c)`` viewed with ``x.dim()`` dims to broadcast against x.

    The sequence goes on ``seq_axis``, the batch on :func:`position_batch_axis` (transposed
    when that axis comes after the sequence axis), ``c`` on the last axis.
    """
    view = [1] * x.dim()
    view[seq_axis] = x.shape[seq_axis]
    view[-1] = values.shape[-1]
    if values.dim() == 3:
        batch_axis = position_batch_axis(x.dim(), seq_axis)
        view[batch_axis] = values.shape[0]
        if batch_axis > seq_axis:
            values = values.transpose(0, 1)
    return values.reshape(view)


def order_of(q: Any, k: Any, positions: Any, tensor_format: str | None, seq_dim: int | None) -> int:
    """The sequence axis of a module call: named by ``tensor_format`` or ``seq_dim``, else ``-2`` (``"bhsd"``).

    When the caller named neither, the default is checked against what the call itself shows, and
    a call that contradicts it raises a ``ValueError`` that names the format that would fit:

    - ``positions`` of ``n`` tokens where q has another length on axis -2 (e.g. a
      ``(batch, seq, heads, head_dim)`` q with ``(seq,)`` positions, ``heads != seq``);
    - ``k`` whose length on axis -2 differs from q's (a ``(batch, seq, heads, head_dim)`` q and
      k with different head counts: GQA in flash-attention's order).

    A ``(batch, seq, heads, head_dim)`` q and k with as many heads as each other and no positions
    cannot be told from ``(batch, heads, seq, head_dim)``: such a caller must pass
    ``tensor_format="bshd"``.
    """
    ndim = getattr(q, "ndim", 0)
    if tensor_format is not None or seq_dim is not None:
        return resolve_seq_dim(ndim, tensor_format, seq_dim)
    if ndim < 2:
        return -2
    default = "(the default, 'bhsd' order)" if ndim == 4 else "(the default)"
    if isinstance(positions, torch.Tensor) and positions.dim() in (1, 2) and positions.shape[-1] != q.shape[-2]:
        raise ValueError(
            f"positions cover {positions.shape[-1]} tokens but q of shape {tuple(q.shape)} has {q.shape[-2]} along "
            f"seq_dim=-2 {default}{format_hint(q.shape, positions.shape[-1])}; name the order with tensor_format= "
            f"({', '.join(TENSOR_FORMATS)}) or seq_dim="
        )
    if isinstance(k, torch.Tensor) and k.dim() == ndim and ndim >= 2 and k.shape[-2] != q.shape[-2]:
        fits = [f for f, (n, axis) in TENSOR_FORMATS.items() if n == ndim and q.shape[axis] == k.shape[axis]]
        hint = "".join(f"; if they are {spell_format(f)} pass tensor_format={f!r}" for f in fits)
        raise ValueError(
            f"q and k must have the same length along seq_dim=-2 {default}, got {q.shape[-2]} and {k.shape[-2]} "
            f"(q {tuple(q.shape)}, k {tuple(k.shape)}){hint}"
        )
    return -2


def _round_up_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _rule_length(needed: int, seq_len: int | None) -> int:
    """The length a dynamic scaling rule decides from: ``seq_len`` if given, else one past the largest position."""
    if seq_len is None:
        return needed
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise TypeError(f"seq_len must be None or an int >= 1, got {type(seq_len).__name__} {seq_len!r}")
    if seq_len < needed:
        raise ValueError(
            f"seq_len (the length of the whole sequence, which the scaling rule decides from) must exceed every "
            f"position: got seq_len={seq_len} but a position of {needed - 1}; pass the global length, not a shard's"
        )
    return seq_len


class RotaryEmbedding(nn.Module):
    """Rotary position embedding for queries and keys.

    Args:
        head_dim: channels per attention head (even).
        base: RoPE base (``rope_theta``), default 10000.
        rotary_dim: rotated channels per head (even, ``<= head_dim``); default ``head_dim``.
            Channels past it are left untouched (partial rotary, e.g. GPT-NeoX 25%).
        layout: ``"half"`` (HF / GPT-NeoX, default) or ``"interleaved"`` (RoFormer / Meta).
        scaling: ``None`` or a rule from :mod:`ropekit.scaling`.
        backend: ``"auto"`` or a name from :func:`ropekit.ops.available`.
        max_cached_positions: the cached tables hold at most this many rows (default
            :data:`MAX_CACHED_POSITIONS` = 65536); tokens at farther positions get rows computed
            for them alone, bit-identical to cached ones (0 caches nothing).

    The cos/sin tables are float32, computed from float64 angles, cached per device
    and grown on demand up to ``max_cached_positions`` rows. They are not buffers:
    ``module.to(torch.bfloat16)`` cannot downcast them.

    Shapes in :meth:`forward`: ``tensor_format`` names the order of q's and k's axes
    (``"bhsd"``, ``"bshd"``, ``"sbhd"``, ``"thd"``; or ``seq_dim`` the sequence axis, for
    other ranks). Naming neither means ``(batch, heads, seq, head_dim)`` (``"bhsd"``, axis
    ``-2``), and a call that contradicts it raises (see :func:`order_of`). ``k`` may have a
    different number of heads (GQA / MQA).

    The module honours :class:`ropekit.nn.RotaryModule`.
    """

    def __init__(
        self,
        head_dim: int,
        *,
        base: float = 10000.0,
        rotary_dim: int | None = None,
        layout: str = "half",
        scaling: Any = None,
        backend: str = "auto",
        max_cached_positions: int = MAX_CACHED_POSITIONS,
    ) -> None:
        super().__init__()
        self.head_dim = check_even_positive(head_dim, "head_dim")
        self.rotary_dim = head_dim if rotary_dim is None else check_even_positive(rotary_dim, "rotary_dim")
        if self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim ({self.rotary_dim}) must not exceed head_dim ({self.head_dim})")
        self.base = check_positive_float(base, "base")
        self.layout = check_layout(layout)
        self.scaling = scaling
        self.backend = backend
        if isinstance(max_cached_positions, bool) or not isinstance(max_cached_positions, int) or (
            max_cached_positions < 0
        ):
            raise ValueError(f"max_cached_positions must be an int >= 0, got {max_cached_positions!r}")
        self.max_cached_positions = max_cached_positions
        self.inv_freq, self.attention_scale = inv_frequencies(self.rotary_dim, self.base, scaling)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._dynamic_seq_len: int | None = None

    def extra_repr(self) -> str:
        """The constructor arguments shown by ``repr(module)``."""
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base:g}, "
            f"layout={self.layout!r}, scaling={self.scaling!r}"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        """Set an attribute; one a call depends on (layout, backend, ...) also retires the calls prepared before."""
        super().__setattr__(name, value)
        if name in _CALL_STATE:
            super().__setattr__("_table_version", next(_TABLE_VERSIONS))

    # -- tables -----------------------------------------------------------------------------
    def _refresh_dynamic(self, seq_len: int) -> None:
        """Dynamic rules recompute the frequencies when the sequence length changes."""
        if not getattr(self.scaling, "dynamic", False) or seq_len == self._dynamic_seq_len:
            return
        inv_freq, scale = inv_frequencies(self.rotary_dim, self.base, self.scaling, seq_len=seq_len)
        self._dynamic_seq_len = seq_len
        if scale == self.attention_scale and torch.equal(inv_freq, self.inv_freq):
            return  # inside the original length the frequencies do not move: keep the tables
        self.inv_freq, self.attention_scale = inv_freq, scale
        self._tables.clear()
        self._table_version = next(_TABLE_VERSIONS)

    def tables(self, length: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(cos, sin)`` of shape ``(n, rotary_dim // 2)`` with ``n >= length``, on ``device``.

        Cached (and grown by doubling) up to ``max_cached_positions`` rows; a longer request is
        computed for this call alone.
        """
        device = torch.device(device)
        cached = self._tables.get(device)
        if cached is not None and cached[0].shape[0] >= length:
            return cached
        if length > self.max_cached_positions:
            return cos_sin(torch.arange(length, device=device), self.inv_freq, attention_scale=self.attention_scale)
        size = max(_round_up_pow2(length), _MIN_TABLE)
        if cached is not None:
            size = max(size, 2 * cached[0].shape[0])
        size = min(size, self.max_cached_positions)
        cached = cos_sin(torch.arange(size, device=device), self.inv_freq, attention_scale=self.attention_scale)
        self._tables[device] = cached
        self._table_version = next(_TABLE_VERSIONS)
        return cached

    def cos_sin(
        self, positions: torch.Tensor, *, seq_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered float32 tables of shape ``positions.shape + (rotary_dim // 2,)``.

        ``seq_len``: the length a dynamic scaling rule decides from (see :meth:`forward`).
        """
        check_positions(positions)
        needed = int(positions.max()) + 1 if positions.numel() else 0
        return self._gather(positions, needed, seq_len)

    def _gather(
        self, positions: torch.Tensor, needed: int, seq_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables at ``positions`` (already validated), whose largest entry is ``needed - 1``."""
        rule_length = _rule_length(needed, seq_len)
        if positions.numel() == 0:
            empty = torch.empty(*positions.shape, self.rotary_dim // 2, device=positions.device)
            return empty, empty.clone()
        self._refresh_dynamic(rule_length)
        if needed > self.max_cached_positions:  # far positions: their rows alone (same values as cached rows)
            return cos_sin(positions, self.inv_freq, attention_scale=self.attention_scale)
        cos, sin = self.tables(needed, positions.device)
        # index with int64: uint8 indices would act as a boolean mask, int8/int16 are rejected
        index = positions.to(torch.int64)
        return cos[index], sin[index]

    # -- apply ------------------------------------------------------------------------------
    def _positions(
        self, seq: int, positions: torch.Tensor | None, offset: Any, device: torch.device
    ) -> tuple[torch.Tensor, int]:
        """Positions of shape ``(seq,)`` or ``(batch, seq)`` and one past their largest value.

        The default ``offset + arange(seq)`` with an int offset needs no device synchronisation.
        """
        if positions is not None:
            if not (isinstance(offset, int) and offset == 0):
                raise ValueError("pass either positions or offset, not both (offset shifts the default arange)")
            check_positions(positions)
            if positions.dim() not in (1, 2) or positions.shape[-1] != seq:
                raise ValueError(
                    f"positions must have shape (seq,) or (batch, seq) with seq={seq}, got {tuple(positions.shape)}"
                )
            return positions.to(device), (int(positions.max()) + 1 if positions.numel() else 0)
        steps = torch.arange(seq, device=device)
        if isinstance(offset, torch.Tensor):
            check_positions(offset, "offset")
            if offset.dim() > 1:
                raise ValueError(f"offset must be an int or a (batch,) tensor, got shape {tuple(offset.shape)}")
            shifted = offset.to(device).reshape(-1, 1) + steps if offset.dim() == 1 else offset.to(device) + steps
            return shifted, (int(offset.max()) + seq if offset.numel() and seq else 0)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be a non-negative int or a (batch,) integer tensor, got {offset!r}")
        return steps + offset, offset + seq

    def _checked_positions(
        self, x: torch.Tensor, positions: torch.Tensor | None, offset: Any, seq_dim: int
    ) -> tuple[int, torch.Tensor, int]:
        """Validate ``x`` against this module: ``(sequence axis, positions, one past the largest)``.

        The positions are ``(seq,)`` or ``(batch, seq)`` (see :meth:`_positions`).
        """
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise ValueError(f"x must be a tensor with a sequence and a channel axis, got {getattr(x, 'shape', x)}")
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"x has head_dim {x.shape[-1]}, this RotaryEmbedding was built for {self.head_dim}")
        ndim = x.dim()
        if not isinstance(seq_dim, int) or not -ndim <= seq_dim < ndim - 1 or seq_dim % ndim == ndim - 1:
            raise ValueError(f"seq_dim must name an axis of x other than the last, got {seq_dim} for {ndim}-D x")
        axis = seq_dim % ndim
        pos, needed = self._positions(x.shape[axis], positions, offset, x.device)
        if pos.dim() == 2:
            batch_axis = position_batch_axis(ndim, axis)
            if batch_axis is None:
                raise ValueError(f"batched positions (batch, seq) need a batch axis in x, and x of shape "
                                 f"{tuple(x.shape)} with seq_dim={seq_dim} has none")
            if pos.shape[0] not in (1, x.shape[batch_axis]):
                raise ValueError(f"positions has batch {pos.shape[0]} but x has batch {x.shape[batch_axis]} "
                                 f"(axis {batch_axis})")
        return axis, pos, needed

    def _broadcast_tables(
        self, x: torch.Tensor, positions: torch.Tensor | None, offset: Any, seq_dim: int, seq_len: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate ``x`` and return cos/sin viewed with ``x.dim()`` dimensions for :func:`apply_rotary`."""
        axis, pos, needed = self._checked_positions(x, positions, offset, seq_dim)
        cos, sin = self._gather(pos, needed, seq_len)
        return against_x(x, cos, axis), against_x(x, sin, axis)

    def _table_rows(
        self, x: torch.Tensor, positions: torch.Tensor | None, offset: Any, seq_dim: int, seq_len: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Validate ``x`` and name its tokens' rows: ``(cos_table, sin_table, position keywords)``.

        The keywords (``positions``/``offsets``) index the cached tables, or, past
        ``max_cached_positions``, tables computed for these tokens alone.
        """
        _, pos, needed = self._checked_positions(x, positions, offset, seq_dim)
        self._refresh_dynamic(_rule_length(needed, seq_len))
        if needed > self.max_cached_positions:
            cos, sin = cos_sin(pos, self.inv_freq, attention_scale=self.attention_scale)
            rows = torch.arange(pos.numel(), device=x.device).reshape(pos.shape)
            return cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1]), {"positions": rows}
        cos, sin = self.tables(max(needed, 1), x.device)
        if positions is not None:
            return cos, sin, {"positions": pos}
        if isinstance(offset, torch.Tensor):
            return cos, sin, {"offsets": offset.to(x.device).reshape(-1)}
        return cos, sin, {"offsets": offset}

    def rotate_one(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        offset: int | torch.Tensor = 0,
        tensor_format: str | None = None,
        seq_dim: int | None = None,
        inplace: bool = False,
        inverse: bool = False,
        seq_len: int | None = None,
        shard_scheme: str | None = None,
    ) -> torch.Tensor:
        """Rotate one tensor ``x`` (a query or a key) by its tokens' positions; arguments as in :meth:`forward`.

        The module's form of :meth:`forward` for one tensor (``forward(q, None)`` calls it); the
        functional forms are :func:`ropekit.rotate` (by position) and :func:`ropekit.apply_rotary`.
        """
        seq_dim = order_of(x, None, positions, tensor_format, seq_dim)
        if is_dtensor(x) or shard_scheme is not None:
            return self._forward_dtensor(x, None, positions, offset, seq_dim, inplace, seq_len, shard_scheme,
                                         inverse)[0]
        if isinstance(x, torch.Tensor) and 2 <= x.dim() <= 4:
            cos, sin, where = self._table_rows(x, positions, offset, seq_dim, seq_len)
            return rotate(x, cos, sin, **where, seq_dim=seq_dim, layout=self.layout, inplace=inplace, inverse=inverse,
                          backend=self.backend)
        cos, sin = self._broadcast_tables(x, positions, offset, seq_dim, seq_len)
        return apply_rotary(x, cos, sin, layout=self.layout, inplace=inplace, inverse=inverse, backend=self.backend)

    rotate = deprecated_method("rotate_one", "ropekit.RotaryEmbedding.rotate", "ropekit.RotaryEmbedding.rotate_one")

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        positions: torch.Tensor | None = None,
        *,
        offset: int | torch.Tensor = 0,
        tensor_format: str | None = None,
        seq_dim: int | None = None,
        inplace: bool = False,
        inverse: bool = False,
        seq_len: int | None = None,
        shard_scheme: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotate queries and keys (or, with ``inverse=True``, undo their rotation).

        Args:
            q: queries, ``(batch, heads, seq, head_dim)`` by default (see ``tensor_format``); any
                float dtype.
            k: keys with the same sequence length (any head count), or ``None``.
            positions: integer token positions, ``(seq,)`` or ``(batch, seq)`` for padded or
                packed batches and KV-cache decoding; default ``offset + arange(seq)``.
            offset: shift of the default positions: an int, or a ``(batch,)`` tensor of
                per-sequence offsets.
            tensor_format: the order of q's and k's axes: ``"bhsd"`` (transformers), ``"bshd"``
                (flash-attention), ``"sbhd"`` (Megatron), ``"thd"`` (packed ``(tokens, heads,
                head_dim)``, positions ``(tokens,)``). Default: ``"bhsd"``, checked (see
                :func:`order_of`; a ``(batch, seq, heads, head_dim)`` call must say so).
            seq_dim: the sequence axis, the low-level spelling (``-2`` for ``"bhsd"``, ``-3`` for
                ``"bshd"``, ``0`` for ``"sbhd"`` and ``"thd"``; any rank); both given must agree.
            inplace: rotate ``q`` and ``k`` in place.
            inverse: rotate by ``-theta`` at the same positions: undoes a forward call
                (``forward(*forward(q, k), inverse=True)`` gives q and k back up to rounding), e.g.
                to de-rotate an attention output (DeepSeek-V4). Gradients are the rotation by ``+theta``.
            seq_len: the length of the whole sequence, which dynamic scaling rules (``DynamicNTK``,
                LongRoPE's short/long switch) decide from; default one past the largest position.
                A rank holding a shard of a sequence must pass the global length (the same on every
                rank: :class:`ropekit.distributed.ContextShard` gives it as ``rope_seq_len``); it must
                exceed every position. Static rules ignore it.
            shard_scheme: for ``DTensor`` q and k only: the order their sequence was stored in before
                it was sharded (``"contiguous"``, the default; ``"zigzag"`` after torch's
                ``context_parallel`` load balancer; ``"striped"``). Their positions then come from the
                placement (:func:`ropekit.distributed.dtensor_positions`), ``seq_len`` from their
                global shape, and the results are DTensors placed like q and k.

        Returns:
            ``(q_rotated, k_rotated)`` with the input shapes and dtypes.

        q and k of 2 to 4 dims with one rank, batch and dtype go to :func:`ropekit.rotate_qk` (one
        kernel call; the rows are looked up by position, inside the kernel on CUDA); other
        shapes to :func:`ropekit.apply_rotary_qk` with the rows gathered here.

        A decode loop's calls (an int ``offset``, no ``positions``/``seq_len``, plain tensors, no
        gradient to record) are prepared calls after the first: a call whose signature (q's and
        k's shapes, strides, dtypes and devices, the options, and this module's tables and
        attributes) passed every check before runs the kernel directly, its offset checked
        against the cached rows (:func:`ropekit.ops.prepared_keys.rotary_embedding`).
        """
        if positions is None and seq_len is None and shard_scheme is None:  # a decode step's form: maybe prepared
            key, run, cos, sin = prepared_keys.rotary_embedding(self._tables, self._table_version, q, k, offset,
                                                                tensor_format, seq_dim, inplace, inverse)
            if run is not None:
                return run(q, k, cos, sin, offset)
            preparable = key is not None
        else:
            preparable = False
        given = (tensor_format, seq_dim)
        seq_dim = order_of(q, k, positions, tensor_format, seq_dim)
        if is_dtensor(q) or is_dtensor(k) or shard_scheme is not None:
            return self._forward_dtensor(q, k, positions, offset, seq_dim, inplace, seq_len, shard_scheme, inverse)
        one = dict(offset=offset, seq_dim=seq_dim, inplace=inplace, inverse=inverse, seq_len=seq_len)
        if k is None:
            return self.rotate_one(q, positions, **one), None
        if k.shape[seq_dim] != q.shape[seq_dim]:
            raise ValueError(
                f"q and k must have the same length along seq_dim={seq_dim}, got {q.shape[seq_dim]} and "
                f"{k.shape[seq_dim]}"
            )
        if k.shape[-1] != self.head_dim:
            raise ValueError(f"k has head_dim {k.shape[-1]}, this RotaryEmbedding was built for {self.head_dim}")
        if k.dim() != q.dim() or k.shape[0] != q.shape[0] or k.dtype != q.dtype:  # not one call: one each
            return self.rotate_one(q, positions, **one), self.rotate_one(k, positions, **one)
        if 2 <= q.dim() <= 4:
            cos, sin, where = self._table_rows(q, positions, offset, seq_dim, seq_len)
            out = rotate_qk(q, k, cos, sin, **where, seq_dim=seq_dim, layout=self.layout, inplace=inplace,
                            inverse=inverse, backend=self.backend)
            if preparable and "offsets" in where:  # by an int offset, from the cached tables
                self._keep_prepared(q, k, offset, *given, inplace, inverse, seq_dim, cos, sin)
            return out
        cos, sin = self._broadcast_tables(q, positions, offset, seq_dim, seq_len)
        return apply_rotary_qk(q, k, cos, sin, layout=self.layout, inplace=inplace, inverse=inverse,
                               backend=self.backend)

    def _keep_prepared(self, q: torch.Tensor, k: torch.Tensor, offset: int, tensor_format: Any, seq_dim: Any,
                       inplace: bool, inverse: bool, axis: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Keep, under this call's signature, the prepared ``rotate_qk`` call its cold call reached.

        Called after a cold call by an int offset passed every check and rotated q and k by
        ``rotate_qk(q, k, cos, sin, offsets=offset, seq_dim=axis, ...)`` from the cached tables
        ``cos``/``sin``; a later call of the same signature (:func:`ropekit.ops.prepared_keys.rotary_embedding`)
        runs that call directly. A dynamic scaling rule (frequencies that follow the length) keeps nothing.
        """
        cached = self._tables.get(q.device)
        if getattr(self.scaling, "dynamic", False) or cached is None or cached[0] is not cos or cached[1] is not sin:
            return  # frequencies that follow the length, or rows computed for this call alone
        _, run = prepared_keys.rotate_qk(q, k, cos, sin, offset, None, axis, self.layout, inplace, inverse,
                                         self.backend)
        if run is None:
            return
        key = prepared_keys.rotary_embedding(self._tables, self._table_version, q, k, offset, tensor_format, seq_dim,
                                             inplace, inverse)[0]
        rows = min(cos.shape[0], self.max_cached_positions)
        prepared.keep(key, run, (q, k, cos, sin), rows, q.shape[axis], q.device)

    def _forward_dtensor(
        self, q: Any, k: Any, positions: torch.Tensor | None, offset: Any, seq_dim: int, inplace: bool,
        seq_len: int | None, shard_scheme: str | None, inverse: bool = False,
    ) -> tuple[Any, Any]:
        """DTensor q/k: rotate the local tensors by the positions their placement holds; re-wrap."""
        if not (is_dtensor(q) or is_dtensor(k)):
            raise ValueError(
                "shard_scheme applies to DTensor q and k only; a plain shard takes its positions= "
                "(ropekit.distributed.shard_positions or ContextShard.positions)"
            )
        if not (isinstance(offset, int) and not isinstance(offset, bool) and offset == 0):
            raise ValueError("offset cannot be used with DTensor q/k: their positions come from the placement")
        if inplace is True and torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k)):
            raise ValueError(
                "inplace=True cannot rotate DTensors that require grad (autograd forbids writing into the view "
                "to_local() returns); use inplace=False"
            )
        from ..distributed.dtensor import local_shards

        local = local_shards(q, k, seq_dim=seq_dim, scheme="contiguous" if shard_scheme is None else shard_scheme,
                             positions=positions, seq_len=seq_len)
        q_out, k_out = self.forward(local.q, local.k, local.positions, seq_dim=seq_dim, inplace=inplace,
                                    inverse=inverse, seq_len=local.seq_len)
        return (q, k) if inplace else local.wrap(q_out, k_out)

    # -- construction from configs ------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Any, *, backend: str = "auto") -> RotaryEmbedding:
        """Build from a :class:`ropekit.RopeConfig` (head_dim, rotary_dim, base, layout, scaling).

        A multi-axis config (``config.axes`` set: M-RoPE, axial) raises: its positions are vectors;
        use :class:`ropekit.nn.MultiAxisRotaryEmbedding`.
        """
        if getattr(config, "axes", None) is not None:
            raise ValueError(
                f"this config is multi-axis RoPE ({config.axes!r}): positions are vectors "
                f"({', '.join(config.axes.axis_names)}), which RotaryEmbedding (integer positions) cannot take; "
                "use ropekit.nn.MultiAxisRotaryEmbedding.from_config(config)"
            )
        return cls(
            config.head_dim,
            base=config.base,
            rotary_dim=config.rotary_dim,
            layout=config.layout,
            scaling=config.scaling,
            backend=backend,
        )

    @classmethod
    def from_hf(
        cls,
        config: Any,
        *,
        layer_type: str | None = None,
        layout: str | None = None,
        fixed_seq_len: int | None = None,
        backend: str = "auto",
    ) -> RotaryEmbedding:
        """Build from a Hugging Face ``config.json`` dict or config object.

        Arguments as in :meth:`ropekit.RopeConfig.from_hf`; the attention scale (YaRN,
        LongRoPE) is folded into both cos and sin, where Hugging Face applies it.
        """
        from ..config import RopeConfig

        rope = RopeConfig.from_hf(config, layer_type=layer_type, layout=layout, fixed_seq_len=fixed_seq_len)
        return cls.from_config(rope, backend=backend)
