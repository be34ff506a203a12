r"""xPos: RoPE with an exponential decay per pair (Sun et al. 2022, "A Length-Extrapolatable Transformer").

xPos rotates queries and keys exactly as RoPE does and then scales pair ``i`` of a query at
position ``n`` by ``zeta_i^((n - c) / B)`` and of a key at position ``m`` by ``zeta_i^(-(m - c) / B)``:

.. math::
    \zeta_i = \frac{2i/d + \gamma}{1 + \gamma}, \qquad
    q'_n \cdot k'_m = \sum_i \zeta_i^{(n - m)/B}\,
        \big\langle (R_n q_n)_{[i]}, (R_m k_m)_{[i]} \big\rangle

with ``d`` the rotated channels, ``gamma = 0.4`` and the scale base ``B = 512`` of the paper
(``microsoft/torchscale`` ``XPOS``). Every ``zeta_i < 1``, so for ``n > m`` each pair's
contribution decays with the distance, the fastest pair (``zeta_0 = gamma / (1 + gamma)``)
most. The centre ``c`` cancels in every score; it only keeps the factors representable:
``zeta_0^(-|m - c| / B)`` overflows float32 beyond ``|m - c| ~ 88 B / |ln zeta_0|`` (about
36,000 positions at the defaults), which :class:`XPosEmbedding` refuses with a ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..validation import check_positive_float, is_dtensor
from .rotary import MAX_CACHED_POSITIONS, RotaryEmbedding, against_x, order_of

#: The largest ``|exponent|`` of a scale factor: ``exp(80)`` is about 5.5e34, below float32's 3.4e38.
MAX_LOG_SCALE = 80.0


def xpos_zeta(rotary_dim: int, gamma: float = 0.4) -> torch.Tensor:
    """``zeta_i = (2i / rotary_dim + gamma) / (1 + gamma)`` for each pair ``i``: float64 ``(rotary_dim // 2,)``."""
    i = torch.arange(rotary_dim // 2, dtype=torch.float64)
    return (2 * i / rotary_dim + gamma) / (1 + gamma)


def _plain(q: Any, k: Any, shard_scheme: str | None) -> None:
    """Refuse DTensor inputs: the scale factors are computed from plain positions."""
    if shard_scheme is not None or is_dtensor(q) or is_dtensor(k):
        raise ValueError("shard_scheme: XPosEmbedding takes plain tensors; rotate a shard with its global "
                         "positions= (ropekit.distributed.shard_positions or ContextShard.positions)")


class XPosEmbedding(RotaryEmbedding):
    """Rotary embedding with xPos scaling of queries (``zeta^((n-c)/B)``) and keys (``zeta^(-(m-c)/B)``).

    Args:
        head_dim: channels per head (even).
        base: RoPE base, default 10000.
        rotary_dim: rotated (and scaled) channels per head (even, ``<= head_dim``); default
            ``head_dim``. Channels past it are neither rotated nor scaled.
        layout: ``"half"`` (default) or ``"interleaved"`` (the paper's ``rotate_every_two``); the
            scale of pair ``i`` multiplies both channels of the pair in that layout.
        scale_base: ``B``, default 512 (the paper's).
        gamma: ``gamma``, default 0.4 (the paper's).
        center: ``c``, the position whose factors are 1 (default 0); any value gives the same
            scores, as long as every position stays within the float32 range around it.
        scaling: must be ``None`` (accepted so that ``from_config`` / ``from_hf`` work for
            configs without a scaling rule).
        backend, max_cached_positions: as in :class:`~ropekit.nn.RotaryEmbedding`.

    Its :meth:`forward` honours :class:`ropekit.nn.RotaryModule` and returns ``(q', k')`` as
    above, the key factors included: a caller needs to know nothing of xPos, so it stands in
    for RoPE in :class:`~ropekit.nn.RotarySelfAttention` (``rope=XPosEmbedding(...)``), KV
    cache included: a cached key keeps the factor of its own position, and later queries use
    theirs. Scale factors are computed in float64 and applied in float32 (float64 for
    float64 inputs); outputs have the input dtype.
    """

    def __init__(
        self,
        head_dim: int,
        *,
        base: float = 10000.0,
        rotary_dim: int | None = None,
        layout: str = "half",
        scale_base: float = 512.0,
        gamma: float = 0.4,
        center: int = 0,
        scaling: Any = None,
        backend: str = "auto",
        max_cached_positions: int = MAX_CACHED_POSITIONS,
    ) -> None:
        if scaling is not None:
            raise ValueError(f"scaling: xPos takes no scaling rule (its decay is defined on the plain RoPE "
                             f"frequencies), got {scaling!r}")
        super().__init__(head_dim, base=base, rotary_dim=rotary_dim, layout=layout, backend=backend,
                         max_cached_positions=max_cached_positions)
        self.scale_base = check_positive_float(scale_base, "scale_base")
        self.gamma = check_positive_float(gamma, "gamma")
        if isinstance(center, bool) or not isinstance(center, int):
            raise TypeError(f"center must be an int position, got {type(center).__name__} {center!r}")
        self.center = center
        self.log_zeta = xpos_zeta(self.rotary_dim, self.gamma).log()  # float64, all < 0

    def extra_repr(self) -> str:
        """The constructor arguments shown by ``repr(module)``."""
        return (f"{super().extra_repr()}, scale_base={self.scale_base:g}, gamma={self.gamma:g}, "
                f"center={self.center}")

    @property
    def max_distance(self) -> int:
        """The largest ``|position - center|`` whose factors stay finite in float32."""
        return int(MAX_LOG_SCALE * self.scale_base / float(self.log_zeta.abs().max()))

    def scale(self, positions: torch.Tensor) -> torch.Tensor:
        """Query factors ``zeta_i^((n - c) / B)``: float64 ``positions.shape + (rotary_dim // 2,)``.

        Keys use the reciprocals. Raises ``ValueError`` naming ``positions`` when a factor
        would overflow float32 (``|n - c| > max_distance``).
        """
        return self._log_scale(positions).exp()

    def _log_scale(self, positions: torch.Tensor) -> torch.Tensor:
        """``(n - c) / B * ln zeta_i`` in float64, after the overflow check."""
        if positions.numel():
            far = int((positions.to(torch.int64) - self.center).abs().max())
            if far > self.max_distance:
                raise ValueError(
                    f"positions: xPos factors zeta^(+-(n - c)/B) overflow float32 beyond |n - c| = "
                    f"{self.max_distance:,} (scale_base={self.scale_base:g}); got a position {far:,} away from "
                    f"center={self.center}: pass a center nearer the positions"
                )
        exponent = (positions.to(torch.float64) - self.center)[..., None] / self.scale_base
        return exponent * self.log_zeta.to(positions.device)

    def _channel_scale(self, x: torch.Tensor, positions: torch.Tensor | None, offset: Any, seq_dim: int,
                       key: bool) -> torch.Tensor:
        """Factors broadcast against ``x`` (``x.dim()`` dims, one per channel), in x's compute dtype."""
        axis, pos, _ = self._checked_positions(x, positions, offset, seq_dim)
        log_scale = self._log_scale(pos)
        pairs = -log_scale if key else log_scale
        if self.layout == "half":
            rotary = torch.cat((pairs, pairs), dim=-1)
        else:
            rotary = pairs.repeat_interleave(2, dim=-1)
        tail = rotary.new_zeros(*rotary.shape[:-1], self.head_dim - self.rotary_dim)
        channel = torch.cat((rotary, tail), dim=-1).exp()  # (seq, head_dim) or (batch, seq, head_dim)
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        return against_x(x, channel, axis).to(work)

    def _scaled(self, x: torch.Tensor, rotated: torch.Tensor, positions, offset, seq_dim, key: bool,
                inplace: bool) -> torch.Tensor:
        factor = self._channel_scale(x, positions, offset, seq_dim, key)
        if inplace:
            return rotated.mul_(factor)
        return (rotated.to(factor.dtype) * factor).to(x.dtype)

    def rotate_one(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        offset: int | torch.Tensor = 0,
        tensor_format: str | None = None,
        seq_dim: int | None = None,
        inplace: bool = False,
        seq_len: int | None = None,
        shard_scheme: str | None = None,
        key: bool = False,
    ) -> torch.Tensor:
        """Rotate and scale one tensor: as a query (``zeta^((n-c)/B)``), or as a key with ``key=True``."""
        _plain(x, None, shard_scheme)
        seq_dim = order_of(x, None, positions, tensor_format, seq_dim)
        rotated = super().rotate_one(x, positions, offset=offset, seq_dim=seq_dim, inplace=inplace, seq_len=seq_len)
        return self._scaled(x, rotated, positions, offset, seq_dim, key, inplace)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        positions: torch.Tensor | None = None,
        *,
        offset: int | torch.Tensor = 0,
        tensor_format: str | None = None,
        seq_dim: int | None = None,
        inplace: bool = False,
        seq_len: int | None = None,
        shard_scheme: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(q', k')``: RoPE as :meth:`RotaryEmbedding.forward`, then the query and key factors.

        Arguments and shapes as in :meth:`ropekit.nn.RotaryEmbedding.forward`; ``k=None``
        returns ``(q', None)``. A shard of a sequence takes its global ``positions=``; DTensor
        q/k (``shard_scheme``) are refused.
        """
        _plain(q, k, shard_scheme)
        seq_dim = order_of(q, k, positions, tensor_format, seq_dim)
        if k is None:
            return self.rotate_one(q, positions, offset=offset, seq_dim=seq_dim, inplace=inplace, seq_len=seq_len), None
        rq, rk = super().forward(q, k, positions, offset=offset, seq_dim=seq_dim, inplace=inplace, seq_len=seq_len)
        return (self._scaled(q, rq, positions, offset, seq_dim, False, inplace),
                self._scaled(k, rk, positions, offset, seq_dim, True, inplace))

