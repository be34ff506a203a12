"""Rotary embeddings whose positions are vectors: a frozen axis plan, or learned RoPE-Mixed frequencies.

Two modules beside :class:`ropekit.RotaryEmbedding` rather than one that does everything: that
module's contract is about an integer index (tables cached by row and grown on demand, offsets
for a KV cache, dynamic rules re-evaluated at the sequence length, bounded cache). Vector
positions may be fractional and negative, so no row cache applies, and offsets mean nothing for
a patch grid; one class serving both would give every argument two meanings.

- :class:`MultiAxisRotaryEmbedding` -- an :class:`ropekit.AxisPlan` (M-RoPE, axial, pixel): each
  pair one axis and one frequency.
- :class:`MixedRotaryEmbedding` -- RoPE-Mixed (Heo et al., *Rotary Position Embedding for Vision
  Transformer*, ECCV 2024): per head, each pair turns by ``p_x f_x + p_y f_y`` with ``(f_x, f_y)``
  learnable. The documented exception to "one axis and one frequency per pair", which is why it
  is a module with a parameter and not a frozen plan.

Both hand half-width float32 tables (float64 angles) to :func:`ropekit.apply_rotary_qk`, so the
rotation runs on the C++ kernel on the CPU and the Triton kernel on CUDA, forward and backward.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..functional import apply_rotary, apply_rotary_qk
from ..ops.positions import qk_axes
from ..rope.axes import AxisPlan, matrix_angles
from ..validation import (
    check_axis_positions,
    check_even_positive,
    check_layout,
    check_positive_float,
    format_hint,
    positive_int,
    resolve_seq_dim,
)
from .rotary import against_x, position_batch_axis


def _no_offset(offset: Any) -> None:
    """Vector positions have no default arange to shift: only ``offset=0`` (the protocol's default) is taken."""
    if not (isinstance(offset, int) and not isinstance(offset, bool) and offset == 0):
        raise ValueError(f"offset: multi-axis positions are vectors with no default to shift; pass the positions "
                         f"of the new tokens (positions=), got offset={offset!r}")


def _order(q: torch.Tensor, tensor_format: str | None, seq_dim: int | None, positions: Any,
           n_tokens: int | None) -> int:
    """The sequence axis (default ``-2``), a default contradicted by the positions' length raising with a hint."""
    if tensor_format is not None or seq_dim is not None:
        return resolve_seq_dim(q.dim(), tensor_format, seq_dim)
    if n_tokens is not None and q.shape[-2] != n_tokens:
        raise ValueError(f"positions cover {n_tokens} tokens but q of shape {tuple(q.shape)} has {q.shape[-2]} "
                         f"along seq_dim=-2 (the default, 'bhsd' order){format_hint(q.shape, n_tokens)}")
    return -2


def _tables_against(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    seq_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables ``(*batch, seq, pairs)`` viewed against ``x``: seq on ``seq_dim``, the batch on x's batch axis.

    One batch axis goes where :func:`ropekit.rotate` puts it (after the sequence axis for
    ``(seq, batch, heads, head_dim)``); more leading table axes go with x's leading axes.
    """
    ndim, lead = x.dim(), cos.dim() - 2
    if not isinstance(seq_dim, int) or isinstance(seq_dim, bool) or not -ndim <= seq_dim < ndim - 1:
        raise ValueError(f"seq_dim must name an axis of x other than the last, got {seq_dim} for {ndim}-D x")
    axis = seq_dim % ndim
    if cos.shape[-2] != x.shape[axis]:
        raise ValueError(f"positions cover {cos.shape[-2]} tokens but x has {x.shape[axis]} along seq_dim={seq_dim}")
    if lead <= 1:
        if lead == 1 and position_batch_axis(ndim, axis) is None:
            raise ValueError(f"batched positions need a batch axis in x, and x of shape {tuple(x.shape)} with "
                             f"seq_dim={seq_dim} has none")
        return against_x(x, cos, axis), against_x(x, sin, axis)
    if axis < lead:
        raise ValueError(f"seq_dim={seq_dim} leaves no room for the tables' {lead} leading dimension(s) before it")
    view = [1] * ndim
    view[axis] = x.shape[axis]
    view[-1] = cos.shape[-1]
    for i in range(lead):  # leading table axes go with x's leading axes
        view[i] = cos.shape[i]
    return cos.reshape(view), sin.reshape(view)


class MultiAxisRotaryEmbedding(nn.Module):
    """Rotary embedding for vector positions ``(..., n_axes)`` from an :class:`ropekit.AxisPlan`.

    Args:
        plan: the axis plan (:mod:`ropekit.multiaxis` builders, or ``RopeConfig.axis_plan()``).
        head_dim: channels per head (default ``plan.rotary_dim``); channels past the plan's
            ``rotary_dim`` are left untouched.
        layout: ``"half"`` (Qwen, DINOv3) or ``"interleaved"`` (Flux, Wan, EVA-02, ...).
        backend: ``"auto"`` or a name from :func:`ropekit.ops.available`.

    Shapes in :meth:`forward`: q/k ``(batch, heads, seq, head_dim)`` by default, or the order
    ``tensor_format`` names (``"bshd"``, ``"sbhd"``, ``"thd"``; ``seq_dim`` for other ranks);
    positions ``(seq, n_axes)`` (shared by the batch) or ``(batch, seq, n_axes)``. The module
    honours :class:`ropekit.nn.RotaryModule`.
    """

    def __init__(self, plan: AxisPlan, *, head_dim: int | None = None, layout: str = "half",
                 backend: str = "auto") -> None:
        super().__init__()
        if not isinstance(plan, AxisPlan):
            raise TypeError(f"plan must be a ropekit.AxisPlan, got {type(plan).__name__}")
        self.plan = plan
        self.head_dim = plan.rotary_dim if head_dim is None else check_even_positive(head_dim, "head_dim")
        if self.head_dim < plan.rotary_dim:
            raise ValueError(f"head_dim ({self.head_dim}) is smaller than the plan's rotary_dim ({plan.rotary_dim})")
        self.layout = check_layout(layout)
        self.backend = backend

    def extra_repr(self) -> str:
        """The plan, head_dim and layout shown by ``repr(module)``."""
        return f"{self.plan!r}, head_dim={self.head_dim}, layout={self.layout!r}"

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 tables ``positions.shape[:-1] + (pairs,)`` (compute once, pass to every layer as ``tables=``)."""
        return self.plan.cos_sin(positions)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        positions: torch.Tensor | None = None,
        *,
        offset: int = 0,
        tensor_format: str | None = None,
        seq_dim: int | None = None,
        tables: tuple[torch.Tensor, torch.Tensor] | None = None,
        inplace: bool = False,
        inverse: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotate queries and keys by their position vectors.

        Args:
            q: float queries ``(batch, heads, seq, head_dim)`` by default; ``k``: keys of the same
                sequence length (any head count) or ``None``.
            positions: ``(seq, n_axes)`` or ``(batch, seq, n_axes)``, integer or float.
            offset: must be 0 (vector positions have no default to shift; part of the protocol).
            tensor_format: the order of q's and k's axes (``"bhsd"``, ``"bshd"``, ``"sbhd"``, ``"thd"``).
            seq_dim: the sequence axis of q and k (the low-level spelling; both given must agree).
            tables: ``(cos, sin)`` from :meth:`cos_sin` instead of ``positions`` (one of the two).
            inplace: rotate q and k in place.
            inverse: rotate by ``-theta`` (every pair by minus its angle ``p @ F``): undoes a forward call.

        Returns:
            ``(q_rotated, k_rotated)`` (``k_rotated`` is ``None`` when ``k`` is).
        """
        if (positions is None) == (tables is None):
            raise ValueError("pass positions (seq, n_axes) or tables=(cos, sin), exactly one of them")
        if not isinstance(q, torch.Tensor) or q.dim() < 2 or q.shape[-1] != self.head_dim:
            raise ValueError(f"q must be (..., seq, ..., head_dim={self.head_dim}), got {getattr(q, 'shape', q)}")
        if positions is not None:
            check_axis_positions(positions, self.plan.n_axes)
            if positions.dim() not in (2, 3):
                raise ValueError(
                    f"positions must be (seq, n_axes) or (batch, seq, n_axes), got {tuple(positions.shape)}")
            cos, sin = self.plan.cos_sin(positions.to(q.device))
        else:
            cos, sin = tables
        _no_offset(offset)
        seq_dim = _order(q, tensor_format, seq_dim, positions, cos.shape[-2] if cos.dim() >= 2 else None)
        cos, sin = _tables_against(q, cos, sin, seq_dim)
        options = dict(layout=self.layout, inplace=inplace, inverse=inverse, backend=self.backend)
        if k is None:
            return apply_rotary(q, cos, sin, **options), None
        return apply_rotary_qk(q, k, cos, sin, **options)

    @classmethod
    def from_config(cls, config: Any, *, backend: str = "auto") -> MultiAxisRotaryEmbedding:
        """Build from a :class:`ropekit.RopeConfig` (its :meth:`~ropekit.RopeConfig.axis_plan`, head_dim, layout)."""
        if getattr(config.scaling, "dynamic", False) and getattr(config.scaling, "fixed_seq_len", None) is None:
            raise ValueError("a length-dependent scaling rule needs fixed_seq_len here (RopeConfig.from_hf(..., "
                             "fixed_seq_len=...)): vector positions have no single sequence length")
        return cls(config.axis_plan(), head_dim=config.head_dim, layout=config.layout, backend=backend)

    @classmethod
    def from_hf(cls, config: Any, *, layout: str | None = None, backend: str = "auto") -> MultiAxisRotaryEmbedding:
        """Build from a Hugging Face or diffusers config (through :meth:`ropekit.RopeConfig.from_hf`)."""
        from ..config import RopeConfig

        return cls.from_config(RopeConfig.from_hf(config, layout=layout), backend=backend)


def mixed_init(head_dim: int, num_heads: int, base: float = 10.0, *,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """RoPE-Mixed's initial frequencies, float32 ``(num_heads, 2, head_dim // 2)`` (rows: x, y).

    Per head a random direction ``phi ~ U[0, 2 pi)``; pairs ``k < head_dim / 4`` point along
    ``phi`` and the next ``head_dim / 4`` along ``phi + pi / 2``, with magnitudes
    ``base^(-4k / head_dim)`` (Heo et al. 2024; timm's ``init_random_2d_freqs``).
    """
    check_even_positive(head_dim, "head_dim")
    if head_dim % 4:
        raise ValueError(
            f"RoPE-Mixed needs head_dim divisible by 4 (two directions of head_dim/4 pairs), got {head_dim}")
    base = check_positive_float(base, "base")
    mag = base ** (-torch.arange(0, head_dim, 4, dtype=torch.float64) / head_dim)
    phi = torch.rand(num_heads, 1, generator=generator, dtype=torch.float64) * 2 * math.pi
    fx = torch.cat([mag * torch.cos(phi), mag * torch.cos(phi + math.pi / 2)], dim=-1)
    fy = torch.cat([mag * torch.sin(phi), mag * torch.sin(phi + math.pi / 2)], dim=-1)
    return torch.stack([fx, fy], dim=1).to(torch.float32)


class MixedRotaryEmbedding(nn.Module):
    """RoPE-Mixed: learnable per-head 2-D frequencies; pair ``j`` of head ``h`` turns by ``x f[h,0,j] + y f[h,1,j]``.

    Args:
        head_dim: channels per head (a multiple of 4).
        num_heads: heads (each its own frequencies).
        base: the magnitudes' base (10 in the paper).
        layout: ``"interleaved"`` (the paper, timm) or ``"half"``.
        backend: ``"auto"`` or a name from :func:`ropekit.ops.available`.
        generator: for the random initial directions.

    ``freqs`` is an ``nn.Parameter`` of shape ``(num_heads, 2, head_dim // 2)`` (timm keeps
    ``(2, depth, heads, head_dim // 2)`` for all blocks; here one module per block). The tables
    are float32 from float64 angles and gradients reach ``freqs`` through them. Positions are
    ``(N, 2)`` = (x, y), e.g. ``patch_grid((h, w), indexing="xy")``; class tokens get (0, 0).
    The module honours :class:`ropekit.nn.RotaryModule`.
    """

    def __init__(self, head_dim: int, num_heads: int, *, base: float = 10.0, layout: str = "interleaved",
                 backend: str = "auto", generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.head_dim, self.num_heads = head_dim, positive_int(num_heads, "num_heads")
        self.layout, self.backend = check_layout(layout), backend
        self.freqs = nn.Parameter(mixed_init(head_dim, num_heads, base, generator=generator))

    def extra_repr(self) -> str:
        """Head_dim, heads and layout shown by ``repr(module)``."""
        return f"head_dim={self.head_dim}, num_heads={self.num_heads}, layout={self.layout!r}"

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(num_heads, N, head_dim // 2)`` tables of ``(N, 2)`` positions (differentiable in ``freqs``)."""
        check_axis_positions(positions, 2)
        if positions.dim() != 2:
            raise ValueError(f"positions must be (N, 2) = (x, y), got {tuple(positions.shape)}")
        angles = matrix_angles(positions.to(self.freqs.device), self.freqs)
        return torch.cos(angles).to(torch.float32), torch.sin(angles).to(torch.float32)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, positions: torch.Tensor | None = None, *,
                offset: int = 0, tensor_format: str | None = None, seq_dim: int | None = None,
                inverse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotate q, k by the ``(N, 2)`` positions (required; ``offset`` must be 0); ``inverse``: by minus the angles.

        q and k are float ``(batch, heads, N, head_dim)`` (``tensor_format="bhsd"``, the default),
        ``(batch, N, heads, head_dim)`` (``"bshd"``), ``(N, batch, heads, head_dim)`` (``"sbhd"``) or
        ``(N, heads, head_dim)`` (``"thd"``), with ``heads == num_heads``. The default order is
        checked against the positions' length and the head count.
        """
        if not isinstance(q, torch.Tensor) or q.dim() not in (3, 4) or q.shape[-1] != self.head_dim:
            raise ValueError(f"q must be (batch, heads, N, head_dim={self.head_dim}) or another order "
                             f"tensor_format names, got {getattr(q, 'shape', q)}")
        if positions is None:
            raise ValueError("positions: MixedRotaryEmbedding needs the (N, 2) = (x, y) positions of the tokens")
        _no_offset(offset)
        cos, sin = self.cos_sin(positions)  # (heads, N, pairs)
        axis = _order(q, tensor_format, seq_dim, positions, positions.shape[0]) % q.dim()
        batch_axis, seq_axis, head_axis = qk_axes(q.dim(), axis)
        head_axis = batch_axis if head_axis is None else head_axis  # (heads, N, head_dim): the lone axis is heads
        if head_axis is None or q.shape[head_axis] != self.num_heads:
            raise ValueError(f"q of shape {tuple(q.shape)} with its sequence on axis {axis} has "
                             f"{None if head_axis is None else q.shape[head_axis]} heads, this module was built "
                             f"for num_heads={self.num_heads}; name q's order with tensor_format=")
        view = [1] * q.dim()
        view[seq_axis], view[head_axis], view[-1] = cos.shape[1], cos.shape[0], cos.shape[-1]
        if head_axis > seq_axis:  # tokens before heads: tables (N, heads, pairs)
            cos, sin = cos.transpose(0, 1), sin.transpose(0, 1)
        cos, sin = cos.reshape(view), sin.reshape(view)
        if k is None:
            return apply_rotary(q, cos, sin, layout=self.layout, inverse=inverse, backend=self.backend), None
        return apply_rotary_qk(q, k, cos, sin, layout=self.layout, inverse=inverse, backend=self.backend)
