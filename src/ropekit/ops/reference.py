"""The executable math: explicit rotation matrices in float64 (RoFormer eq. 15).

This module is the oracle every other path is tested against. It builds the
block-diagonal matrix ``R(m Theta)`` and multiplies by it, exactly as the paper
writes it, and makes no attempt to be fast.
"""

from __future__ import annotations

import torch

from ..validation import check_float_tensor, check_layout


def pair_indices(rotary_dim: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel indices ``(first, second)`` of each rotary pair.

    ``interleaved``: pair i is channels ``(2i, 2i+1)`` (paper, Meta, GPT-J).
    ``half``: pair i is channels ``(i, i + rotary_dim/2)`` (GPT-NeoX, HF ``rotate_half``).

    Returns:
        two int64 tensors of shape ``(rotary_dim // 2,)``.
    """
    check_layout(layout)
    idx = torch.arange(rotary_dim // 2)
    if layout == "interleaved":
        return 2 * idx, 2 * idx + 1
    return idx, idx + rotary_dim // 2


def rotation_matrix(position: float | int, inv_freq: torch.Tensor, *, layout: str = "interleaved") -> torch.Tensor:
    """The explicit rotation matrix ``R(m Theta)`` of RoFormer eq. (15), in float64.

    Column-vector convention: ``R @ x`` rotates ``x`` at position ``m``. For the
    interleaved layout block ``i`` sits at rows/columns ``(2i, 2i+1)``::

        [[cos m*theta_i, -sin m*theta_i],
         [sin m*theta_i,  cos m*theta_i]]

    ``layout="half"`` places the same 2x2 block at rows/columns ``(i, i + d/2)``.

    Args:
        position: the token position ``m`` (any real number; integers in practice).
        inv_freq: tensor of shape ``(d/2,)`` with the frequencies ``theta_i``.
        layout: ``"interleaved"`` (the paper's) or ``"half"``.

    Returns:
        float64 tensor of shape ``(d, d)``, orthogonal, with ``R(m)^T R(n) = R(n - m)``.
    """
    check_layout(layout)
    theta = torch.as_tensor(inv_freq, dtype=torch.float64).reshape(-1)
    rotary_dim = 2 * theta.numel()
    angles = torch.tensor(position, dtype=torch.float64) * theta
    first, second = pair_indices(rotary_dim, layout)
    matrix = torch.zeros(rotary_dim, rotary_dim, dtype=torch.float64)
    matrix[first, first] = torch.cos(angles)
    matrix[first, second] = -torch.sin(angles)
    matrix[second, first] = torch.sin(angles)
    matrix[second, second] = torch.cos(angles)
    return matrix


def apply_reference(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    layout: str = "half",
    attention_scale: float = 1.0,
) -> torch.Tensor:
    """Rotate ``x`` by multiplying each token with its float64 rotation matrix.

    Args:
        x: tensor of shape ``(..., head_dim)``; any float dtype.
        positions: integer tensor broadcastable to ``x.shape[:-1]``.
        inv_freq: tensor of shape ``(rotary_dim // 2,)`` with ``rotary_dim <= head_dim``.
        layout: pairing of the rotated channels.
        attention_scale: multiplies the rotated part (as the cos/sin tables would).

    Returns:
        float64 tensor of ``x``'s shape; channels past ``rotary_dim`` are copied.
    """
    check_float_tensor(x, "x")
    rotary_dim = 2 * inv_freq.numel()
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"x has {x.shape[-1]} channels, fewer than rotary_dim={rotary_dim}")
    x64 = x.detach().to(torch.float64).cpu()
    pos = torch.broadcast_to(positions.cpu(), x.shape[:-1]).reshape(-1)
    flat = x64.reshape(-1, x.shape[-1]).clone()
    cache: dict[int, torch.Tensor] = {}
    for row in range(flat.shape[0]):
        m = int(pos[row])
        if m not in cache:
            cache[m] = rotation_matrix(m, inv_freq, layout=layout) * float(attention_scale)
        flat[row, :rotary_dim] = cache[m] @ flat[row, :rotary_dim]
    return flat.reshape(x.shape)
