"""DTensor q/k: the global positions of a rank's rows, from the placement and the shard scheme.

A DTensor sharded along its sequence axis holds, on each rank, a contiguous block of the
sequence *as stored* (DTensor's ``Shard`` rule, :func:`ropekit.rope.shards.shard_sizes` with
``"contiguous"``). If the sequence was rearranged before it was distributed, as torch's
``context_parallel`` does with its load balancer (zigzag), the stored sequence is
``x[shard_order(L, cp_size, scheme=...)]``, and the scheme says which positions the block holds.

``torch.distributed.tensor`` is imported inside the functions: ``import ropekit.distributed``
does not load it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..rope.shards import check_scheme, shard_order, shard_sizes
from ..validation import is_dtensor


def _seq_mesh_dim(x: Any, axis: int, name: str) -> int | None:
    """The mesh dimension that shards ``x`` along ``axis`` (None: none does); refuses placements that cannot rotate."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    found = []
    for mesh_dim, placement in enumerate(x.placements):
        if isinstance(placement, (Replicate, Partial)):  # a rotation is linear: partial sums rotate alike
            continue
        dim = getattr(placement, "dim", None)
        if dim is None:
            raise ValueError(f"{name} has placement {placement} on mesh dim {mesh_dim}, which ropekit cannot rotate")
        dim %= x.dim()
        if dim == x.dim() - 1:
            raise ValueError(
                f"{name} is sharded along its last (channel) axis ({placement} on mesh dim {mesh_dim}): the rotary "
                "pairs of a head are split across ranks; shard the sequence, heads or batch axis instead"
            )
        if dim == axis:
            if type(placement) is not Shard:
                raise ValueError(f"{name} is sharded along seq_dim by {placement}; only Shard({dim}) is supported")
            found.append(mesh_dim)
    if len(found) > 1:
        raise ValueError(
            f"{name} is sharded along seq_dim={axis} by mesh dims {found}; ropekit needs one mesh dim (the "
            "context-parallel one) to shard the sequence"
        )
    return found[0] if found else None


def dtensor_positions(x: Any, *, seq_dim: int, scheme: str = "contiguous", name: str = "x") -> Tensor:
    """Global positions of the rows this rank holds of DTensor ``x`` along ``seq_dim``.

    Args:
        x: a ``DTensor`` whose sequence axis is sharded by ``Shard(seq_dim)`` on one mesh
            dimension (or not sharded: every rank then holds the whole sequence).
        seq_dim: the sequence axis of ``x``.
        scheme: the order the sequence was stored in before it was distributed: ``"contiguous"``
            (as it is; DTensor's own rule), ``"zigzag"`` (torch's ``context_parallel`` load balancer)
            or ``"striped"``.
        name: the argument's name in error messages.

    Returns:
        int64 ``(local rows,)`` on ``x``'s device.

    Raises:
        ValueError: ``x`` sharded along its channel axis, along the sequence by several mesh dims or
            by a strided shard, or a sequence length the scheme cannot split evenly.
    """
    if not is_dtensor(x):
        raise TypeError(f"{name} must be a torch.distributed.tensor.DTensor, got {type(x).__name__}")
    check_scheme(scheme, "shard_scheme")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or not -x.dim() <= seq_dim < x.dim() - 1:
        raise ValueError(f"seq_dim must name an axis of {name} other than the last, got {seq_dim!r} for {x.dim()}-D")
    axis = seq_dim % x.dim()
    seq_len = x.shape[axis]
    mesh_dim = _seq_mesh_dim(x, axis, name)
    if mesh_dim is None:
        return torch.arange(seq_len, device=x.device)
    from torch.distributed.tensor import Shard

    cp_size, cp_rank = x.device_mesh.size(mesh_dim), x.device_mesh.get_local_rank(mesh_dim)
    size, offset = Shard.local_shard_size_and_offset(seq_len, cp_size, cp_rank)
    if scheme == "contiguous":
        return torch.arange(offset, offset + size, device=x.device)
    try:
        expected = shard_sizes(seq_len, cp_size, scheme=scheme)[cp_rank]
    except ValueError as error:
        raise ValueError(f"{name} has {seq_len} tokens along seq_dim={seq_dim}: {error}") from None
    if size != expected:
        raise ValueError(
            f"shard_scheme {scheme!r} puts {expected} of the {seq_len} tokens of {name} on mesh rank {cp_rank} "
            f"(of {cp_size}), but DTensor's Shard rule gives it {size}: use a length that is a multiple of {cp_size}"
        )
    return shard_order(seq_len, cp_size, scheme=scheme, device=x.device)[offset:offset + size]


class LocalShards(NamedTuple):
    """The local tensors of DTensor q/k, their positions and the global length, and how to re-wrap."""

    q: Tensor
    k: Tensor | None
    positions: Tensor
    seq_len: int
    wrap: Callable[[Tensor, Tensor | None], tuple[Any, Any]]


def local_shards(
    q: Any, k: Any, *, seq_dim: int, scheme: str, positions: Tensor | None, seq_len: int | None
) -> LocalShards:
    """Unwrap DTensor ``q`` (and ``k``) for a rotation of their local tensors.

    ``positions`` default to :func:`dtensor_positions` (``k``'s must equal ``q``'s) and ``seq_len``
    to the global length ``q.shape[seq_dim]``, the same on every rank by DTensor's contract (no
    collective needed). ``wrap(q_out, k_out)`` returns DTensors with q's and k's mesh, placements,
    global shape and stride (given explicitly: ``from_local`` would assume even shards).
    """
    from torch.distributed.tensor import DTensor

    if not is_dtensor(q) or (k is not None and not is_dtensor(k)):
        raise TypeError(
            f"q and k must both be DTensors or both plain tensors, got {type(q).__name__} and {type(k).__name__}"
        )
    derived = dtensor_positions(q, seq_dim=seq_dim, scheme=scheme, name="q")
    if k is not None:
        if k.device_mesh != q.device_mesh:
            raise ValueError(f"q and k must live on one device mesh, got {q.device_mesh} and {k.device_mesh}")
        if not torch.equal(dtensor_positions(k, seq_dim=seq_dim, scheme=scheme, name="k"), derived):
            raise ValueError(
                f"q and k must hold the same tokens: their sequence axes are placed differently ({q.placements} "
                f"and {k.placements})"
            )
    if positions is not None and is_dtensor(positions):
        raise TypeError("positions must be a plain tensor of this rank's positions (or None: from the placement)")

    def wrap(q_out: Tensor, k_out: Tensor | None) -> tuple[Any, Any]:
        def one(local: Tensor, like: Any) -> Any:
            return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                      stride=like.stride())

        return one(q_out, q), (None if k_out is None else one(k_out, k))

    return LocalShards(q.to_local(), None if k is None else k.to_local(),
                       derived if positions is None else positions,
                       q.shape[seq_dim] if seq_len is None else seq_len, wrap)
