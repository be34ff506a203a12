"""Converting between the two rotary pairings, for weights and for activations.

A query/key head in the interleaved layout pairs channels ``(2i, 2i+1)``; in the
half layout it pairs ``(i, i + r/2)`` (``r`` = rotary_dim). If ``P`` moves channel
``2i -> i`` and ``2i+1 -> i + r/2``, then ``RoPE_half(P q) = P RoPE_interleaved(q)``,
and since ``P`` is a permutation (orthogonal), attention scores
``<RoPE(P q), RoPE(P k)> = <RoPE(q), RoPE(k)>`` are unchanged. Applying ``P`` to the
output rows of the q and k projections converts a checkpoint (this is what
Hugging Face's Llama conversion script does). Channels past ``rotary_dim`` stay put.
"""

from __future__ import annotations

import torch

from ..validation import check_even_positive, check_layout


def channel_permutation(head_dim: int, src: str, dst: str, *, rotary_dim: int | None = None) -> torch.Tensor:
    """Index ``perm`` such that ``x_dst = x_src[..., perm]`` for one head.

    Args:
        head_dim: channels per head.
        src, dst: ``"half"`` or ``"interleaved"``.
        rotary_dim: rotated channels (default ``head_dim``); later channels map to themselves.

    Returns:
        int64 tensor of shape ``(head_dim,)``.
    """
    src, dst = check_layout(src, "src"), check_layout(dst, "dst")
    check_even_positive(head_dim, "head_dim")
    rotary_dim = head_dim if rotary_dim is None else check_even_positive(rotary_dim, "rotary_dim")
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim ({rotary_dim}) must not exceed head_dim ({head_dim})")
    perm = torch.arange(head_dim)
    if src == dst:
        return perm
    # position p in the half layout holds interleaved channel to_half[p]
    to_half = torch.cat((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)))
    if dst == "half":
        perm[:rotary_dim] = to_half
    else:
        inverse = torch.empty_like(to_half)
        inverse[to_half] = torch.arange(rotary_dim)
        perm[:rotary_dim] = inverse
    return perm


def permute_qk_weight(
    w: torch.Tensor,
    n_heads: int,
    *,
    src: str,
    dst: str,
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """Permute a q or k projection between the interleaved and half rotary layouts.

    Args:
        w: weight of shape ``(n_heads * head_dim, in_features)`` or bias of shape
            ``(n_heads * head_dim,)``; rows are output channels, head-major. For a
            grouped-query key projection pass the number of key/value heads.
        n_heads: number of heads whose rows ``w`` holds.
        src, dst: layout of ``w`` and the layout wanted.
        rotary_dim: rotated channels per head (default: all of ``head_dim``).

    Returns:
        a new tensor of ``w``'s shape and dtype with permuted rows; bit-identical values.

    Example (Meta -> Hugging Face)::

        wq_hf = permute_qk_weight(wq_meta, n_heads, src="interleaved", dst="half")
        wk_hf = permute_qk_weight(wk_meta, n_kv_heads, src="interleaved", dst="half")
    """
    check_projection(w, n_heads)
    if w.shape[0] % n_heads:
        raise ValueError(f"w has {w.shape[0]} rows, not divisible by n_heads={n_heads}")
    head_dim = w.shape[0] // n_heads
    if head_dim % 2:
        raise ValueError(f"head_dim = w.shape[0] / n_heads = {head_dim} must be even")
    perm = channel_permutation(head_dim, src, dst, rotary_dim=rotary_dim).to(w.device)
    heads = w.reshape(n_heads, head_dim, *w.shape[1:])
    return heads.index_select(1, perm).reshape(w.shape).clone()


def convert_layout(x: torch.Tensor, *, src: str, dst: str, rotary_dim: int | None = None) -> torch.Tensor:
    """Reorder the last dimension of activations ``x`` (``(..., head_dim)``) from ``src`` to ``dst`` layout."""
    perm = channel_permutation(x.shape[-1], src, dst, rotary_dim=rotary_dim).to(x.device)
    return x.index_select(-1, perm)


def check_projection(w: object, n_heads: object) -> None:
    """Check a q/k projection's weight ``(out, in)`` or bias ``(out,)`` and its head count.

    Raises:
        TypeError: ``w`` not a tensor.
        ValueError: ``w`` not 1-D or 2-D, ``n_heads`` not a positive int.
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() not in (1, 2):
        raise ValueError(f"w must be a weight (out, in) or a bias (out,), got shape {tuple(w.shape)}")
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads <= 0:
        raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
