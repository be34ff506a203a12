"""Context parallelism: RoPE on sequence shards spread over the ranks of a ``torch.distributed`` group.

Each rank holds some tokens of every sequence and must rotate them by their *global* positions,
in the order the load balancer placed them; dynamic scaling rules must decide from the *global*
length, the same on every rank. See docs/distributed.md.

- the positions (pure functions, from :mod:`ropekit.rope.shards`): :func:`shard_positions`,
  :func:`shard_order`, :func:`shard_sizes`, :func:`packed_shard`, :func:`pad_cu_seqlens`,
  :func:`shard_multiple`, :func:`torch_cp_scheme`, :data:`SCHEMES`;
- the collectives: :class:`ContextShard` (what a rank holds of a batch: shard, gather, attention
  mask, the length for the scaling rules, agreed across the group), :func:`check_seq_len`,
  :func:`global_seq_len`, :func:`gather_sequence`;
- DTensor q/k: :func:`dtensor_positions` (``ropekit.RotaryEmbedding`` rotates DTensors with it).
"""

from ..rope.shards import (
    SCHEMES,
    PackedShard,
    packed_shard,
    pad_cu_seqlens,
    shard_multiple,
    shard_order,
    shard_positions,
    shard_sizes,
    torch_cp_scheme,
)
from .collectives import check_seq_len, gather_sequence, global_seq_len
from .context import ContextShard
from .dtensor import dtensor_positions

__all__ = [
    "SCHEMES",
    "ContextShard",
    "PackedShard",
    "check_seq_len",
    "dtensor_positions",
    "gather_sequence",
    "global_seq_len",
    "pad_cu_seqlens",
    "packed_shard",
    "shard_multiple",
    "shard_order",
    "shard_positions",
    "shard_sizes",
    "torch_cp_scheme",
]
