"""The collectives of context parallelism: the ranks agree on a length, and a shard is gathered back.

Each function here is a collective: every rank of the group must call it, in the same order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..validation import check_positions


def group_size_and_rank(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(cp_size, cp_rank)`` of this process in ``group`` (``None``: the default group)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "ropekit.distributed needs an initialized process group: call torch.distributed.init_process_group "
            "first (or use ropekit.rope.shards for the positions alone)"
        )
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("group must be a process group this process belongs to")
    return size, rank


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where the small tensors of an agreement live: the CPU for gloo, else the current accelerator.

    Mixed backends (``cpu:gloo,cuda:nccl``) reduce CPU tensors too; NCCL alone reduces device tensors only.
    """
    backend = str(dist.get_backend(group)).lower()
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    if accelerator is not None and accelerator.is_available():
        return torch.device(accelerator.current_accelerator().type, accelerator.current_device_index())
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def fingerprint(values: Tensor) -> int:
    """A 56-bit digest of an integer tensor's values (to compare a tensor across ranks in one int)."""
    data = values.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


def _all_max(ints: list[int], group: dist.ProcessGroup | None) -> list[int]:
    """The element-wise maximum over the ranks of ``group`` of a list of ints (one ``all_reduce``)."""
    reduced = torch.tensor(ints, dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    return reduced.tolist()


def _raise_if_refused(refused: Exception | None, any_refused: bool) -> None:
    """After an agreement: this rank's own error, or the news that another rank refused its arguments."""
    if refused is not None:
        raise refused
    if any_refused:
        raise ValueError(
            "another rank of the group refused its arguments (its own error says which); this rank's were valid"
        )


def agree(
    values: dict[str, tuple[int, str | None]],
    group: dist.ProcessGroup | None = None,
    *,
    refused: Exception | None = None,
) -> None:
    """Check that every rank of ``group`` holds the same ints, with one ``all_reduce``.

    A rank whose arguments failed their local checks still takes part (with ``refused`` set and
    placeholder values): every rank then raises, none is left waiting in the collective.

    Args:
        values: argument name -> ``(int, None)``, or ``(digest, this rank's value shown)`` for a
            value compared through a digest (:func:`fingerprint`); the same names on every rank.
        group: the process group (``None``: the default one).
        refused: this rank's own error with its arguments, raised after the collective.

    Raises:
        ValueError: on every rank, naming the first argument whose value differs across the group.
    """
    ints = [value for value, _ in values.values()]
    refusal = 1 if refused is not None else 0
    # the max of v and of -v: the max and the min at once
    reduced = _all_max([refusal] + ints + [-value for value in ints], group)
    _raise_if_refused(refused, reduced[0] > 0)
    for i, (name, (mine, shown)) in enumerate(values.items()):
        high, low = reduced[1 + i], -reduced[1 + len(ints) + i]
        if high != low:
            spread = "different values" if shown is not None else f"values from {low} to {high}"
            shown = str(mine) if shown is None else shown
            raise ValueError(
                f"{name} must be the same on every rank of the group, got {spread} (this rank, "
                f"{dist.get_rank(group)}: {shown})"
            )


def check_seq_len(seq_len: int, group: dist.ProcessGroup | None = None) -> int:
    """Return ``seq_len`` once every rank of ``group`` has passed the same value (one ``all_reduce``).

    Call it where every rank passes once per step (not inside a module that some ranks may
    skip: a collective that one rank never reaches waits until the group's timeout).

    Raises:
        ValueError: on every rank when the ranks disagree, e.g. ``seq_len must be the same on every
            rank of the group, got values from 32 to 64 (this rank, 1: 32)``.
        TypeError: ``seq_len`` is not an int >= 0 (on this rank; the others learn that it refused).
    """
    refused = None
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        refused = TypeError(f"seq_len must be an int >= 0, got {type(seq_len).__name__} {seq_len!r}")
    agree({"seq_len": (0 if refused else seq_len, None)}, group, refused=refused)
    return seq_len


def global_seq_len(positions: Tensor, group: dist.ProcessGroup | None = None) -> int:
    """The sequence length one process would derive from the whole batch: ``max(positions) + 1`` over all ranks.

    What a dynamic scaling rule sees in one process (and what Hugging Face's ``dynamic_rope_update``
    uses), computed from every rank's shard with one ``all_reduce(MAX)``; the same int on every rank.

    Args:
        positions: this rank's integer positions, any shape (empty: contributes 0).
    """
    refused, local = None, 0
    try:
        check_positions(positions)
        local = int(positions.max()) + 1 if positions.numel() else 0
    except (TypeError, ValueError) as error:
        refused = error
    any_refused, longest = _all_max([1 if refused else 0, local], group)
    _raise_if_refused(refused, any_refused > 0)
    return longest


def _pad(x: Tensor, dim: int, length: int) -> Tensor:
    """``x`` zero-padded along ``dim`` to ``length`` rows, contiguous (what gloo's collectives need)."""
    short = length - x.shape[dim]
    if short:
        shape = list(x.shape)
        shape[dim] = short
        x = torch.cat((x, x.new_zeros(shape)), dim=dim)
    return x.contiguous()


class _GatherSequence(torch.autograd.Function):
    """all_gather of every rank's tokens, put back in global order; the backward is a reduce_scatter.

    Ranks may hold different numbers of tokens (``sizes``): each part is padded to the largest for
    the collective (gloo gathers equal sizes only) and trimmed after it.
    """

    @staticmethod
    def forward(ctx, x: Tensor, seq_dim: int, sizes: Sequence[int], order: Tensor, rank: int, group) -> Tensor:
        ctx.seq_dim, ctx.sizes, ctx.order, ctx.rank, ctx.group = seq_dim, sizes, order, rank, group
        local = _pad(x, seq_dim, max(sizes))
        parts = [torch.empty_like(local) for _ in sizes]
        dist.all_gather(parts, local, group=group)
        held = torch.cat([part.narrow(seq_dim, 0, n) for part, n in zip(parts, sizes, strict=True)], dim=seq_dim)
        return held.index_select(seq_dim, order.argsort().to(x.device))

    @staticmethod
    def backward(ctx, grad: Tensor):
        seq_dim, sizes = ctx.seq_dim, ctx.sizes
        held = grad.index_select(seq_dim, ctx.order.to(grad.device))  # global order -> the ranks' order
        chunks = [_pad(chunk, seq_dim, max(sizes)) for chunk in held.split(list(sizes), dim=seq_dim)]
        mine = torch.empty_like(chunks[ctx.rank])
        dist.reduce_scatter(mine, chunks, op=dist.ReduceOp.SUM, group=ctx.group)  # every rank's use of my tokens
        return mine.narrow(seq_dim, 0, sizes[ctx.rank]), None, None, None, None, None


_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)  # one code per dtype
_SHOWN_DIMS = 8  # sizes sent for the message; shapes of more dims are compared by digest


