r"""Numbers behind ``ropekit inspect`` / ``decay`` and the lab's report: wavelengths, decay, base bounds, regimes.

Everything is float64 and works on a 1-D ``inv_freq`` tensor of shape ``(rotary_dim // 2,)``
(``theta_i``, radians per token), so the scaled frequencies of any rule go through the same code.

- :func:`decay_bound` -- RoFormer's long-term decay bound (Su et al. 2021, eq. 35-37, Figure 2)::

      bound(r) = (1 / (d/2)) * sum_{j=1}^{d/2} |S_j|,   S_j = sum_{i=0}^{j-1} exp(1j * r * theta_i)

- :func:`similarity_margin` -- Men et al. 2024, "Base of RoPE Bounds Context Length",
  arXiv:2405.14591, Theorem 1: for i.i.d. query/key components of variance ``sigma^2`` and a
  similar key ``k* = q + eps``, ``E[q^T R_m k*] - E[q^T R_m k] = 2 sigma^2 B_m`` with
  ``B_m = sum_i cos(m theta_i)``. The model can tell a similar token from a random one at
  distance ``m`` only while ``B_m >= 0``.
- :func:`base_lower_bound` -- their bound: the smallest base with ``B_m >= 0`` for every
  ``m`` in ``[0, L]`` (see its docstring for how it is searched and what is approximated).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from .frequencies import base_inv_freq

if TYPE_CHECKING:
    from .scaling import ScalingRule

__all__ = [
    "EXACT_POSITIONS",
    "base_lower_bound",
    "bound_positions",
    "decay_bound",
    "first_negative_position",
    "pair_regimes",
    "rotations",
    "similarity_margin",
    "wavelengths",
]

#: Positions scanned exactly by the base-bound search; longer contexts are subsampled.
EXACT_POSITIONS = 1 << 20
#: Rows of ``(positions x pairs)`` evaluated at once (bounds memory at ~32 MB of float64).
_CHUNK = 1 << 15
#: Entries of ``(positions x pairs)`` evaluated at once: fewer rows for more pairs (a wide head).
_CHUNK_ENTRIES = _CHUNK * 128
#: Pairs up to which the base-bound search scans :data:`EXACT_POSITIONS` positions; wider heads scan
#: proportionally fewer, so that the search costs the same for any rotary dimension.
_EXACT_PAIRS = 256


def _chunk_rows(pairs: int) -> int:
    """Rows per chunk for ``pairs`` columns: at most :data:`_CHUNK`, at most :data:`_CHUNK_ENTRIES` entries."""
    return max(1, min(_CHUNK, _CHUNK_ENTRIES // max(1, pairs)))


def wavelengths(inv_freq: torch.Tensor) -> torch.Tensor:
    """``2 pi / theta_i`` in tokens: float64 ``(n_pairs,)``; ``inf`` for a zero frequency (p-RoPE)."""
    inv_freq = inv_freq.to(torch.float64)
    return torch.where(inv_freq > 0, 2 * math.pi / inv_freq, torch.full_like(inv_freq, math.inf))


def rotations(inv_freq: torch.Tensor, context: int) -> torch.Tensor:
    """Full turns pair ``i`` makes over ``context`` tokens: ``context * theta_i / (2 pi)``, float64."""
    return inv_freq.to(torch.float64) * context / (2 * math.pi)


def decay_bound(inv_freq: torch.Tensor, distances: torch.Tensor) -> torch.Tensor:
    """RoFormer's long-term decay bound at each relative distance (Su et al. 2021, eq. 37).

    Args:
        inv_freq: ``theta_i``, shape ``(n,)`` with ``n = d/2`` (any float dtype; used in float64).
        distances: relative distances ``r`` (any shape ``R``, int or float).

    Returns:
        float64 tensor of shape ``R``: ``(1/n) * sum_{j=1..n} |sum_{i<j} exp(1j r theta_i)|``.
        At ``r = 0`` every ``|S_j| = j``, so the value is ``(n + 1) / 2``.
    """
    theta = inv_freq.to(torch.float64).reshape(-1)
    flat = distances.to(torch.float64).reshape(-1)
    out = torch.empty_like(flat)
    rows = _chunk_rows(theta.numel())
    for start in range(0, flat.numel(), rows):
        angles = torch.outer(flat[start : start + rows], theta)
        partial = torch.polar(torch.ones_like(angles), angles).cumsum(dim=-1)  # S_1 .. S_n
        out[start : start + rows] = partial.abs().mean(dim=-1)
    return out.reshape(distances.shape)


def similarity_margin(inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Men et al.'s ``B_m = sum_i cos(m theta_i)`` for each ``m`` in ``positions``: float64, shape of ``positions``."""
    theta = inv_freq.to(torch.float64).reshape(-1)
    flat = positions.to(torch.float64).reshape(-1)
    out = torch.empty_like(flat)
    rows = _chunk_rows(theta.numel())
    for start in range(0, flat.numel(), rows):
        out[start : start + rows] = torch.cos(torch.outer(flat[start : start + rows], theta)).sum(-1)
    return out.reshape(positions.shape)


def bound_positions(context: int, budget: int = EXACT_POSITIONS) -> tuple[torch.Tensor, bool]:
    """Positions ``m`` at which ``B_m >= 0`` is checked for a context of ``context`` tokens.

    Returns ``(positions int64 (n,), exact)``: every integer in ``[0, context]`` when that is at
    most ``budget`` values, else every integer below ``budget // 16`` followed by evenly spaced
    integers up to ``context`` (``exact`` is then ``False``: a dip narrower than the spacing
    can be missed, which can only make the bound come out lower).
    """
    if context + 1 <= budget:
        return torch.arange(context + 1), True
    head = budget // 16
    tail = torch.linspace(head, context, budget - head, dtype=torch.float64).round().to(torch.int64)
    return torch.cat([torch.arange(head), tail]).unique(), False


