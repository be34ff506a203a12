"""``ContextShard``: what one rank of a context-parallel group holds of a batch, and how to get the rest."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..rope.shards import (
    SCHEMES,
    check_cu_seqlens,
    check_scheme,
    packed_positions,
    packed_shard,
    shard_order,
    shard_positions,
    shard_sizes,
)
from .collectives import agree, fingerprint, gather_sequence, group_size_and_rank


def _length(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value}")
    return value


class ContextShard:
    """The tokens this rank holds of every sequence of a batch, under one shard scheme.

    Build it once per step on every rank of the group (it is a collective: one ``all_reduce``
    checks that the ranks passed the same ``seq_len`` / ``cu_seqlens``, ``scheme`` and
    ``rope_seq_len``; a mismatch is a ``ValueError`` on every rank). Then :meth:`shard` the batch,
    run the model on the local tokens (``nn.RotarySelfAttention(..., context=shard)``, or
    ``rope(q, k, shard.positions, seq_len=shard.rope_seq_len)`` in a model of your own) and
    :meth:`gather` what must be seen whole.

    Args:
        seq_len: tokens per sequence ``L`` (batch rows of ``(batch, L, ...)``); or
        cu_seqlens: integer ``(num_seqs + 1,)`` boundaries of sequences packed along one axis
            (each length a multiple of :func:`ropekit.distributed.shard_multiple`). Exactly one of the two.
        scheme: ``"contiguous"``, ``"zigzag"`` or ``"striped"`` (:mod:`ropekit.rope.shards`).
        group: the context-parallel process group (``None``: the default group).
        rope_seq_len: the sequence length dynamic scaling rules decide from. Default: what one
            process would derive from the whole batch, ``max(position) + 1``: ``seq_len``, or the
            longest (padded) packed sequence.

    Attributes:
        cp_size, cp_rank: the group's size and this rank's index in it.
        token_index: int64 ``(n,)``: the rows of the global sequence axis this rank holds, in order.
        positions: int64 ``(n,)``: their positions (``token_index`` itself, or the position within
            each token's own sequence when packed): pass them as ``positions=``.
        local_cu_seqlens: packed: int64 ``(num_seqs + 1,)`` boundaries in this rank's tokens
            (``cu_seqlens // cp_size``); ``None`` otherwise.
        seq_len: tokens along the global sequence axis (``L``, or the packed total).
        sizes: tokens each rank holds (a list of ``cp_size`` ints).
    """

    def __init__(
        self,
        seq_len: int | None = None,
        *,
        scheme: str,
        cu_seqlens: Tensor | None = None,
        group: dist.ProcessGroup | None = None,
        rope_seq_len: int | None = None,
    ) -> None:
        self.group = group
        self.cp_size, self.cp_rank = group_size_and_rank(group)
        try:
            values, refused = self._lay_out(seq_len, scheme, cu_seqlens, rope_seq_len), None
        except (TypeError, ValueError) as error:  # still take part in the agreement: no rank is left waiting
            values, refused = {"seq_len": (0, None), "scheme": (0, None), "rope_seq_len": (0, None)}, error
        agree(values, group, refused=refused)
        self._masks: dict[tuple[bool, torch.device], Tensor | None] = {}

    def _lay_out(
        self, seq_len: int | None, scheme: str, cu_seqlens: Tensor | None, rope_seq_len: int | None
    ) -> dict[str, tuple[int, str | None]]:
        """Check the arguments and compute this rank's tokens; return what the ranks must agree on."""
        self.scheme = check_scheme(scheme)
        if (seq_len is None) == (cu_seqlens is None):
            raise ValueError("pass seq_len (one sequence per batch row) or cu_seqlens (packed sequences): exactly one")
        if cu_seqlens is None:
            self.seq_len = _length(seq_len, "seq_len")
            self.cu_seqlens = self.local_cu_seqlens = None
            self.token_index = self.positions = shard_positions(self.seq_len, self.cp_size, self.cp_rank, scheme=scheme)
            self.sizes = shard_sizes(self.seq_len, self.cp_size, scheme=scheme)
            self.order = shard_order(self.seq_len, self.cp_size, scheme=scheme)
            longest = self.seq_len
            values = {"seq_len": (self.seq_len, None)}
        else:
            self.cu_seqlens = check_cu_seqlens(cu_seqlens)
            self.seq_len = _length(int(self.cu_seqlens[-1]), "cu_seqlens[-1] (the packed tokens)")
            self.token_index, self.positions, self.local_cu_seqlens = packed_shard(
                self.cu_seqlens, self.cp_size, self.cp_rank, scheme=scheme)
            self.sizes = [self.seq_len // self.cp_size] * self.cp_size
            self.order = torch.cat([packed_shard(self.cu_seqlens, self.cp_size, rank, scheme=scheme).token_index
                                    for rank in range(self.cp_size)])
            longest = int(self.cu_seqlens.diff().max())
            values = {"cu_seqlens": (fingerprint(self.cu_seqlens), str(self.cu_seqlens.tolist()))}
        if rope_seq_len is not None and _length(rope_seq_len, "rope_seq_len") < longest:
            raise ValueError(
                f"rope_seq_len must cover every position of the batch (>= {longest}, the longest sequence"
                f"{' with its padding' if cu_seqlens is not None else ''}), got {rope_seq_len}"
            )
        self.rope_seq_len = longest if rope_seq_len is None else rope_seq_len
        values["scheme"] = (SCHEMES.index(scheme), scheme)
        values["rope_seq_len"] = (self.rope_seq_len, None)  # derived from the above unless given: reported last
        return values

    def __repr__(self) -> str:
        what = f"seq_len={self.seq_len}" if self.cu_seqlens is None else f"cu_seqlens={self.cu_seqlens.tolist()}"
        return (f"ContextShard({what}, scheme={self.scheme!r}, cp_rank={self.cp_rank}, cp_size={self.cp_size}, "
                f"tokens={self.token_index.numel()}, rope_seq_len={self.rope_seq_len})")

    def shard(self, x: Tensor, *, seq_dim: int) -> Tensor:
        """The tokens this rank holds of the whole ``x``: ``(..., seq_len, ...) -> (..., n, ...)`` along ``seq_dim``.

        ``x`` is the same global batch on every rank (as a data loader gives it); the result is a
        new tensor (``index_select``), differentiable.
        """
        axis = self._axis(x, seq_dim)
        if x.shape[axis] != self.seq_len:
            raise ValueError(
                f"x must hold the whole sequence ({self.seq_len} tokens) along seq_dim={seq_dim}, got "
                f"{x.shape[axis]} (shape {tuple(x.shape)})"
            )
        return x.index_select(axis, self.token_index.to(x.device))

    def gather(self, x: Tensor, *, seq_dim: int) -> Tensor:
        """Every rank's tokens, in global order: ``(..., n, ...) -> (..., seq_len, ...)`` (a collective).

        Differentiable: the gradient of each rank's ``x`` sums what every rank did with its tokens
        (keys and values gathered for attention, for instance).
        """
        axis = self._axis(x, seq_dim)
        return gather_sequence(x, seq_dim=axis, sizes=self.sizes, order=self.order, group=self.group)

    def attention_mask(self, *, causal: bool = True, device: torch.device | str | None = None) -> Tensor | None:
        """Which keys (all ``seq_len`` of them, in global order) each local query may attend to.

        Returns:
            bool ``(n, seq_len)``, ``True`` = attend: causal by global position, and within the
            query's own sequence when packed; ``None`` when every query sees every key
            (``causal=False`` without packing).
        """
        key = (bool(causal), torch.device(device if device is not None else "cpu"))
        if key not in self._masks:
            self._masks[key] = self._build_mask(causal, key[1])
        return self._masks[key]

    def _build_mask(self, causal: bool, device: torch.device) -> Tensor | None:
        if self.cu_seqlens is None:
            if not causal:
                return None
            return torch.arange(self.seq_len, device=device)[None, :] <= self.positions.to(device)[:, None]
        key_positions, key_sequences = packed_positions(self.cu_seqlens, device=device)
        query_sequences = key_sequences[self.token_index.to(device)]
        mask = key_sequences[None, :] == query_sequences[:, None]
        if causal:
            mask &= key_positions[None, :] <= self.positions.to(device)[:, None]
        return mask

    @staticmethod
    def _axis(x: Tensor, seq_dim: int) -> int:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or not -x.dim() <= seq_dim < x.dim():
            raise ValueError(f"seq_dim must name an axis of x, got {seq_dim!r} for x of shape {tuple(x.shape)}")
        return seq_dim % x.dim()
