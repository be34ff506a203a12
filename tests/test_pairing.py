"""The weights-only pairing detector (ropekit.rope.pairing): its statistic, its decision, its errors.

The oracle for "trained-like" weights is a construction: rows whose norms follow a smooth
(log-linear) profile in the rotary frequency, the property the detector rests on, stored in one
layout with :func:`ropekit.permute_qk_weight`. Real models (SmolLM2 in both layouts, tiny trained
char-LMs) are in tests/test_pairing_models.py.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pairing_helpers import smooth_heads
from ropekit import permute_qk_weight
from ropekit.rope.pairing import (
    LayoutEvidence,
    decide,
    detect_layout,
    frequency_index,
    head_log_row_norms,
    log_likelihood_ratio,
    residual_sum_of_squares,
)


def test_frequency_index_by_hand():
    assert frequency_index("half", 8).tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert frequency_index("interleaved", 8).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_permuting_rows_swaps_the_two_fits_exactly():
    """RSS of half rows under the half hypothesis == RSS of the same rows made interleaved under the interleaved one."""
    w = torch.randn(3 * 16, 10, dtype=torch.float64)
    moved = permute_qk_weight(w, 3, src="half", dst="interleaved")
    a = residual_sum_of_squares(head_log_row_norms(w, 3), "half")
    b = residual_sum_of_squares(head_log_row_norms(moved, 3), "interleaved")
    torch.testing.assert_close(a, b, rtol=1e-12, atol=0)


def test_a_perfect_log_linear_profile_has_no_residual_under_its_own_layout():
    i = frequency_index("half", 16).double()
    log_norms = (0.3 + 0.1 * i).expand(2, 16)
    assert residual_sum_of_squares(log_norms, "half").max() < 1e-25
    assert residual_sum_of_squares(log_norms, "interleaved").min() > 0.1
    assert (log_likelihood_ratio(log_norms) > 0).all()


@given(layout=st.sampled_from(["half", "interleaved"]), n_heads=st.integers(2, 6), layers=st.integers(2, 4),
       head_dim=st.sampled_from([16, 32, 64]), slope=st.floats(0.3, 2.0), seed=st.integers(0, 10_000))
def test_smooth_profiles_are_detected_in_both_layouts(layout, n_heads, layers, head_dim, slope, seed):
    projections = [(smooth_heads(n_heads, head_dim, layout=layout, slope=slope, seed=seed + k), n_heads)
                   for k in range(2 * layers)]
    got = detect_layout(projections, head_dim=head_dim)
    assert got.layout == got.leaning == layout, got
    assert got.heads == 2 * layers * n_heads and got.votes >= 0.75 and abs(got.z) >= 3
    assert (got.z > 0) == (layout == "half")


@given(layout=st.sampled_from(["half", "interleaved"]), rotary_dim=st.sampled_from([8, 16, 24]),
       seed=st.integers(0, 10_000))
def test_partial_rotary_looks_only_at_the_rotated_channels(layout, rotary_dim, seed):
    head_dim = 32
    w = smooth_heads(12, head_dim, layout=layout, rotary_dim=rotary_dim, seed=seed)
    w.reshape(12, head_dim, -1)[:, rotary_dim:] *= torch.rand(12, head_dim - rotary_dim, 1, dtype=torch.float64) * 50
    assert detect_layout([(w, 12)], head_dim=head_dim, rotary_dim=rotary_dim).layout == layout


@given(seed=st.integers(0, 10_000), scale=st.floats(1e-3, 1e3))
def test_a_factor_per_head_changes_nothing(seed, scale):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 16, 12, generator=g, dtype=torch.float64)
    per_head = torch.rand(4, 1, 1, generator=g, dtype=torch.float64) * scale + 1e-3
    base = log_likelihood_ratio(head_log_row_norms(w.reshape(64, 12), 4))
    torch.testing.assert_close(log_likelihood_ratio(head_log_row_norms((w * per_head).reshape(64, 12), 4)), base)


def test_a_norm_weight_applied_before_rotation_counts_like_the_row_norms():
    """Qwen3-style q_norm: flat rows, the profile in the norm weight g; per head (head_dim,) and per projection."""
    n, d = 8, 32
    flat = torch.randn(n * d, 40, dtype=torch.float64)
    flat = flat / flat.norm(dim=1, keepdim=True)
    g_half = (0.05 * frequency_index("half", d).double()).exp()
    g_inter = (0.05 * frequency_index("interleaved", d).double()).exp()
    assert detect_layout([(flat, n, g_half)] * 2, head_dim=d).layout == "half"
    assert detect_layout([(flat, n, g_inter)] * 2, head_dim=d).layout == "interleaved"
    assert detect_layout([(flat, n, g_inter.repeat(n))] * 2, head_dim=d).layout == "interleaved"
    assert detect_layout([(flat, n)] * 2, head_dim=d).layout is None  # unit rows: nothing to tell
    with pytest.raises(ValueError, match=r"projections\[0\]: norm_weight must have head_dim \(32\)"):
        detect_layout([(flat, n, torch.ones(5))], head_dim=d)


def test_random_weights_are_undecided():
    g = torch.Generator().manual_seed(3)
    projections = [(torch.randn(9 * 64, 576, generator=g), 9) for _ in range(30)]
    projections += [(torch.randn(3 * 64, 576, generator=g), 3) for _ in range(30)]
    got = detect_layout(projections, head_dim=64)
    assert got.layout is None and got.heads == 360 and abs(got.z) < 3, got


def test_null_rate_on_small_random_checkpoints():
    """Checkpoints of 2 layers with 4 + 2 heads of 16 channels, random: the detector rarely decides."""
    g = torch.Generator().manual_seed(0)

    def random_checkpoint():
        return [(torch.randn(heads * 16, 16, generator=g), heads) for heads in (4, 2, 4, 2)]

    decided = sum(detect_layout(random_checkpoint(), head_dim=16).decided for _ in range(200))
    assert decided <= 4  # 2 %: |z| >= 3 with 11 degrees of freedom and 75 % agreement


def test_decision_thresholds():
    strong = torch.tensor([5.0, 4.0, 6.0, 5.5, 4.5, 5.0, 6.5, 4.2])
    assert decide(strong).layout == "half" and decide(-strong).layout == "interleaved"
    assert decide(strong[:7]).layout is None and "fewer than 8 heads" in decide(strong[:7]).reason
    mixed = torch.tensor([5.0] * 7 + [-0.1] * 3)  # z large, 70 % agree
    got = decide(mixed)
    assert got.layout is None and got.leaning == "half" and "75%" in got.reason and math.isclose(got.votes, 0.7)
    assert decide(torch.zeros(10)).leaning is None
    same = decide(torch.full((10,), 2.0))  # every head the same: z is infinite, decided
    assert same.layout == "half" and same.as_dict()["z"] is None
    weak = decide(torch.tensor([1.0, -1.0] * 10 + [1.0]))
    assert weak.layout is None and "|z| < 3" in weak.reason


def test_evidence_describes_itself():
    decided = LayoutEvidence("interleaved", "interleaved", -18.64, 0.911, 360)
    assert decided.describe() == "interleaved (z = -18.6, 91% of 360 heads agree)"
    undecided = LayoutEvidence(None, "half", 1.96, 0.53, 360, "|z| < 3")
    assert undecided.describe() == "undecided (leaning half, z = +2.0, 53% of 360 heads agree; |z| < 3)"
    assert undecided.as_dict()["decided"] is False and decided.as_dict()["method"] == "rownorm-loglinear/1"


@pytest.mark.parametrize("call, message", [
    (lambda: detect_layout([], head_dim=8), "at least one"),
    (lambda: detect_layout([torch.ones(8, 2)], head_dim=8), r"projections\[0\] must be \(weight, n_heads\)"),
    (lambda: detect_layout([(torch.ones(8, 2), 3)], head_dim=8), r"expected n_heads \* head_dim = 3 \* 8"),
    (lambda: detect_layout([(torch.ones(8), 1)], head_dim=8), "2-D floating"),
    (lambda: detect_layout([(torch.ones(8, 2, dtype=torch.int64), 1)], head_dim=8), "2-D floating"),
    (lambda: detect_layout([(torch.ones(8, 2), 1)], head_dim=8, rotary_dim=2), "rotary_dim must be even, >= 4"),
    (lambda: detect_layout([(torch.ones(8, 2), 1)], head_dim=8, rotary_dim=5), "rotary_dim must be even"),
    (lambda: detect_layout([(torch.ones(8, 2), 1)], head_dim=8, rotary_dim=16), "<= head_dim"),
    (lambda: detect_layout([(torch.ones(8, 2), 1)], head_dim=8, degree=4), "degree must be below"),
    (lambda: detect_layout([(torch.ones(8, 2), 0)], head_dim=8), "n_heads must be a positive int"),
    (lambda: head_log_row_norms(torch.ones(9, 2), 2), "not divisible by n_heads=2"),
    (lambda: frequency_index("spiral", 8), "layout must be one of"),
])
def test_bad_input_names_the_argument(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()
