"""Properties the seeds prove, checked on ropekit's fast float32 path.

* a rotation preserves the norm;
* ``<RoPE(q, m), RoPE(k, n)> = q^T R_{n-m} k`` depends on ``n - m`` only (seed 002, 2.4),
  including at positions around 1e6, where float32 angles (the recipe most ports use) break it.
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

from ropekit import apply_rotary, base_inv_freq, cos_sin, rotation_matrix

LAYOUTS = ["half", "interleaved"]
HEAD_DIM = 128


def _qk(seed, head_dim=HEAD_DIM):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(head_dim, generator=g), torch.randn(head_dim, generator=g)


def ropekit_score(q, k, m, n, layout, base=10000.0):
    """Score of q at position m and k at position n through ropekit (float32 tables and arithmetic)."""
    inv_freq = base_inv_freq(q.shape[-1], base)
    cos, sin = cos_sin(torch.tensor([m, n]), inv_freq)
    qr = apply_rotary(q[None], cos[:1], sin[:1], layout=layout)[0]
    kr = apply_rotary(k[None], cos[1:], sin[1:], layout=layout)[0]
    return float((qr.double() * kr.double()).sum())


def float32_angle_score(q, k, m, n, base=10000.0):
    """The same score with the common recipe: angles = positions.float() * inv_freq.float() (half layout)."""
    d = q.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.tensor([m, n]).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()

    def rotate_half(x):
        return torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)

    qr = q * cos[0] + rotate_half(q) * sin[0]
    kr = k * cos[1] + rotate_half(k) * sin[1]
    return float((qr.double() * kr.double()).sum())


@given(
    positions=st.lists(st.integers(0, 10**6), min_size=1, max_size=8),
    layout=st.sampled_from(LAYOUTS),
    head_dim=st.sampled_from([2, 16, 128]),
    seed=st.integers(0, 1000),
)
def test_norm_preserved(positions, layout, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(positions), 3, head_dim, generator=g).transpose(0, 1)  # (heads, seq, d)
    cos, sin = cos_sin(torch.tensor(positions), base_inv_freq(head_dim))
    out = apply_rotary(x, cos, sin, layout=layout)
    torch.testing.assert_close(out.double().norm(dim=-1), x.double().norm(dim=-1), rtol=2e-6, atol=0)
    # and it is not the identity (except at position 0)
    moved = (out - x).abs().amax(dim=(0, 2))
    for p, delta in zip(positions, moved.tolist(), strict=True):
        assert (delta > 0) == (p > 0)


@given(
    m=st.integers(0, 10**6),
    n=st.integers(0, 10**6),
    shift=st.integers(0, 10**6),
    layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 1000),
)
def test_score_depends_only_on_relative_position(m, n, shift, layout, seed):
    q, k = _qk(seed)
    s1 = ropekit_score(q, k, m, n, layout)
    s2 = ropekit_score(q, k, m + shift, n + shift, layout)
    scale = float(q.norm() * k.norm())
    assert abs(s1 - s2) / scale < 1e-5


@given(m=st.integers(0, 10**6), n=st.integers(0, 10**6), layout=st.sampled_from(LAYOUTS),
       seed=st.integers(0, 1000))
def test_score_equals_closed_form(m, n, layout, seed):
    """<RoPE(q, m), RoPE(k, n)> = q^T R_{n-m} k with R the float64 oracle matrix."""
    q, k = _qk(seed, 32)
    inv_freq = base_inv_freq(32)
    want = float(q.double() @ rotation_matrix(n - m, inv_freq, layout=layout) @ k.double())
    got = ropekit_score(q, k, m, n, layout)
    assert abs(got - want) / float(q.norm() * k.norm()) < 1e-5


def test_float32_angles_drift_at_1e6():
    """Documented contrast: the float32-angle recipe fails the relative-position test at ~1e6.

    Same q, k and positions on which ropekit's drift is asserted < 1e-5; the recipe drifts by more
    than 1e-4 (its angles carry errors ~ m * 6e-8 rad), so the test above is able to fail.
    """
    q, k = _qk(0)
    scale = float(q.norm() * k.norm())
    for m, n, shift in [(1_000_003, 1_000_040, 999_993), (0, 17, 1_000_000), (5, 2, 2**20)]:
        ours = abs(ropekit_score(q, k, m, n, "half") - ropekit_score(q, k, m + shift, n + shift, "half"))
        theirs = abs(float32_angle_score(q, k, m, n) - float32_angle_score(q, k, m + shift, n + shift))
        assert ours / scale < 1e-5
        assert theirs / scale > 1e-4
    # at small positions the recipe is fine: the contrast is about precision, not a different formula
    small = abs(float32_angle_score(q, k, 3, 10) - ropekit_score(q, k, 3, 10, "half"))
    assert small / scale < 1e-5


@given(m=st.integers(0, 10**5), n=st.integers(0, 10**5), layout=st.sampled_from(LAYOUTS))
def test_rotations_compose(m, n, layout):
    """RoPE(RoPE(x, m), n) = RoPE(x, m + n) (float64 tables built from the oracle's angles)."""
    x = torch.randn(4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(m % 97))
    inv_freq = base_inv_freq(16)

    def tab(p):
        a = torch.tensor([float(p)], dtype=torch.float64)[:, None] * inv_freq
        return a.cos(), a.sin()

    twice = apply_rotary(apply_rotary(x, *tab(m), layout=layout), *tab(n), layout=layout)
    once = apply_rotary(x, *tab(m + n), layout=layout)
    torch.testing.assert_close(twice, once, rtol=0, atol=1e-9)
