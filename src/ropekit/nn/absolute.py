r"""Absolute position encodings that RoPE is compared with: sinusoidal and learned.

Both are *added* to the token embeddings once, at the input, instead of rotating
queries and keys in every layer. The sinusoidal table of Vaswani et al. (2017) uses
the same frequencies ``theta_i = base^(-2i/d)`` as RoPE:

.. math::
    p_{k, 2i} = \sin(k\,\theta_i), \qquad p_{k, 2i+1} = \cos(k\,\theta_i)

so ``p_{k+r}`` is a fixed rotation of ``p_k`` pair by pair, but after the projections
``W_Q x`` and ``W_K x`` the attention score is no longer a function of ``k - n`` alone.
A learned table (BERT, GPT-2) is just an :class:`torch.nn.Embedding` and cannot say
anything about positions it was not trained on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..rope.frequencies import base_inv_freq, rotation_angles
from ..validation import check_even_positive, check_positions, check_positive_float, positive_int


def _check_x(x: Any, dim: int) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must have a floating dtype, got {x.dtype}")
    if x.dim() != 3 or x.shape[-1] != dim:
        raise ValueError(f"x must have shape (batch, seq, dim={dim}), got {tuple(x.shape)}")
    return x.shape[0], x.shape[1]


def _default_positions(
    batch: int, seq: int, positions: torch.Tensor | None, offset: int, device: torch.device
) -> torch.Tensor:
    """``positions`` checked to be ``(seq,)`` or ``(batch, seq)``, or ``offset + arange(seq)``."""
    if positions is None:
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be a non-negative int, got {offset!r}")
        return torch.arange(offset, offset + seq, device=device)
    if offset != 0:
        raise ValueError("pass either positions or offset, not both (offset shifts the default arange)")
    check_positions(positions)
    if positions.dim() not in (1, 2) or positions.shape[-1] != seq or (
        positions.dim() == 2 and positions.shape[0] not in (1, batch)
    ):
        raise ValueError(
            f"positions must have shape (seq,) or (batch, seq) = ({batch}, {seq}), got {tuple(positions.shape)}"
        )
    return positions.to(device)


class SinusoidalPositionalEncoding(nn.Module):
    r"""The fixed sinusoidal encoding of "Attention Is All You Need", added to the input.

    :math:`p_{k,2i} = \sin(k / \mathrm{base}^{2i/d}),\; p_{k,2i+1} = \cos(k / \mathrm{base}^{2i/d})`,
    angles in float64 (exact to ~1e-9 rad even at position 1e7), table in float32.

    Args:
        dim: model width ``d`` (positive, even).
        base: the base of the geometric progression of wavelengths, default 10000.

    The module has no parameters and no buffers: nothing in the ``state_dict``, and
    ``module.to(torch.bfloat16)`` cannot degrade the table.
    """

    def __init__(self, dim: int, *, base: float = 10000.0) -> None:
        super().__init__()
        self.dim = check_even_positive(dim, "dim")
        self.base = check_positive_float(base, "base")
        self.inv_freq = base_inv_freq(self.dim, self.base)  # float64 (d/2,), theta_i = base^(-2i/d)

    def extra_repr(self) -> str:
        """The constructor arguments shown by ``repr(module)``."""
        return f"dim={self.dim}, base={self.base:g}"

    def encoding(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The encodings ``p_k`` of integer positions.

        Args:
            positions: integer tensor of any shape ``P``, entries ``>= 0``.
            dtype: output dtype (default float32); angles are float64 whatever it is.

        Returns:
            Tensor of shape ``P + (dim,)`` on ``positions.device``: sin at even channels,
            cos at odd channels.
        """
        angles = rotation_angles(positions, self.inv_freq)  # float64, P + (d/2,)
        table = torch.stack((torch.sin(angles), torch.cos(angles)), dim=-1).flatten(-2)
        return table.to(dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, *, offset: int = 0) -> torch.Tensor:
        """``x + p`` for the positions of the tokens of ``x``.

        Args:
            x: float tensor ``(batch, seq, dim)``.
            positions: integer positions ``(seq,)`` or ``(batch, seq)``; default
                ``offset + arange(seq)``.
            offset: first position of the default (e.g. the cache length when decoding).

        Returns:
            Tensor of ``x``'s shape and dtype.
        """
        batch, seq = _check_x(x, self.dim)
        pos = _default_positions(batch, seq, positions, offset, x.device)
        return x + self.encoding(pos, dtype=x.dtype)


class LearnedPositionalEmbedding(nn.Module):
    """A trained table of absolute position vectors (BERT / GPT-2), added to the input.

    Args:
        max_positions: number of rows; positions must lie in ``[0, max_positions)``.
        dim: model width.

    Attributes:
        embedding: :class:`torch.nn.Embedding` of shape ``(max_positions, dim)``,
            initialised ``N(0, 0.02^2)`` as in GPT-2.

    Unlike RoPE or the sinusoidal encoding there is nothing to say about position
    ``max_positions`` or beyond: asking for it raises ``ValueError``.
    """

    def __init__(self, max_positions: int, dim: int) -> None:
        super().__init__()
        self.max_positions = positive_int(max_positions, "max_positions")
        self.dim = positive_int(dim, "dim")
        self.embedding = nn.Embedding(self.max_positions, self.dim)
        nn.init.normal_(self.embedding.weight, mean=0.0, std=0.02)

    def extra_repr(self) -> str:
        """The constructor arguments shown by ``repr(module)``."""
        return f"max_positions={self.max_positions}, dim={self.dim}"

    def encoding(self, positions: torch.Tensor) -> torch.Tensor:
        """Rows of the table for integer ``positions`` of any shape ``P``: ``P + (dim,)``, the weight's dtype."""
        check_positions(positions)
        if positions.numel() and int(positions.max()) >= self.max_positions:
            raise ValueError(
                f"positions must be < max_positions={self.max_positions}, got a maximum of {int(positions.max())}: "
                "a learned position embedding cannot extrapolate beyond the positions it was trained on"
            )
        return self.embedding(positions.to(self.embedding.weight.device))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, *, offset: int = 0) -> torch.Tensor:
        """``x + E[positions]``.

        Args:
            x: float tensor ``(batch, seq, dim)``.
            positions: integer positions ``(seq,)`` or ``(batch, seq)``; default
                ``offset + arange(seq)``.
            offset: first position of the default.

        Returns:
            Tensor of ``x``'s shape and dtype.
        """
        batch, seq = _check_x(x, self.dim)
        pos = _default_positions(batch, seq, positions, offset, x.device)
        return x + self.encoding(pos).to(x.dtype)
