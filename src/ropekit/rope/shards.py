"""Positions of a sequence shard: which tokens each rank of a context-parallel group holds.

Context parallelism splits every sequence of a batch over the ``cp_size`` ranks of a group, and
each rank must rotate its tokens by their *global* positions. Three orders are in use; for a
sequence of ``L`` tokens, rank ``r`` holds, in this order:

- ``"contiguous"``: tokens ``[r*s, min(L, (r+1)*s))`` with ``s = ceil(L / cp_size)``, the rule of
  ``torch.chunk`` and of DTensor's ``Shard`` placement (the last ranks may hold fewer tokens, or
  none). Any ``L``.
- ``"zigzag"``: the sequence cut into ``2*cp_size`` equal chunks, rank ``r`` holding chunk ``r``
  and then chunk ``2*cp_size - 1 - r``: the load-balanced order of Megatron-LM and
  TransformerEngine, and of torch's ``context_parallel`` head-tail load balancer (its
  "round-robin" balancer before torch 2.10). Every rank then does the same causal-attention work.
  Needs ``L % (2*cp_size) == 0``.
- ``"striped"``: token ``i`` on rank ``i % cp_size``, a token-level round-robin (Striped Attention,
  Brandon et al. 2023). Any ``L``.

Packed batches (``cu_seqlens``): each sequence is split by the scheme as if it were alone, and a
rank's pieces follow one another sequence after sequence (TransformerEngine's THD layout, for
zigzag). Every sequence must be a multiple of :func:`shard_multiple` long (``2*cp_size`` for
zigzag, ``cp_size`` otherwise; :func:`pad_cu_seqlens` pads the boundaries), so every rank holds
``1/cp_size`` of each sequence and its own boundaries are ``cu_seqlens // cp_size``. Positions
restart at 0 in each sequence and run on through its padding.

Everything here is pure: integers in, int64 tensors out, no process group
(:mod:`ropekit.distributed` adds the collectives).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

#: The shard orders, see the module docstring.
SCHEMES = ("contiguous", "zigzag", "striped")


def check_scheme(scheme: object, name: str = "scheme") -> str:
    """Return ``scheme`` if it is one of :data:`SCHEMES`, else raise ``ValueError``."""
    if not isinstance(scheme, str) or scheme not in SCHEMES:
        raise ValueError(f"{name} must be one of {SCHEMES}, got {scheme!r}")
    return scheme


def _check_int(value: object, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value}")
    return value


def _check_group(cp_size: object, cp_rank: object) -> None:
    _check_int(cp_size, "cp_size", 1)
    _check_int(cp_rank, "cp_rank", 0)
    if cp_rank >= cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size) = [0, {cp_size}), got {cp_rank}")


def shard_multiple(cp_size: int, *, scheme: str) -> int:
    """The length every packed sequence must be a multiple of: ``2*cp_size`` (zigzag) or ``cp_size``."""
    _check_int(cp_size, "cp_size", 1)
    return 2 * cp_size if check_scheme(scheme) == "zigzag" else cp_size


def shard_sizes(seq_len: int, cp_size: int, *, scheme: str) -> list[int]:
    """Tokens each rank holds of a sequence of ``seq_len`` tokens: a list of ``cp_size`` ints.

    Raises:
        ValueError: ``scheme="zigzag"`` and ``seq_len`` not a multiple of ``2*cp_size``.
    """
    _check_int(seq_len, "seq_len", 0)
    _check_int(cp_size, "cp_size", 1)
    check_scheme(scheme)
    if scheme == "zigzag":
        if seq_len % (2 * cp_size):
            raise ValueError(
                f"seq_len must be a multiple of 2*cp_size = {2 * cp_size} for scheme 'zigzag' (it cuts the "
                f"sequence into 2*cp_size equal chunks), got {seq_len}; pad the sequence or use 'contiguous'"
            )
        return [seq_len // cp_size] * cp_size
    if scheme == "striped":
        return [len(range(rank, seq_len, cp_size)) for rank in range(cp_size)]
    step = -(-seq_len // cp_size)
    return [max(0, min(seq_len, (rank + 1) * step) - rank * step) for rank in range(cp_size)]


def shard_positions(
    seq_len: int, cp_size: int, cp_rank: int, *, scheme: str, device: torch.device | str | None = None
) -> Tensor:
    """Global positions of the tokens rank ``cp_rank`` holds, in the order it holds them.

    Args:
        seq_len: tokens in the whole sequence ``L``.
        cp_size: ranks in the context-parallel group.
        cp_rank: this rank's index in the group, ``0 <= cp_rank < cp_size``.
        scheme: ``"contiguous"``, ``"zigzag"`` or ``"striped"`` (module docstring).
        device: where the result lives (default CPU).

    Returns:
        int64 ``(shard_sizes(...)[cp_rank],)``: e.g. ``L=8, cp_size=2, scheme="zigzag"`` gives
        ``[0, 1, 6, 7]`` on rank 0 and ``[2, 3, 4, 5]`` on rank 1. Pass them as ``positions=``.
    """
    _check_group(cp_size, cp_rank)
    size = shard_sizes(seq_len, cp_size, scheme=scheme)[cp_rank]
    if scheme == "striped":
        return torch.arange(size, device=device) * cp_size + cp_rank
    if scheme == "contiguous":
        start = cp_rank * (-(-seq_len // cp_size))
        return torch.arange(start, start + size, device=device)
    chunk = seq_len // (2 * cp_size)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    return torch.cat((head, head + (2 * cp_size - 1 - 2 * cp_rank) * chunk))


def shard_order(seq_len: int, cp_size: int, *, scheme: str, device: torch.device | str | None = None) -> Tensor:
    """Every rank's positions one after the other: int64 ``(seq_len,)``, a permutation of ``arange(seq_len)``.

    ``x.index_select(seq_dim, order)`` is the sequence as the ranks hold it (what torch's
    ``context_parallel`` stores before its contiguous cut); ``order.argsort()`` puts it back.
    """
    return torch.cat([shard_positions(seq_len, cp_size, rank, scheme=scheme, device=device)
                      for rank in range(cp_size)])


def torch_cp_scheme(seq_len: int, cp_size: int, *, load_balance: bool = True) -> str:
    """The order torch's ``context_parallel`` gives buffers of ``seq_len`` tokens (torch 2.10 and later).

    Its default load balancer is the head-tail one (our ``"zigzag"``) when load balancing is on
    (``_cp_options.enable_load_balance``, the default) and ``seq_len % (2*cp_size) == 0``; otherwise
    the buffers are cut in contiguous blocks.
    """
    _check_int(seq_len, "seq_len", 0)
    _check_int(cp_size, "cp_size", 1)
    return "zigzag" if load_balance and seq_len % (2 * cp_size) == 0 else "contiguous"


# -- packed (variable-length) batches ------------------------------------------------------------------


class PackedShard(NamedTuple):
    """What one rank holds of a packed batch (see :func:`packed_shard`)."""

    token_index: Tensor  #: int64 ``(T / cp_size,)``: rows of the packed ``(T, ...)`` batch, in the rank's order
    positions: Tensor  #: int64 ``(T / cp_size,)``: each token's position within its own sequence
    cu_seqlens: Tensor  #: int64 ``(num_seqs + 1,)``: the sequences' boundaries in the rank's tokens


def check_cu_seqlens(cu_seqlens: object, name: str = "cu_seqlens") -> Tensor:
    """Return ``cu_seqlens`` as a CPU int64 tensor if it is 1-D, integer, from 0 and non-decreasing."""
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be 1-D with num_seqs + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(cu[0])}")
    lengths = cu[1:] - cu[:-1]
    if bool((lengths < 0).any()):
        j = int((lengths < 0).nonzero()[0])
        raise ValueError(f"{name} must be non-decreasing, got {int(cu[j])} then {int(cu[j + 1])} at index {j}")
    return cu


def pad_cu_seqlens(cu_seqlens: Tensor, multiple: int) -> Tensor:
    """Boundaries of the same sequences each padded at its end to a multiple of ``multiple``.

    TransformerEngine's ``pad_thd_sequences_for_cp`` pads the same way: lengths 3 and 7 with
    ``multiple=4`` give ``[0, 4, 12]``. Use ``multiple=shard_multiple(cp_size, scheme=...)``.

    Returns:
        int64 ``(num_seqs + 1,)`` on the CPU.
    """
    cu = check_cu_seqlens(cu_seqlens)
    _check_int(multiple, "multiple", 1)
    lengths = cu[1:] - cu[:-1]
    padded = (lengths + multiple - 1) // multiple * multiple
    return torch.cat((cu.new_zeros(1), padded.cumsum(0)))


def _packed_piece_positions(step: Tensor, length: Tensor, cp_size: int, cp_rank: int, scheme: str) -> Tensor:
    """Position within its sequence of the ``step``-th token a rank holds of a sequence of ``length`` tokens."""
    if scheme == "striped":
        return step * cp_size + cp_rank
    if scheme == "contiguous":
        return cp_rank * (length // cp_size) + step
    chunk = length // (2 * cp_size)
    return torch.where(step < chunk, cp_rank * chunk + step, (2 * cp_size - 2 - cp_rank) * chunk + step)


def packed_shard(
    cu_seqlens: Tensor, cp_size: int, cp_rank: int, *, scheme: str, device: torch.device | str | None = None
) -> PackedShard:
    """The tokens rank ``cp_rank`` holds of a packed batch, each sequence split by ``scheme``.

    Args:
        cu_seqlens: integer ``(num_seqs + 1,)`` boundaries of the sequences in the packed batch
            (each length a multiple of :func:`shard_multiple`; padded ones, see :func:`pad_cu_seqlens`).
        cp_size, cp_rank, scheme: as in :func:`shard_positions`.
        device: where the results live (default CPU).

    Returns:
        :class:`PackedShard` ``(token_index, positions, cu_seqlens)``. E.g. ``cu_seqlens=[0, 4, 12, 16]``,
        ``cp_size=2``, zigzag, rank 0: tokens ``[0, 3, 4, 5, 10, 11, 12, 15]`` at positions
        ``[0, 3, 0, 1, 6, 7, 0, 3]``, boundaries ``[0, 2, 6, 8]``.

    Raises:
        ValueError: a sequence whose length is not a multiple of :func:`shard_multiple` (named by index).
    """
    cu = check_cu_seqlens(cu_seqlens)
    _check_group(cp_size, cp_rank)
    multiple = shard_multiple(cp_size, scheme=scheme)
    lengths = cu[1:] - cu[:-1]
    uneven = (lengths % multiple).nonzero()
    if uneven.numel():
        j = int(uneven[0])
        raise ValueError(
            f"cu_seqlens: sequence {j} has {int(lengths[j])} tokens, not a multiple of {multiple} as scheme "
            f"{scheme!r} needs with cp_size={cp_size}; pad every sequence first "
            f"(pad_cu_seqlens(cu_seqlens, {multiple}))"
        )
    local = lengths // cp_size
    local_cu = torch.cat((cu.new_zeros(1), local.cumsum(0)))
    seq_id = torch.repeat_interleave(torch.arange(lengths.numel()), local)
    step = torch.arange(int(local_cu[-1])) - local_cu[seq_id]
    positions = _packed_piece_positions(step, lengths[seq_id], cp_size, cp_rank, scheme)
    token_index = cu[seq_id] + positions
    return PackedShard(token_index.to(device), positions.to(device), local_cu.to(device))


def packed_positions(cu_seqlens: Tensor, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """``(positions, sequence ids)`` of every token of a packed batch: two int64 ``(T,)`` tensors.

    ``positions`` restart at 0 in each sequence; ``sequence ids`` number the sequences from 0.
    """
    cu = check_cu_seqlens(cu_seqlens)
    lengths = cu[1:] - cu[:-1]
    seq_id = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    positions = torch.arange(int(cu[-1])) - cu[seq_id]
    return positions.to(device), seq_id.to(device)
