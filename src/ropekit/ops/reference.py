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
    layout = check_layout(layout)
    idx = torch.arange(rotary_dim // 2)
    if layout == "interleaved":
        return 2 * idx, 2 * idx + 1
    return idx, idx + rotary_dim // 2


def _is_plan(inv_freq: object) -> bool:
    return hasattr(inv_freq, "freq_matrix") and hasattr(inv_freq, "axis_names")


def _angles(position: object, inv_freq: object) -> torch.Tensor:
    """float64 ``(d/2,)`` angles of one token: ``m * theta`` (1-D), or ``p @ F`` for a position vector ``p``.

    ``F`` is an :class:`~ropekit.rope.axes.AxisPlan`'s ``freq_matrix()`` or any ``(n_axes, d/2)`` matrix.
    """
    if _is_plan(inv_freq) or (isinstance(inv_freq, torch.Tensor) and inv_freq.dim() == 2):
        matrix = inv_freq.freq_matrix() if _is_plan(inv_freq) else inv_freq.to(torch.float64)
        vector = torch.as_tensor(position, dtype=torch.float64).reshape(-1)
        if vector.numel() != matrix.shape[0]:
            raise ValueError(f"position must have one coordinate per axis ({matrix.shape[0]}), got {vector.numel()}")
        return vector @ matrix
    theta = torch.as_tensor(inv_freq, dtype=torch.float64).reshape(-1)
    return torch.tensor(position, dtype=torch.float64) * theta


def rotation_matrix(position: object, inv_freq: object, *, layout: str = "interleaved") -> torch.Tensor:
    """The explicit rotation matrix ``R(m Theta)`` of RoFormer eq. (15), in float64.

    Column-vector convention: ``R @ x`` rotates ``x`` at position ``m``. For the
    interleaved layout block ``i`` sits at rows/columns ``(2i, 2i+1)``::

        [[cos m*theta_i, -sin m*theta_i],
         [sin m*theta_i,  cos m*theta_i]]

    ``layout="half"`` places the same 2x2 block at rows/columns ``(i, i + d/2)``.

    Multi-axis RoPE: ``position`` is a vector ``p`` (one coordinate per axis) and ``inv_freq`` an
    :class:`ropekit.AxisPlan` or a frequency matrix ``F`` of shape ``(n_axes, d/2)``; block ``i``
    then turns by ``(p @ F)[i]`` (for a plan: ``p[axis[i]] * inv_freq[i]``).

    Args:
        position: the token position ``m`` (any real number; integers in practice), or a vector.
        inv_freq: tensor of shape ``(d/2,)`` with the frequencies ``theta_i``, or a plan / matrix.
        layout: ``"interleaved"`` (the paper's) or ``"half"``.

    Returns:
        float64 tensor of shape ``(d, d)``, orthogonal, with ``R(m)^T R(n) = R(n - m)``.
    """
    layout = check_layout(layout)
    angles = _angles(position, inv_freq)
    rotary_dim = 2 * angles.numel()
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
    inv_freq: object,
    *,
    layout: str = "half",
    attention_scale: float = 1.0,
) -> torch.Tensor:
    """Rotate ``x`` by multiplying each token with its float64 rotation matrix.

    Args:
        x: tensor of shape ``(..., head_dim)``; any float dtype.
        positions: integer tensor broadcastable to ``x.shape[:-1]``; for multi-axis RoPE,
            ``(..., n_axes)`` broadcastable to ``x.shape[:-1] + (n_axes,)`` (floats allowed).
        inv_freq: tensor of shape ``(rotary_dim // 2,)`` with ``rotary_dim <= head_dim``, or an
            :class:`ropekit.AxisPlan` / frequency matrix ``(n_axes, rotary_dim // 2)``.
        layout: pairing of the rotated channels.
        attention_scale: multiplies the rotated part (as the cos/sin tables would); a plan
            brings its own (leave this at 1.0).

    Returns:
        float64 tensor of ``x``'s shape; channels past ``rotary_dim`` are copied.
    """
    check_float_tensor(x, "x")
    multi = _is_plan(inv_freq) or (isinstance(inv_freq, torch.Tensor) and inv_freq.dim() == 2)
    if _is_plan(inv_freq):
        if float(attention_scale) != 1.0:
            raise ValueError("attention_scale must be left at 1.0 with an AxisPlan (the plan carries its own)")
        attention_scale = inv_freq.attention_scale
    pairs = inv_freq.pairs if _is_plan(inv_freq) else (inv_freq.shape[-1] if multi else inv_freq.numel())
    rotary_dim = 2 * pairs
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"x has {x.shape[-1]} channels, fewer than rotary_dim={rotary_dim}")
    x64 = x.detach().to(torch.float64).cpu()
    if multi:
        n_axes = inv_freq.n_axes if _is_plan(inv_freq) else inv_freq.shape[0]
        pos = torch.broadcast_to(positions.cpu(), (*x.shape[:-1], n_axes)).reshape(-1, n_axes)
    else:
        pos = torch.broadcast_to(positions.cpu(), x.shape[:-1]).reshape(-1)
    flat = x64.reshape(-1, x.shape[-1]).clone()
    cache: dict[object, torch.Tensor] = {}
    for row in range(flat.shape[0]):
        key = tuple(pos[row].tolist()) if multi else int(pos[row])
        if key not in cache:
            cache[key] = rotation_matrix(list(key) if multi else key, inv_freq, layout=layout) * float(attention_scale)
        flat[row, :rotary_dim] = cache[key] @ flat[row, :rotary_dim]
    return flat.reshape(x.shape)
