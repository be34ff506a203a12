"""Which pairing a checkpoint was trained with, read from its q/k projection weights alone.

A trained RoPE model gives each rotary pair a scale that varies smoothly with the pair's
frequency: the norms of a head's q/k projection rows rise (or fall) log-linearly from the fastest
pair to the slowest, the same for both channels of a pair. Under the true pairing the channel ->
frequency map makes that profile smooth; under the other pairing it is scrambled (half rows read
as interleaved give a sawtooth, interleaved rows read as half mix frequency ``i`` with
``i + r/4`` on neighbouring channels). Testing which pairs are *closest in norm* does not work:
read as interleaved, half rows pair adjacent frequencies, whose norms agree as well as true
partners do.

The test, per head of ``rotary_dim = r`` rotated channels::

    y_c  = ln ||W[c, :]||  (+ ln |g_c| for a q/k norm weight g applied before the rotation)
    f_c  = c mod (r/2)   (half)      |   c // 2   (interleaved)        frequency index of channel c
    RSS  = least-squares residual of y on [1, f, .., f^degree] (f standardised), per layout
    LLR  = (r/2) * (ln RSS_interleaved - ln RSS_half)                  > 0 favours half

Each head is one vote; over all q and k heads of all layers ``z = mean(LLR) / (std(LLR) / sqrt(n))``
(a one-sample t statistic) and ``votes`` = the share of heads on the side of ``z``. The layout is
decided when ``|z| >= 3``, ``votes >= 0.75`` and there are at least ``8`` heads; otherwise the
answer is "undecided" (``layout=None``), which is the honest answer for untrained weights, models
without RoPE and models trained too briefly. The heads are not independent, so ``z`` is a
confidence figure, not a probability. Biases are ignored; channels past ``rotary_dim`` too.

Measured (docs/probe.md): SmolLM2-135M, transformers' rows half with z = +19.3 (92 % of 360 heads),
the GGUF's rows interleaved with z = -18.6; random weights of the same shapes |z| < 3.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..validation import check_layout, positive_int

__all__ = [
    "METHOD",
    "LayoutEvidence",
    "decide",
    "detect_layout",
    "frequency_index",
    "head_log_row_norms",
    "log_likelihood_ratio",
    "residual_sum_of_squares",
]

METHOD = "rownorm-loglinear/1"
Z_MIN, VOTES_MIN, MIN_HEADS = 3.0, 0.75, 8


@dataclass(frozen=True)
class LayoutEvidence:
    """What the weights say about the pairing.

    Attributes:
        layout: ``"half"`` or ``"interleaved"`` when decided, else ``None``.
        leaning: the side of ``z`` (``None`` when no head could vote).
        z: one-sample t statistic over heads of the per-head log-likelihood ratio (> 0: half).
        votes: share of heads whose ratio has the sign of ``z``.
        heads: number of heads that voted.
        reason: why it is undecided (empty when decided).
        method: name and version of the statistic.
    """

    layout: str | None
    leaning: str | None
    z: float
    votes: float
    heads: int
    reason: str = ""
    method: str = METHOD

    @property
    def decided(self) -> bool:
        """Whether the weights decide the layout."""
        return self.layout is not None

    def describe(self) -> str:
        """``"interleaved (z = -18.6, 91% of 360 heads agree)"`` or ``"undecided (...; reason)"``."""
        figures = f"z = {self.z:+.1f}, {100 * self.votes:.0f}% of {self.heads} heads agree"
        if self.decided:
            return f"{self.layout} ({figures})"
        lean = f"leaning {self.leaning}, " if self.leaning else ""
        return f"undecided ({lean}{figures}; {self.reason})"

    def as_dict(self) -> dict:
        """JSON-ready fields (a non-finite ``z`` becomes ``None``)."""
        return {"layout": self.layout, "leaning": self.leaning, "z": self.z if math.isfinite(self.z) else None,
                "votes": self.votes, "heads": self.heads, "decided": self.decided, "reason": self.reason,
                "method": self.method}


def frequency_index(layout: str, rotary_dim: int) -> torch.Tensor:
    """Index ``i`` of the rotary pair each of the ``rotary_dim`` channels belongs to, in ``layout``.

    Returns an int64 tensor ``(rotary_dim,)``: ``c mod (r/2)`` (half) or ``c // 2`` (interleaved).
    """
    check_layout(layout)
    channels = torch.arange(rotary_dim)
    return channels % (rotary_dim // 2) if layout == "half" else channels // 2


def _check_geometry(w: torch.Tensor, n_heads: int, head_dim: int | None, rotary_dim: int | None) -> tuple[int, int]:
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.dtype.is_floating_point:
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"w must be a 2-D floating q/k projection weight (n_heads * head_dim, in_features), "
                         f"got {shape}")
    positive_int(n_heads, "n_heads")
    if head_dim is None:
        if w.shape[0] % n_heads:
            raise ValueError(f"w has {w.shape[0]} rows, not divisible by n_heads={n_heads}")
        head_dim = w.shape[0] // n_heads
    elif w.shape[0] != n_heads * positive_int(head_dim, "head_dim"):
        raise ValueError(f"w has {w.shape[0]} rows, expected n_heads * head_dim = {n_heads} * {head_dim}")
    rotary_dim = head_dim if rotary_dim is None else positive_int(rotary_dim, "rotary_dim")
    if rotary_dim % 2 or rotary_dim > head_dim or rotary_dim < 4:
        raise ValueError(f"rotary_dim must be even, >= 4 (two pairs: a line through them leaves a residual) and "
                         f"<= head_dim ({head_dim}), got {rotary_dim}")
    return head_dim, rotary_dim


def head_log_row_norms(w: torch.Tensor, n_heads: int, *, head_dim: int | None = None, rotary_dim: int | None = None,
                       norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``ln`` of the row norms of each head's rotated channels, float64 ``(n_heads, rotary_dim)``.

    ``norm_weight`` (a per-head ``(head_dim,)`` or whole-projection ``(n_heads * head_dim,)`` q/k
    norm applied before the rotation, Qwen3 / OLMo 2) adds ``ln |g_c|``: the channel's scale is
    ``|g_c| ||W[c]||`` up to a factor common to the head. A zero row counts as ``1e-30``.
    """
    head_dim, rotary_dim = _check_geometry(w, n_heads, head_dim, rotary_dim)
    rows = w.detach().to(torch.float64).reshape(n_heads, head_dim, -1)[:, :rotary_dim]
    log_norms = rows.norm(dim=-1).clamp_min(1e-30).log()
    if norm_weight is not None:
        g = norm_weight.detach().to(torch.float64).flatten()
        if g.numel() == head_dim:
            g = g.expand(n_heads, head_dim)
        elif g.numel() == n_heads * head_dim:
            g = g.reshape(n_heads, head_dim)
        else:
            raise ValueError(f"norm_weight must have head_dim ({head_dim}) or n_heads * head_dim "
                             f"({n_heads * head_dim}) entries, got {g.numel()}")
        log_norms = log_norms + g[:, :rotary_dim].abs().clamp_min(1e-30).log()
    return log_norms