def _ranks_with(values: list, value) -> str:
    ranks = [r for r, v in enumerate(values) if v == value]
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _agree_on_layout(x: Tensor | None, seq_dim: int, refused: Exception | None, group) -> None:
    """Every rank learns every rank's dtype and shape (one ``all_gather`` of a few ints) before the gather.

    All ranks raise the same ``ValueError`` naming what differs and on which ranks: the bytes of
    float16 and bfloat16 tensors would otherwise be read as each other's, and parts of other
    shapes abort a gloo collective. A rank whose own arguments were refused still takes part.
    """
    meta = [1, 0, 0, 0, 0] + [0] * _SHOWN_DIMS
    if refused is None:
        shape = list(x.shape)
        shape[seq_dim] = -1  # the ranks' token counts differ by design (checked against sizes)
        meta = [0, _DTYPES.index(x.dtype), x.dim(), seq_dim, fingerprint(torch.tensor(shape))]
        meta += (shape + [0] * _SHOWN_DIMS)[:_SHOWN_DIMS]
    mine = torch.tensor(meta, dtype=torch.int64, device=collective_device(group))
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    rows = [part.tolist() for part in parts]
    _raise_if_refused(refused, any(row[0] for row in rows))
    dtypes = [_DTYPES[row[1]] for row in rows]
    if len(set(dtypes)) > 1:
        got = " and ".join(f"{dtype} on {_ranks_with(dtypes, dtype)}" for dtype in dict.fromkeys(dtypes))
        raise ValueError(f"x must have the same dtype on every rank of the group, got {got}")
    shapes = []
    for row in rows:
        sizes = ["*" if n == -1 else str(n) for n in row[5:5 + min(row[2], _SHOWN_DIMS)]]
        shown = ", ".join(sizes + (["..."] if row[2] > _SHOWN_DIMS else []))
        shapes.append((f"({shown}{',' if row[2] == 1 else ''})", row[2], row[3], row[4]))
    if len(set(shapes)) > 1:
        got = " and ".join(f"{shape[0]} with seq_dim={shape[2]} on {_ranks_with(shapes, shape)}"
                           for shape in dict.fromkeys(shapes))
        raise ValueError(f"x must have the same shape on every rank of the group apart from its seq_dim axis "
                         f"(* below), got {got}")