def first_negative_position(inv_freq: torch.Tensor, positions: torch.Tensor) -> int | None:
    """The first ``m`` of the increasing ``positions`` with ``B_m < 0``, or ``None`` if there is none.

    Evaluated in growing chunks so that a base that fails early costs little.
    """
    theta = inv_freq.to(torch.float64).reshape(-1)
    start, rows = 0, _chunk_rows(theta.numel())
    chunk = min(512, rows)
    while start < positions.numel():
        block = positions[start : start + chunk]
        margin = torch.cos(torch.outer(block.to(torch.float64), theta)).sum(-1)
        negative = torch.nonzero(margin < 0)
        if negative.numel():
            return int(block[int(negative[0])])
        start += chunk
        chunk = min(2 * chunk, rows)
    return None


def base_lower_bound(
    rotary_dim: int, context: int, *, per_decade: int = 64, max_base: float = 1e15
) -> dict[str, Any]:
    """The smallest RoPE base for which ``B_m >= 0`` on ``[0, context]`` (Men et al. 2024, arXiv:2405.14591).

    The paper defines the bound through ``B_{m,theta} = sum_{i=0}^{d/2-1} cos(m * base^(-2i/d)) >= 0``
    for all ``m <= L`` and solves it numerically. So do we, with these approximations:

    1. ``m`` runs over the integers ``0..L`` (exact up to :data:`EXACT_POSITIONS`, fewer for more
       than 256 pairs; longer contexts are subsampled by :func:`bound_positions`).
    2. The admissible bases are not an interval: just below the bound they form a set of small
       islands. We scan the log grid ``base = 10 ** (k / per_decade)`` upward from 2, take the
       first grid base that satisfies the property, and bisect (in ``log base``, to 0.2%)
       between it and the failing grid point below. An island narrower than one grid step
       (3.7% for 64 per decade) can be missed, so a finer grid may report a somewhat lower base;
       the bound is accurate to about that step, not to the digits printed.

    Args:
        rotary_dim: ``d``, the rotated channels (positive, even).
        context: ``L``, the context length in tokens (positive).
        per_decade: grid points per decade of the base scan.
        max_base: give up above this base (``d = 2`` never satisfies the property: ``cos(2) < 0``).

    Returns:
        dict: ``base`` (float, ``None`` if not found below ``max_base``), ``context``,
        ``rotary_dim``, ``exact_positions`` (bool), ``method`` (one line).
    """
    pairs = rotary_dim // 2
    positions, exact = bound_positions(context, EXACT_POSITIONS * min(_EXACT_PAIRS, pairs) // max(1, pairs))

    coarse = positions[::16]

    def admissible(log_base: float) -> bool:
        theta = base_inv_freq(rotary_dim, 10.0**log_base)
        # most failing bases dip below zero over many positions: a strided pass rejects them cheaply
        return first_negative_position(theta, coarse) is None and first_negative_position(theta, positions) is None

    k = math.floor(math.log10(2.0) * per_decade)
    while not admissible(k / per_decade):
        k += 1
        if k / per_decade > math.log10(max_base):
            return _bound_result(None, context, rotary_dim, exact, per_decade)
    low, high = (k - 1) / per_decade, k / per_decade
    while high - low > math.log10(1.002):
        middle = (low + high) / 2
        low, high = (low, middle) if admissible(middle) else (middle, high)
    return _bound_result(10.0**high, context, rotary_dim, exact, per_decade)


def _bound_result(base: float | None, context: int, rotary_dim: int, exact: bool, per_decade: int) -> dict[str, Any]:
    return {
        "base": base,
        "context": context,
        "rotary_dim": rotary_dim,
        "exact_positions": exact,
        "method": (
            f"smallest base with sum_i cos(m*base^(-2i/d)) >= 0 for m = 0..{context} "
            f"({'every integer' if exact else 'subsampled positions'}); log-grid scan ({per_decade}/decade) "
            "+ bisection to 0.2% (Men et al. 2024, arXiv:2405.14591)"
        ),
    }


def pair_regimes(rule: ScalingRule | None, rotary_dim: int, base: float) -> list[str] | None:
    """Per pair: ``"extrapolated"``, ``"interpolated"`` or ``"blended"`` for YaRN and Llama 3; else ``None``.

    YaRN: the ramp of :meth:`ropekit.scaling.YaRN.ramp_bounds` is 0 (kept), 1 (divided by
    ``factor``) or in between. Llama 3: the wavelength band of the unscaled ``theta_i`` against
    ``L / high_freq_factor`` and ``L / low_freq_factor``, exactly as the rule computes it.
    """
    from .scaling import Llama3, YaRN

    theta = base_inv_freq(rotary_dim, base)
    if isinstance(rule, YaRN):
        low, high = rule.ramp_bounds(rotary_dim, base)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
        return ["extrapolated" if r == 0 else "interpolated" if r == 1 else "blended" for r in ramp.tolist()]
    if isinstance(rule, Llama3):
        length = rule.original_max_position_embeddings
        short, long = length / rule.high_freq_factor, length / rule.low_freq_factor
        regimes = []
        for w in (2 * math.pi / theta).tolist():
            if w > long:
                regimes.append("interpolated")
            elif w < short or short == long:  # equal edges: a hard cut, no blend (Llama 4 Scout)
                regimes.append("extrapolated")
            else:
                regimes.append("blended")
        return regimes
    return None