def residual_sum_of_squares(log_norms: torch.Tensor, layout: str, *, degree: int = 1) -> torch.Tensor:
    """Per head, the residual of a least-squares fit of ``log_norms`` ``(heads, r)`` on the frequency index.

    The fit is a polynomial of ``degree`` in the standardised :func:`frequency_index` of
    ``layout``. Returns float64 ``(heads,)``, at least ``1e-300`` (a perfect fit has a finite log).
    """
    rotary_dim = log_norms.shape[1]
    positive_int(degree, "degree")
    if rotary_dim // 2 <= degree:
        raise ValueError(f"degree must be below the number of pairs ({rotary_dim // 2}) so that the fit leaves a "
                         f"residual, got {degree}")
    f = frequency_index(layout, rotary_dim).to(torch.float64)
    x = (f - f.mean()) / f.std()
    design = torch.stack([x**p for p in range(degree + 1)], dim=1)  # (r, degree + 1)
    y = log_norms.to(torch.float64).t()  # (r, heads)
    fitted = design @ torch.linalg.lstsq(design, y).solution
    return ((y - fitted) ** 2).sum(0).clamp_min(1e-300)


def log_likelihood_ratio(log_norms: torch.Tensor, *, degree: int = 1) -> torch.Tensor:
    """Per head, ``(r/2) (ln RSS_interleaved - ln RSS_half)`` of ``log_norms`` ``(heads, r)``; > 0 favours half.

    This is the Gaussian log-likelihood ratio of the two fits (:func:`residual_sum_of_squares`)
    with ``r`` residuals each. Returns float64 ``(heads,)``.
    """
    rotary_dim = log_norms.shape[1]
    half = residual_sum_of_squares(log_norms, "half", degree=degree)
    interleaved = residual_sum_of_squares(log_norms, "interleaved", degree=degree)
    return 0.5 * rotary_dim * (interleaved.log() - half.log())


