"""How far a bfloat16 rotation lands from the exact one: ropekit versus the common recipe.

The common recipe (Hugging Face ``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb``) builds
angles in float32 (``positions.float() * inv_freq.float()``), casts the cos/sin tables to the
activation dtype and evaluates ``q * cos + rotate_half(q) * sin`` in bfloat16, so every
product and the sum are rounded. ropekit takes float64 angles, float32 tables and float32
arithmetic, and rounds once to bfloat16. Both are measured against a float64 rotation of the
same bfloat16 input, so the input's own rounding is not counted against either.

Any bfloat16 output carries the rounding of the exact result to bfloat16 (the *floor*,
about 2**-9 relative). ``floor_*`` reports it, and ``*_excess_*`` the error measured against
the correctly rounded reference instead, i.e. the part an implementation could avoid.
At positions around 2e4 the floor is ~0.6x the recipe's whole error, so no bfloat16
implementation can beat the recipe's mean error by more than that factor there; the
avoidable part is where the two differ (and the whole error does at ~1e6, where float32
angles are off by ~0.06 rad).
"""

from __future__ import annotations

import torch

from ropekit import apply_rotary, base_inv_freq, cos_sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's ``rotate_half``: ``[-x2, x1]`` for the halves ``x1, x2`` of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _hf_recipe(q: torch.Tensor, positions: torch.Tensor, head_dim: int, base: float) -> torch.Tensor:
    """The transformers recipe written out: float32 angles, tables in q.dtype, arithmetic in q.dtype."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    return q * cos + rotate_half(q) * sin


def bf16_error_comparison(
    positions_start: int = 20000,
    n_positions: int = 256,
    head_dim: int = 128,
    base: float = 10000.0,
    seed: int = 0,
) -> dict[str, float]:
    """Mean and max absolute error of bfloat16 RoPE (half layout) against a float64 reference.

    Args:
        positions_start: first position of the block of positions measured.
        n_positions: number of consecutive positions (one random query row each).
        head_dim: channels per head (all rotated).
        base: RoPE base.
        seed: seed of the standard-normal queries.

    Returns:
        dict of floats: ``ropekit_mean``, ``ropekit_max``, ``hf_mean``, ``hf_max`` (absolute
        errors against the float64 reference), ``ratio_mean = ropekit_mean / hf_mean``,
        ``floor_mean``/``floor_max`` (error of the reference itself rounded to bfloat16) and
        ``ropekit_excess_mean``/``hf_excess_mean`` (mean absolute difference from that
        correctly rounded reference).
    """
    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(positions_start, positions_start + n_positions)
    q = torch.randn(n_positions, head_dim, generator=generator, dtype=torch.float32).to(torch.bfloat16)

    # float64 reference on the same bfloat16 input: exact angles, no rounding until the comparison
    inv_freq64 = base_inv_freq(head_dim, base)
    angles = positions.to(torch.float64)[:, None] * inv_freq64[None, :]
    q64 = q.to(torch.float64)
    x1, x2 = q64[:, : head_dim // 2], q64[:, head_dim // 2 :]
    reference = torch.cat((x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()), dim=-1)

    cos, sin = cos_sin(positions, inv_freq64)
    ours = apply_rotary(q, cos, sin, layout="half").to(torch.float64)
    theirs = _hf_recipe(q, positions, head_dim, base).to(torch.float64)

    rounded = reference.to(torch.bfloat16).to(torch.float64)

    ours_err = (ours - reference).abs()
    theirs_err = (theirs - reference).abs()
    floor_err = (rounded - reference).abs()
    result = {
        "ropekit_mean": float(ours_err.mean()),
        "ropekit_max": float(ours_err.max()),
        "hf_mean": float(theirs_err.mean()),
        "hf_max": float(theirs_err.max()),
        "floor_mean": float(floor_err.mean()),
        "floor_max": float(floor_err.max()),
        "ropekit_excess_mean": float((ours - rounded).abs().mean()),
        "hf_excess_mean": float((theirs - rounded).abs().mean()),
    }
    result["ratio_mean"] = result["ropekit_mean"] / result["hf_mean"]
    return result
