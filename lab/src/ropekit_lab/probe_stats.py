"""Per-layer statistics of ``ropekit probe``, from one layer's q and k before and after the rotation.

Definitions (``P = rotary_dim / 2`` pairs; pair ``i`` is channels ``(i, i + P)`` in the half layout,
``(2i, 2i + 1)`` interleaved; ``N`` tokens; statistics in float64):

* **pair norm** of head ``h``, pair ``i``: the mean over tokens of ``sqrt(x_a^2 + x_b^2)`` of the
  pre-rotation q (or k). A rotation keeps it, so pre- and post-rotation agree (in the true layout).
* **slow pairs**: pairs that never complete a rotation within the text, ``theta_i (N - 1) < 2 pi``;
  the others are **fast**. **Slow energy share**: ``sum_slow E|x_i|^2 / sum_i E|x_i|^2``.
* **attention** ``A = softmax(q_rot k_rot^T * scaling + causal mask)`` per query head (grouped-query
  heads share their key head), recomputed from the captured q/k in float64 with the module's
  ``scaling``, a sliding window when the text is longer than it, and logit soft-capping.
* **attention by distance** ``D[delta]``: the mean over queries ``i`` of ``A[i, i - delta]``, key 0
  excluded (``i - delta >= 1``): the first token collects attention whatever its distance (the
  sink), which would otherwise make far distances look attended. ``D[0]`` is the **diagonal**
  mass, ``D[1]`` the **previous-token** mass; **sink** is the mean of ``A[i, 0]`` over ``i >= 1``.
* **fast share of the previous-token logit**: per pair, ``c_i`` = the mean over ``i >= 2`` of the
  pair's part of ``q_rot[i] . k_rot[i - 1]``; the share is ``sum_fast |c_i| / sum |c_i|``.
* **ablation**: the previous-token mass recomputed with the slow pairs of q and k zeroed ("fast
  only") and with the fast pairs zeroed ("slow only"); channels past ``rotary_dim`` are kept.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

#: mass at distance 0 / 1 above which a head counts as diagonal / previous-token; sink above SINK
THRESHOLD, SINK = 0.3, 0.5


@dataclass(frozen=True)
class Geometry:
    """What the statistics need to know: pairing, rotated channels, frequencies, attention details."""

    layout: str
    rotary_dim: int
    inv_freq: torch.Tensor  # float64 (rotary_dim // 2,)
    scaling: float
    sliding_window: int | None = None
    softcap: float | None = None


def slow_pairs(inv_freq: torch.Tensor, tokens: int) -> torch.Tensor:
    """Bool ``(P,)``: pairs whose angle stays below a full turn over ``tokens`` positions (``theta (N-1) < 2 pi``)."""
    return inv_freq.to(torch.float64) * (tokens - 1) < 2 * math.pi


def pair_channels(layout: str, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel indices ``(a, b)`` of each pair: ``(i, i + P)`` (half) or ``(2i, 2i + 1)`` (interleaved)."""
    half = rotary_dim // 2
    if layout == "half":
        return torch.arange(half), torch.arange(half, rotary_dim)
    return torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)


def pair_energy(x: torch.Tensor, layout: str, rotary_dim: int) -> torch.Tensor:
    """``x_a^2 + x_b^2`` per pair: ``(..., head_dim)`` -> float64 ``(..., rotary_dim // 2)``."""
    a, b = pair_channels(layout, rotary_dim)
    x = x.to(torch.float64)
    return x[..., a] ** 2 + x[..., b] ** 2


def attention_probabilities(q: torch.Tensor, k: torch.Tensor, geometry: Geometry) -> torch.Tensor:
    """``softmax(q k^T * scaling + mask)``: q ``(H, N, d)``, k ``(KV, N, d)`` -> float64 ``(H, N, N)``."""
    heads, n = q.shape[0], q.shape[1]
    k = k.to(torch.float64).repeat_interleave(heads // k.shape[0], dim=0)
    logits = q.to(torch.float64) @ k.transpose(-1, -2) * geometry.scaling
    if geometry.softcap:
        logits = geometry.softcap * torch.tanh(logits / geometry.softcap)
    i = torch.arange(n)
    allowed = i[:, None] >= i[None, :]
    if geometry.sliding_window is not None:
        allowed &= (i[:, None] - i[None, :]) < geometry.sliding_window
    return logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1)


