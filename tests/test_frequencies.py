"""Frequencies, cos/sin tables and the rotation-matrix oracle, against math done in the test.

Independent oracles: Python's ``math`` module (float64 scalars), permutation matrices built
here by hand, and the worked examples of seed 002 (literal numbers).
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ropekit
from ropekit import base_inv_freq, cos_sin, inv_frequencies, rotation_angles, rotation_matrix


def python_inv_freq(rotary_dim, base):
    return [base ** (-(2 * i) / rotary_dim) for i in range(rotary_dim // 2)]


def python_rotation(position, thetas):
    """Block-diagonal R(m Theta) in the paper's (interleaved) layout, as nested Python lists."""
    d = 2 * len(thetas)
    r = [[0.0] * d for _ in range(d)]
    for i, theta in enumerate(thetas):
        c, s = math.cos(position * theta), math.sin(position * theta)
        r[2 * i][2 * i], r[2 * i][2 * i + 1] = c, -s
        r[2 * i + 1][2 * i], r[2 * i + 1][2 * i + 1] = s, c
    return torch.tensor(r, dtype=torch.float64)


# -- inverse frequencies -------------------------------------------------------------------


def test_seed_inv_freq_d4():
    inv_freq, scale = inv_frequencies(4, 10000.0)
    assert inv_freq.dtype == torch.float64
    assert inv_freq.tolist() == pytest.approx([1.0, 0.01], rel=1e-15, abs=0)
    assert scale == 1.0