def gather_sequence(
    x: Tensor, *, seq_dim: int, sizes: Sequence[int], order: Tensor, group: dist.ProcessGroup | None = None
) -> Tensor:
    """Every rank's tokens along ``seq_dim``, in global order (differentiable; a collective).

    The ranks first agree on x's dtype and on its shape apart from ``seq_dim`` (one small
    ``all_gather``); a rank whose own arguments are wrong raises its error and the others learn
    that it refused, so none is left waiting.

    Args:
        x: this rank's tokens, ``sizes[rank]`` of them along ``seq_dim``; the same dtype and the
            same other sizes on every rank.
        seq_dim: the sequence axis of ``x``.
        sizes: tokens each rank holds (ints, one per rank of ``group``).
        order: int64 ``(sum(sizes),)``: the global index of each token, the ranks' tokens one
            after the other (:func:`ropekit.rope.shards.shard_order`).
        group: the process group (``None``: the default one).

    Returns:
        ``x`` with ``sum(sizes)`` tokens along ``seq_dim``, token ``i`` at index ``i``. Its gradient
        reaches each rank's ``x`` summed over the ranks (a ``reduce_scatter``).

    Raises:
        ValueError: on every rank, when the ranks' dtypes or shapes differ (naming them and the
            ranks) or one rank's arguments are wrong (that rank says which).
    """
    size, rank = group_size_and_rank(group)
    refused = None
    if len(sizes) != size:
        refused = ValueError(f"sizes must have one entry per rank ({size}), got {len(sizes)}")
    elif not isinstance(x, Tensor) or isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or (
        not -x.dim() <= seq_dim < x.dim()
    ):
        refused = ValueError(f"seq_dim must name an axis of x, got {seq_dim} for x of shape "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    elif not isinstance(order, Tensor) or order.dim() != 1 or order.numel() != sum(sizes):
        refused = ValueError(f"order must be a 1-D tensor of sum(sizes) = {sum(sizes)} indices, got {order!r:.80}")
    elif x.shape[seq_dim] != sizes[rank]:
        refused = ValueError(
            f"x must hold this rank's {sizes[rank]} tokens along seq_dim={seq_dim}, got {x.shape[seq_dim]} "
            f"(shape {tuple(x.shape)})"
        )
    elif x.dtype not in _DTYPES:
        refused = TypeError(f"x has dtype {x.dtype}, which cannot be gathered")
    seq_dim = seq_dim % x.dim() if refused is None else 0
    _agree_on_layout(x, seq_dim, refused, group)
    return _GatherSequence.apply(x, seq_dim, tuple(sizes), order, rank, group)