@functools.lru_cache(maxsize=2)
def _distance_index(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keep (N, N) bool, distance of each kept entry, entries per distance)`` for keys ``j >= 1``, ``j <= i``."""
    i = torch.arange(n)
    delta = i[:, None] - i[None, :]
    keep = (delta >= 0) & (i[None, :] >= 1)
    index = delta[keep]
    return keep, index, torch.bincount(index, minlength=n).to(torch.float64)


def attention_by_distance(attn: torch.Tensor) -> torch.Tensor:
    """``D[h, delta]`` for ``delta = 0 .. N-2``: the mean of ``A[h, i, i - delta]`` over ``i - delta >= 1``."""
    heads, n, _ = attn.shape
    keep, index, counts = _distance_index(n)
    sums = torch.zeros(heads, n, dtype=torch.float64).index_add_(1, index, attn[:, keep])
    return sums[:, : n - 1] / counts[: n - 1]


def _mass_at(q: torch.Tensor, k: torch.Tensor, geometry: Geometry, zero: torch.Tensor, delta: int) -> torch.Tensor:
    """Mass at ``delta`` with the pairs ``zero`` (bool ``(P,)``) of q and k set to 0."""
    a, b = pair_channels(geometry.layout, geometry.rotary_dim)
    channels = torch.cat([a[zero], b[zero]])
    q, k = q.clone(), k.clone()
    q[..., channels] = 0
    k[..., channels] = 0
    return attention_by_distance(attention_probabilities(q, k, geometry))[:, delta]


def layer_statistics(q: torch.Tensor, k: torch.Tensor, q_rot: torch.Tensor, k_rot: torch.Tensor,
                     geometry: Geometry) -> dict[str, torch.Tensor]:
    """Every statistic of one layer (module docstring): q ``(H, N, d)``, k ``(KV, N, d)``, before/after rotation.

    Returns float64 tensors: ``q_pair_norm`` ``(H, P)``, ``k_pair_norm`` ``(KV, P)``,
    ``q_slow_energy_share`` ``(H,)``, ``k_slow_energy_share`` ``(KV,)``, ``attention_by_distance``
    ``(H, N - 1)``, ``diagonal``, ``previous_token``, ``sink``, ``fast_share_prev_logit``,
    ``prev_fast_only``, ``prev_slow_only`` ``(H,)``.
    """
    n, r = q.shape[1], geometry.rotary_dim
    if n < 3:
        raise ValueError(f"the text must have at least 3 tokens for these statistics, got {n}")
    slow = slow_pairs(geometry.inv_freq, n)
    out = {}
    for name, x in (("q", q), ("k", k)):
        energy = pair_energy(x, geometry.layout, r)  # (heads, N, P)
        out[f"{name}_pair_norm"] = energy.sqrt().mean(dim=1)
        total = energy.sum(dim=(1, 2))
        out[f"{name}_slow_energy_share"] = energy[..., slow].sum(dim=(1, 2)) / total.clamp_min(1e-300)
    group = q.shape[0] // k.shape[0]
    per_head: dict[str, list[torch.Tensor]] = {"attention_by_distance": [], "sink": [], "prev_fast_only": [],
                                               "prev_slow_only": []}
    for h in range(q.shape[0]):  # one head at a time: memory O(N^2), not O(heads N^2)
        q_h, k_h = q_rot[h:h + 1], k_rot[h // group:h // group + 1]
        attn = attention_probabilities(q_h, k_h, geometry)
        per_head["attention_by_distance"].append(attention_by_distance(attn)[0])
        per_head["sink"].append(attn[0, 1:, 0].mean())
        del attn
        per_head["prev_fast_only"].append(_mass_at(q_h, k_h, geometry, slow, 1)[0])
        per_head["prev_slow_only"].append(_mass_at(q_h, k_h, geometry, ~slow, 1)[0])
    out.update({key: torch.stack(values) for key, values in per_head.items()})
    out["diagonal"], out["previous_token"] = out["attention_by_distance"][:, 0], out["attention_by_distance"][:, 1]
    a, b = pair_channels(geometry.layout, r)
    k_rep = k_rot.to(torch.float64).repeat_interleave(group, dim=0)
    qq, kk = q_rot.to(torch.float64)[:, 2:], k_rep[:, 1:-1]  # query i >= 2, key i - 1 >= 1
    contrib = (qq[..., a] * kk[..., a] + qq[..., b] * kk[..., b]).mean(dim=1) * geometry.scaling  # (H, P)
    out["fast_share_prev_logit"] = contrib[:, ~slow].abs().sum(-1) / contrib.abs().sum(-1).clamp_min(1e-300)
    return out


def head_kind(diagonal: float, previous: float, sink: float) -> str:
    """The head's kind: previous-token or diagonal (mass above :data:`THRESHOLD`), sink (above :data:`SINK`), other."""
    if previous > THRESHOLD:
        return "previous-token"
    if diagonal > THRESHOLD:
        return "diagonal"
    return "sink" if sink > SINK else "other"
