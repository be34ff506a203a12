"""Numerical experiments shown by ``ropekit report``: attention vs distance, additive terms, scaling rules.

All in float64 on the CPU, seeded, and sized by the caller (``--quick`` uses small sizes).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ropekit import apply_reference, base_inv_freq, inv_frequencies
from ropekit.rope.analysis import similarity_margin
from ropekit.scaling import NTK, DynamicNTK, Linear, Llama3, YaRN


def attention_vs_distance(
    inv_freq: torch.Tensor, distances: torch.Tensor, *, samples: int = 256, attention_scale: float = 1.0, seed: int = 0
) -> dict[str, torch.Tensor]:
    r"""Logit ``q^T R_r k / sqrt(d)`` for random and for aligned ``q, k`` at each relative distance ``r``.

    Uses RoFormer eq. 35: with ``h_i = q_[pair i] conj(k_[pair i])`` (complex pairs),
    ``q^T R_r k = Re sum_i h_i exp(-1j r theta_i)``; both tables carry ``attention_scale``, so
    the logit is multiplied by its square. Queries and keys have i.i.d. standard-normal
    components; *random* draws ``k`` independently, *aligned* sets ``k = q``.

    Args:
        inv_freq: ``(n,)`` frequencies (``d = 2n``).
        distances: ``(R,)`` relative distances.
        samples: number of random ``(q, k)`` draws.
        attention_scale: the rule's factor on cos and sin.
        seed: generator seed.

    Returns:
        dict of float64 ``(R,)`` tensors: ``random_mean``, ``random_std``, ``aligned_mean``,
        ``aligned_std`` (over the draws) and ``theory`` = ``2 B_r / sqrt(d)`` scaled likewise,
        Men et al.'s expectation for the aligned case (the random one has expectation 0).
    """
    n = inv_freq.numel()
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(samples, n, 2, generator=gen, dtype=torch.float64)
    k = torch.randn(samples, n, 2, generator=gen, dtype=torch.float64)
    zq, zk = torch.view_as_complex(q), torch.view_as_complex(k)
    angles = torch.outer(inv_freq.to(torch.float64), distances.to(torch.float64))  # (n, R)
    phase = torch.polar(torch.ones_like(angles), -angles)
    factor = attention_scale**2 / math.sqrt(2 * n)
    out = {}
    for name, h in (("random", zq * zk.conj()), ("aligned", zq * zq.conj())):
        logits = (h @ phase).real * factor  # (samples, R)
        out[f"{name}_mean"] = logits.mean(0)
        out[f"{name}_std"] = logits.std(0)
    out["theory"] = 2 * similarity_margin(inv_freq, distances) * factor
    return out


def sinusoidal_terms(dim: int = 64, *, positions: int = 512, distance: int = 8, base: float = 10000.0, seed: int = 0):
    r"""Su's derivation: the four terms of ``(x_m + p_m)^T W_q^T W_k (x_n + p_n)`` versus RoPE's single term.

    The same two content vectors ``x_m, x_n`` are placed at absolute positions ``m = 0..positions-1``
    and ``n = m + distance``; ``p`` is the sinusoidal table ``p_{k,2i} = sin(k theta_i)``,
    ``p_{k,2i+1} = cos(k theta_i)``. The cross terms (content-position, position-content) and
    the position-position term change with ``m`` at a fixed distance; RoPE's single term
    ``(R_m W_q x_m)^T (R_n W_k x_n)`` (float64 rotation matrices) does not.

    Returns:
        ``(m, terms, rope)``: ``m`` int64 ``(P,)``; ``terms`` maps ``"content-content"``
        (``x_m^T W x_n``), ``"content-position"`` (``x_m^T W p_n``), ``"position-content"``
        (``p_m^T W x_n``), ``"position-position"`` (``p_m^T W p_n``) and ``"total"`` (their sum)
        to float64 ``(P,)`` tensors, ``W = W_q^T W_k``; ``rope`` float64 ``(P,)``.
    """
    gen = torch.Generator().manual_seed(seed)
    wq = torch.randn(dim, dim, generator=gen, dtype=torch.float64) / math.sqrt(dim)
    wk = torch.randn(dim, dim, generator=gen, dtype=torch.float64) / math.sqrt(dim)
    x_m, x_n = torch.randn(2, dim, generator=gen, dtype=torch.float64)
    w = wq.T @ wk
    m = torch.arange(positions)
    theta = base_inv_freq(dim, base)

    def table(pos: torch.Tensor) -> torch.Tensor:
        angles = pos.to(torch.float64)[:, None] * theta
        return torch.stack((angles.sin(), angles.cos()), dim=-1).reshape(len(pos), dim)

    p_m, p_n = table(m), table(m + distance)
    terms = {
        "content-content": (x_m @ w @ x_n).expand(positions),
        "content-position": p_n @ (w.T @ x_m),
        "position-content": p_m @ (w @ x_n),
        "position-position": (p_m @ w * p_n).sum(-1),
    }
    terms["total"] = sum(terms.values())
    q = apply_reference((wq @ x_m).expand(positions, dim), m, theta, layout="interleaved")
    k = apply_reference((wk @ x_n).expand(positions, dim), m + distance, theta, layout="interleaved")
    return m, terms, (q * k).sum(-1)


def _rule_factor_and_length(config: Any, context: int) -> tuple[float, int]:
    """``(factor, original length)`` for the comparison: the config's own, or 4x its context."""
    rule = config.scaling
    factor = getattr(rule, "factor", None)
    original = getattr(rule, "original_max_position_embeddings", None)
    if factor is None or factor <= 1.0:
        return 4.0, original or context
    return float(factor), original or max(1, round(context / factor))


def scaling_comparison(config: Any, context: int) -> dict[str, Any]:
    """inv_freq and attention scale of the config under each scaling rule, at the same factor and length.

    Rules: none, Linear (PI), NTK-aware, dynamic NTK (at ``factor * L`` tokens), YaRN, Llama 3
    (``low_freq_factor=1``, ``high_freq_factor=4``), and the config's own rule when it has one.
    A rule that does not apply to the config (e.g. YaRN with ``base <= 1``) is left out.

    Returns:
        dict: ``factor``, ``original`` and ``rules``, a list of ``{"name", "inv_freq" float64 (n,),
        "attention_scale"}``.
    """
    factor, original = _rule_factor_and_length(config, context)
    candidates: list[tuple[str, Any, int | None]] = []
    if config.scaling is not None:
        candidates.append((f"this config ({config.scaling.rope_type})", config.scaling, context))
    candidates += [
        ("none", None, None),
        (f"linear x{factor:g}", Linear(factor), None),
        (f"ntk x{factor:g}", NTK(factor), None),
        (f"dynamic x{factor:g} @ {int(factor * original):,}", DynamicNTK(factor, original), int(factor * original)),
        (f"yarn x{factor:g}", YaRN(factor, original), None),
        (f"llama3 x{factor:g}", Llama3(factor, 1.0, 4.0, original), None),
    ]
    rules = []
    for name, rule, seq_len in candidates:
        try:
            inv_freq, scale = inv_frequencies(config.rotary_dim, config.base, rule, seq_len=seq_len)
        except ValueError:
            continue
        rules.append({"name": name, "inv_freq": inv_freq, "attention_scale": scale})
    return {"factor": factor, "original": original, "rules": rules}