def decide(llr: torch.Tensor, *, z_min: float = Z_MIN, votes_min: float = VOTES_MIN,
           min_heads: int = MIN_HEADS) -> LayoutEvidence:
    """The verdict from per-head log-likelihood ratios ``llr`` ``(heads,)`` (> 0 favours half)."""
    llr = llr.detach().to(torch.float64).flatten()
    n = llr.numel()
    if n < 2:
        return LayoutEvidence(None, None, 0.0, 0.0, n, f"{n} head(s): too few to compare")
    mean, std = float(llr.mean()), float(llr.std())
    if std > 0:
        z = mean / (std / math.sqrt(n))
    else:
        z = math.copysign(math.inf, mean) if mean else 0.0
    if z == 0:
        return LayoutEvidence(None, None, 0.0, 0.0, n, "no head prefers either layout")
    leaning = "half" if z > 0 else "interleaved"
    votes = float((llr > 0).double().mean()) if z > 0 else float((llr < 0).double().mean())
    reasons = []
    if n < min_heads:
        reasons.append(f"fewer than {min_heads} heads")
    if abs(z) < z_min:
        reasons.append(f"|z| < {z_min:g}")
    if votes < votes_min:
        reasons.append(f"fewer than {100 * votes_min:.0f}% of heads agree")
    return LayoutEvidence(None if reasons else leaning, leaning, z, votes, n, "; ".join(reasons))


Projection = Sequence  # (weight, n_heads) or (weight, n_heads, norm_weight or None)


def detect_layout(projections: Iterable[Projection], *, head_dim: int, rotary_dim: int | None = None,
                  degree: int = 1, z_min: float = Z_MIN, votes_min: float = VOTES_MIN,
                  min_heads: int = MIN_HEADS) -> LayoutEvidence:
    """Tell the pairing of q/k projection weights (see the module docstring).

    Args:
        projections: every q and k projection of the model, each ``(weight, n_heads)`` or
            ``(weight, n_heads, norm_weight)``: weight ``(n_heads * head_dim, in_features)`` (rows =
            output channels, head-major; a key projection with the key/value head count), any
            floating dtype; ``norm_weight`` a q/k norm applied before the rotation, or ``None``.
        head_dim: channels per head.
        rotary_dim: rotated channels per head (default ``head_dim``); even, with more than
            ``degree + 1`` pairs.
        degree: degree of the polynomial in the frequency index (1: log-linear).
        z_min, votes_min, min_heads: the decision thresholds.

    Returns:
        a :class:`LayoutEvidence`; ``layout`` is ``None`` (undecided) unless the thresholds are met.

    Example::

        att = [layer.self_attn for layer in model.model.layers]
        detect_layout([(a.q_proj.weight, 9) for a in att] + [(a.k_proj.weight, 3) for a in att], head_dim=64)
    """
    ratios = []
    for i, item in enumerate(projections):
        if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
            raise TypeError(f"projections[{i}] must be (weight, n_heads) or (weight, n_heads, norm_weight), "
                            f"got {type(item).__name__}")
        w, heads, norm = (*item, None) if len(item) == 2 else item
        try:
            log_norms = head_log_row_norms(w, heads, head_dim=head_dim, rotary_dim=rotary_dim, norm_weight=norm)
        except ValueError as exc:
            raise ValueError(f"projections[{i}]: {exc}") from None
        ratios.append(log_likelihood_ratio(log_norms, degree=degree))
    if not ratios:
        raise ValueError("projections must hold at least one (weight, n_heads), got none")
    return decide(torch.cat(ratios), z_min=z_min, votes_min=votes_min, min_heads=min_heads)
