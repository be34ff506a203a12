"""Live checks of what RoPE's derivation proves (RoFormer, Su's blog posts), each with its measured error.

These are run by ``ropekit report`` on the user's own machine so that every claim
is shown with a number, not asserted. Each check returns a :class:`Check`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ropekit import apply_reference, apply_rotary, cos_sin, inv_frequencies, permute_qk_weight, rotation_matrix


@dataclass(frozen=True)
class Check:
    """One verified claim: what was checked, the measured error and the bound it must meet."""

    name: str
    claim: str
    error: float
    bound: float

    @property
    def passed(self) -> bool:
        """True when the measured error is within the bound."""
        return self.error <= self.bound

    def as_dict(self) -> dict:
        """JSON-ready form (adds ``passed``)."""
        return {**asdict(self), "passed": self.passed}


def worked_example() -> Check:
    """The worked example of Su's derivation: q = [1, 0, 0, 1], d = 4, base 10000, position 2, both layouts."""
    inv_freq, _ = inv_frequencies(4, 10000.0)
    cos, sin = cos_sin(torch.tensor([2]), inv_freq)
    q = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    expected = {
        "interleaved": [math.cos(2), math.sin(2), -math.sin(0.02), math.cos(0.02)],
        "half": [math.cos(2), -math.sin(0.02), math.sin(2), math.cos(0.02)],
    }
    error = 0.0
    for layout, values in expected.items():
        got = apply_rotary(q, cos, sin, layout=layout)[0].double()
        error = max(error, float((got - torch.tensor(values, dtype=torch.float64)).abs().max()))
    return Check("worked_example", "RoPE([1,0,0,1], pos 2) matches the worked example computed by hand", error, 1e-6)


def two_d_score() -> Check:
    """The 2-D worked example: q = [1, 2], k = [3, 4], theta = 1, m = 1, n = 2 gives score 7.62626733416533."""
    theta = torch.tensor([1.0], dtype=torch.float64)
    q = torch.tensor([1.0, 2.0], dtype=torch.float64)
    k = torch.tensor([3.0, 4.0], dtype=torch.float64)
    score = (rotation_matrix(1, theta) @ q) @ (rotation_matrix(2, theta) @ k)
    error = abs(float(score) - 7.62626733416533)
    return Check("two_d_score", "<R_1 q, R_2 k> = 7.62626733416533 (computed by hand)", error, 1e-12)


def relative_property(head_dim: int = 128, base: float = 10000.0, position: int = 1_000_000, seed: int = 0) -> Check:
    """Score <R_m q, R_n k> must depend only on n - m: shift both positions by ~1e6 (float32 path)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(64, head_dim, generator=gen)
    k = torch.randn(64, head_dim, generator=gen)
    inv_freq, _ = inv_frequencies(head_dim, base)
    m = torch.randint(0, 4096, (64,), generator=gen)
    n = torch.randint(0, 4096, (64,), generator=gen)

    def scores(shift: int) -> torch.Tensor:
        cq, sq = cos_sin(m + shift, inv_freq)
        ck, sk = cos_sin(n + shift, inv_freq)
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum(-1).double()

    drift = (scores(0) - scores(position)).abs() / (q.norm(dim=-1) * k.norm(dim=-1)).double()
    return Check(
        "relative_property",
        f"score depends only on n - m (positions shifted by {position:.0e}, relative drift)",
        float(drift.max()),
        1e-5,
    )


def rotation_composition(head_dim: int = 64, base: float = 10000.0) -> Check:
    """R_m^T R_n = R_{n-m} and R^T R = I for the explicit float64 matrices (m, n up to 1e6)."""
    inv_freq, _ = inv_frequencies(head_dim, base)
    error = 0.0
    for m, n in ((0, 5), (17, 3), (123_456, 999_999), (1_000_000, 1)):
        rm, rn = rotation_matrix(m, inv_freq), rotation_matrix(n, inv_freq)
        error = max(error, float((rm.T @ rn - rotation_matrix(n - m, inv_freq)).abs().max()))
        error = max(error, float((rm.T @ rm - torch.eye(head_dim, dtype=torch.float64)).abs().max()))
    return Check("rotation_composition", "R_m^T R_n = R_(n-m), R orthogonal (float64 matrices)", error, 1e-9)


def norm_preserved(head_dim: int = 128, seed: int = 0) -> Check:
    """Rotation keeps every vector's norm (float32 path, positions up to 1e6)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(256, head_dim, generator=gen)
    positions = torch.randint(0, 1_000_000, (256,), generator=gen)
    cos, sin = cos_sin(positions, inv_frequencies(head_dim)[0])
    y = apply_rotary(x, cos, sin)
    error = float(((y.norm(dim=-1) - x.norm(dim=-1)).abs() / x.norm(dim=-1)).max())
    return Check("norm_preserved", "||RoPE(x)|| = ||x|| (relative)", error, 1e-5)


def matches_reference(seed: int = 0) -> Check:
    """The fast float32 kernel against the explicit float64 matrices, both layouts, partial rotary."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 33, 96, generator=gen)
    positions = torch.arange(33) * 997
    inv_freq, _ = inv_frequencies(64)
    cos, sin = cos_sin(positions, inv_freq)
    error = 0.0
    for layout in ("half", "interleaved"):
        fast = apply_rotary(x, cos, sin, layout=layout).double()
        ref = apply_reference(x, positions, inv_freq, layout=layout)
        error = max(error, float((fast - ref).abs().max() / ref.abs().max()))
    return Check("matches_reference", "fast float32 kernel = float64 rotation matrices (relative)", error, 1e-6)


def layout_equivalence(seed: int = 0) -> Check:
    """Interleaved RoPE with W equals half RoPE with permute_qk_weight(W): same attention scores."""
    gen = torch.Generator().manual_seed(seed)
    n_heads, head_dim, width, seq = 4, 16, 32, 12
    x = torch.randn(seq, width, generator=gen, dtype=torch.float64)
    wq = torch.randn(n_heads * head_dim, width, generator=gen, dtype=torch.float64)
    wk = torch.randn(n_heads * head_dim, width, generator=gen, dtype=torch.float64)
    cos, sin = cos_sin(torch.arange(seq), inv_frequencies(head_dim)[0])
    cos, sin = cos.double()[:, None], sin.double()[:, None]

    def scores(wq_: torch.Tensor, wk_: torch.Tensor, layout: str) -> torch.Tensor:
        q = apply_rotary((x @ wq_.T).view(seq, n_heads, head_dim), cos, sin, layout=layout)
        k = apply_rotary((x @ wk_.T).view(seq, n_heads, head_dim), cos, sin, layout=layout)
        return torch.einsum("qhd,khd->hqk", q, k)

    meta = scores(wq, wk, "interleaved")
    hf = scores(
        permute_qk_weight(wq, n_heads, src="interleaved", dst="half"),
        permute_qk_weight(wk, n_heads, src="interleaved", dst="half"),
        "half",
    )
    return Check("layout_equivalence", "interleaved W = half with permuted W (attention scores)",
                 float((meta - hf).abs().max() / meta.abs().max()), 1e-12)


def run_all() -> list[Check]:
    """Run every check in a fixed order."""
    return [
        worked_example(),
        two_d_score(),
        rotation_composition(),
        matches_reference(),
        norm_preserved(),
        relative_property(),
        layout_equivalence(),
    ]