@pytest.mark.parametrize("rotary_dim", [2, 8, 64, 128, 200])
@pytest.mark.parametrize("base", [10000.0, 500000.0, 1e6, 2.5])
def test_inv_freq_matches_python(rotary_dim, base):
    got = base_inv_freq(rotary_dim, base)
    want = torch.tensor(python_inv_freq(rotary_dim, base), dtype=torch.float64)
    assert got.shape == (rotary_dim // 2,)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=4e-16, atol=0)
    # strictly decreasing from 1 for base > 1
    if base > 1 and rotary_dim > 2:
        assert got[0] == 1.0 and bool((got[1:] < got[:-1]).all())


def test_inv_frequencies_plain_equals_base():
    inv_freq, scale = inv_frequencies(64, 500000.0)
    assert torch.equal(inv_freq, base_inv_freq(64, 500000.0)) and scale == 1.0


# -- angles and tables ---------------------------------------------------------------------


@given(
    positions=st.lists(st.integers(0, 10**7), min_size=1, max_size=6),
    rotary_dim=st.sampled_from([2, 16, 64, 128]),
    base=st.sampled_from([10000.0, 500000.0]),
)
def test_cos_sin_against_math(positions, rotary_dim, base):
    """Tables are float32 roundings of float64 angles: within ~1 float32 ulp even at 1e7."""
    thetas = python_inv_freq(rotary_dim, base)
    pos = torch.tensor(positions)
    cos, sin = cos_sin(pos, base_inv_freq(rotary_dim, base))
    assert cos.dtype == sin.dtype == torch.float32
    assert cos.shape == sin.shape == (len(positions), rotary_dim // 2)
    want_cos = torch.tensor([[math.cos(m * t) for t in thetas] for m in positions], dtype=torch.float64)
    want_sin = torch.tensor([[math.sin(m * t) for t in thetas] for m in positions], dtype=torch.float64)
    # float32 rounding is <= 6e-8; angle error of float64 at 1e7 is ~1e-9
    assert (cos.double() - want_cos).abs().max() < 1.2e-7
    assert (sin.double() - want_sin).abs().max() < 1.2e-7


def test_float32_angles_would_fail_the_table_test():
    """Contrast: the float32-angle recipe misses the same oracle by orders of magnitude at 1e6."""
    thetas = python_inv_freq(64, 10000.0)
    m = 1_000_003
    angles32 = torch.tensor([float(m)], dtype=torch.float32)[:, None] * torch.tensor(thetas, dtype=torch.float32)
    want = torch.tensor([[math.cos(m * t) for t in thetas]], dtype=torch.float64)
    assert (angles32.cos().double() - want).abs().max() > 1e-3
    cos, _ = cos_sin(torch.tensor([m]), base_inv_freq(64, 10000.0))
    assert (cos.double() - want).abs().max() < 1.2e-7


def test_rotation_angles_float64_and_shapes():
    pos = torch.tensor([[0, 3, 10**6], [7, 8, 2**40]])
    inv_freq = base_inv_freq(8)
    angles = rotation_angles(pos, inv_freq)
    assert angles.dtype == torch.float64 and angles.shape == (2, 3, 4)
    thetas = python_inv_freq(8, 10000.0)
    for idx in [(0, 0), (0, 2), (1, 2)]:
        m = int(pos[idx])
        assert angles[idx].tolist() == pytest.approx([m * t for t in thetas], rel=1e-15, abs=0)


def test_cos_sin_attention_scale_and_batched_positions():
    inv_freq = base_inv_freq(16)
    pos = torch.tensor([[1, 2, 3], [40, 50, 60]])
    cos1, sin1 = cos_sin(pos, inv_freq)
    cos2, sin2 = cos_sin(pos, inv_freq, attention_scale=1.25)
    assert cos2.shape == (2, 3, 8)
    torch.testing.assert_close(cos2, 1.25 * cos1, rtol=2e-7, atol=0)
    torch.testing.assert_close(sin2, 1.25 * sin1, rtol=2e-7, atol=0)
    # row i of a batched table is the table of row i's positions
    cos_row, _ = cos_sin(pos[1], inv_freq)
    assert torch.equal(cos1[1], cos_row)


# -- the rotation matrix oracle ------------------------------------------------------------


def test_seed_2d_score_via_rotation_matrix():
    """Seed 002: q=[1,2], k=[3,4], theta=1, m=1, n=2 -> 7.62626733416533."""
    q = torch.tensor([1.0, 2.0], dtype=torch.float64)
    k = torch.tensor([3.0, 4.0], dtype=torch.float64)
    theta = torch.tensor([1.0], dtype=torch.float64)
    score = (rotation_matrix(1, theta) @ q) @ (rotation_matrix(2, theta) @ k)
    assert abs(float(score) - 7.62626733416533) < 1e-12
    relative = q @ (rotation_matrix(1, theta) @ k)  # q^T R_{n-m} k
    assert abs(float(relative) - 7.62626733416533) < 1e-12


def test_seed_4d_example_via_rotation_matrix():
    """Seed 002: q=[1,0,0,1], d=4, base 10000, position 2."""
    q = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    inv_freq, _ = inv_frequencies(4, 10000.0)
    inter = rotation_matrix(2, inv_freq, layout="interleaved") @ q
    torch.testing.assert_close(inter, torch.tensor([-0.4161, 0.9093, -0.0200, 0.9998], dtype=torch.float64),
                               atol=1e-4, rtol=0)
    half = rotation_matrix(2, inv_freq, layout="half") @ q
    torch.testing.assert_close(half, torch.tensor([-0.4161, -0.0200, 0.9093, 0.9998], dtype=torch.float64),
                               atol=1e-4, rtol=0)


@given(position=st.integers(0, 10**6), rotary_dim=st.sampled_from([2, 4, 8, 32]),
       base=st.sampled_from([10000.0, 10.0]))
def test_rotation_matrix_matches_python_blocks(position, rotary_dim, base):
    thetas = python_inv_freq(rotary_dim, base)
    got = rotation_matrix(position, torch.tensor(thetas, dtype=torch.float64))
    assert got.dtype == torch.float64 and got.shape == (rotary_dim, rotary_dim)
    torch.testing.assert_close(got, python_rotation(position, thetas), rtol=0, atol=1e-12)


@given(position=st.integers(0, 10**6), rotary_dim=st.sampled_from([2, 8, 32]),
       layout=st.sampled_from(["half", "interleaved"]))
def test_rotation_matrix_orthogonal(position, rotary_dim, layout):
    r = rotation_matrix(position, base_inv_freq(rotary_dim), layout=layout)
    eye = torch.eye(rotary_dim, dtype=torch.float64)
    torch.testing.assert_close(r.T @ r, eye, rtol=0, atol=1e-13)
    torch.testing.assert_close(r @ r.T, eye, rtol=0, atol=1e-13)
    assert abs(float(torch.linalg.det(r)) - 1.0) < 1e-12


@given(m=st.integers(0, 10**6), n=st.integers(0, 10**6), rotary_dim=st.sampled_from([2, 8, 32]),
       layout=st.sampled_from(["half", "interleaved"]))
def test_rotation_matrix_relative(m, n, rotary_dim, layout):
    """R_m^T R_n = R_{n-m}: the identity RoPE is built on (seed 002, section 2.4)."""
    inv_freq = base_inv_freq(rotary_dim)
    lhs = rotation_matrix(m, inv_freq, layout=layout).T @ rotation_matrix(n, inv_freq, layout=layout)
    rhs = rotation_matrix(n - m, inv_freq, layout=layout)
    # float64 angles up to 1e6 carry ~1e-10 absolute error
    torch.testing.assert_close(lhs, rhs, rtol=0, atol=1e-9)


@pytest.mark.parametrize("rotary_dim", [2, 4, 8, 12])
@pytest.mark.parametrize("position", [0, 1, 5, 12345])
def test_rotation_matrix_half_is_permuted_interleaved(rotary_dim, position):
    """R_half = P^T R_interleaved P with x_inter = P x_half (half channel i <-> inter 2i, i+d/2 <-> 2i+1)."""
    half = rotary_dim // 2
    p = torch.zeros(rotary_dim, rotary_dim, dtype=torch.float64)
    for i in range(half):
        p[2 * i, i] = 1.0
        p[2 * i + 1, i + half] = 1.0
    inv_freq = base_inv_freq(rotary_dim)
    want = p.T @ rotation_matrix(position, inv_freq, layout="interleaved") @ p
    assert torch.equal(rotation_matrix(position, inv_freq, layout="half"), want)


def test_rotation_matrix_position_zero_is_identity():
    assert torch.equal(rotation_matrix(0, base_inv_freq(16)), torch.eye(16, dtype=torch.float64))


def test_public_api_names():
    for name in ["inv_frequencies", "cos_sin", "apply_rotary", "rotation_matrix", "permute_qk_weight",
                 "RotaryEmbedding", "apply_reference"]:
        assert callable(getattr(ropekit, name))


def test_plain_rope_dict_gives_plain_frequencies_and_a_stray_factor_is_refused():
    inv_freq, scale = ropekit.inv_frequencies(8, 10000.0, {"rope_type": "default", "rope_theta": 10000.0})
    assert scale == 1.0
    assert torch.equal(inv_freq, ropekit.base_inv_freq(8, 10000.0))
    with pytest.raises(ValueError, match="rope_type"):
        ropekit.inv_frequencies(8, 10000.0, {"factor": 2.0})
