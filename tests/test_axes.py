"""AxisPlan: the multi-axis maths against the float64 rotation matrices, and its properties.

- a one-axis plan is today's 1-D RoPE bit for bit (tables and rotations), and so is M-RoPE on text
  tokens (every axis at the same position);
- in 2-D and 3-D the score <R(p) q, R(p') k> depends only on the displacement p' - p (hypothesis over
  plans, float and negative positions, shifts), against ``rotation_matrix`` in float64;
- the builders' maps (contiguous and interleaved M-RoPE, axial, pixel ladders) from their definitions;
- every bad argument is refused with a message naming it.
"""

import copy
import math
import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ropekit
from ropekit import AxisPlan, apply_reference, base_inv_freq, cos_sin, rotation_matrix
from ropekit.multiaxis import axial, axial_pixel, matrix_angles, mrope, named_plan, single_axis
from ropekit.rope.axes import pixel_ladder

PLANS = {
    "axial-2d": lambda: axial((8, 8), 100.0),
    "axial-3d-bases": lambda: axial((4, 6, 6), (10000.0, 256.0, 50.0)),
    "mrope-contiguous": lambda: mrope(base_inv_freq(16, 10000.0), [2, 3, 3]),
    "mrope-interleaved": lambda: mrope(base_inv_freq(16, 10000.0), [2, 3, 3], interleaved=True),
    "pixel-2d": lambda: axial_pixel((8, 8), 32.0),
    "flux-small": lambda: axial((4, 6, 6), 10000.0, axis_names=("index", "h", "w")),
}


# -- one axis = 1-D RoPE ---------------------------------------------------------------------------------
@given(
    rotary_dim=st.sampled_from([2, 8, 64, 128]),
    base=st.sampled_from([10000.0, 500000.0, 1e6]),
    positions=st.lists(st.integers(0, 10**6), min_size=1, max_size=16),
    scale=st.sampled_from([1.0, 1.1386]),
)
def test_one_axis_plan_is_1d_rope_bit_for_bit(rotary_dim, base, positions, scale):
    inv_freq = base_inv_freq(rotary_dim, base)
    pos = torch.tensor(positions)
    expected = cos_sin(pos, inv_freq, attention_scale=scale)
    plan = single_axis(inv_freq, attention_scale=scale)
    got = plan.cos_sin(pos[:, None])
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    # M-RoPE on text tokens: every axis at the token's position
    for interleaved in (False, True):
        section = [rotary_dim // 2 - 2 * (rotary_dim // 6), rotary_dim // 6, rotary_dim // 6]
        multi = mrope(inv_freq, section, interleaved=interleaved, attention_scale=scale)
        got = multi.cos_sin(pos[:, None].expand(-1, 3))
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    x = torch.randn(len(positions), 3, rotary_dim)
    assert torch.equal(ropekit.apply_rotary(x, got[0][:, None], got[1][:, None]),
                       ropekit.apply_rotary(x, expected[0][:, None], expected[1][:, None]))


# -- the score depends on the displacement only ------------------------------------------------------------
coordinate = st.one_of(st.integers(-300, 300), st.floats(-300, 300, allow_nan=False, width=32))


@given(
    name=st.sampled_from(sorted(PLANS)),
    data=st.data(),
    layout=st.sampled_from(["half", "interleaved"]),
)
def test_score_depends_only_on_the_displacement(name, data, layout):
    plan = PLANS[name]()
    n = plan.n_axes
    p = torch.tensor(data.draw(st.lists(coordinate, min_size=n, max_size=n)), dtype=torch.float64)
    p2 = torch.tensor(data.draw(st.lists(coordinate, min_size=n, max_size=n)), dtype=torch.float64)
    shift = torch.tensor(data.draw(st.lists(coordinate, min_size=n, max_size=n)), dtype=torch.float64)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    q, k = torch.randn(2, plan.rotary_dim + 2, generator=gen, dtype=torch.float64).float()
    r = plan.rotary_dim  # <q, R(p' - p) k>; the two channels past rotary_dim pass through
    reference = q[:r].double() @ rotation_matrix(p2 - p, plan, layout=layout) @ k[:r].double() + q[r:] @ k[r:]
    for origin in (torch.zeros(n, dtype=torch.float64), shift):
        cq, sq = plan.cos_sin((p + origin)[None])
        ck, sk = plan.cos_sin((p2 + origin)[None])
        q_rot = ropekit.apply_rotary(q[None], cq, sq, layout=layout)[0]
        k_rot = ropekit.apply_rotary(k[None], ck, sk, layout=layout)[0]
        score = q_rot.double() @ k_rot.double()
        assert abs(score - reference) <= 2e-6 * q.norm() * k.norm() + 1e-9


def test_rotation_matrix_of_a_plan_is_the_product_of_one_axis_rotations():
    # R(p) = prod_a R_a(p_a): the matrix of a vector position composes the per-axis rotations
    plan = axial((4, 6, 6), (10000.0, 256.0, 50.0))
    p = torch.tensor([3.0, -2.5, 7.0], dtype=torch.float64)
    product = torch.eye(16, dtype=torch.float64)
    for a in range(3):
        e = torch.zeros(3, dtype=torch.float64)
        e[a] = p[a]
        product = product @ rotation_matrix(e, plan, layout="half")
    torch.testing.assert_close(rotation_matrix(p, plan, layout="half"), product, rtol=0, atol=1e-13)
    R = rotation_matrix(p, plan)
    torch.testing.assert_close(R.T @ R, torch.eye(16, dtype=torch.float64), rtol=0, atol=1e-13)


# -- the builders' maps ------------------------------------------------------------------------------------
def test_contiguous_and_interleaved_mrope_maps():
    inv = base_inv_freq(128, 1e6)
    assert mrope(inv, [16, 24, 24]).axis.tolist() == [0] * 16 + [1] * 24 + [2] * 24
    axis = mrope(inv, [24, 20, 20], interleaved=True).axis.tolist()
    assert axis == [0, 1, 2] * 20 + [0] * 4
    # transformers' clamped slices: section [2, 3, 3] over 8 pairs gives w only 2 pairs (indices 2 and 5)
    assert mrope(torch.ones(8), [2, 3, 3], interleaved=True).axis.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert named_plan("qwen3-vl").counts == (24, 20, 20) and named_plan("qwen2-vl").counts == (16, 24, 24)


def test_axial_ladders_and_pixel_bands():
    plan = axial((16, 56, 56), 10000.0)
    for a, d in enumerate((16, 56, 56)):
        ladder = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        torch.testing.assert_close(plan.inv_freq[plan.pairs_on(a)], ladder, rtol=1e-15, atol=0)
    assert plan.axis_names == ("t", "h", "w") and plan.counts == (8, 28, 28)
    torch.testing.assert_close(pixel_ladder(4, 256.0), math.pi * torch.tensor([1.0, 1 + 127 / 3, 1 + 254 / 3, 128.0],
                                                                              dtype=torch.float64))
    torch.testing.assert_close(pixel_ladder(3, 224.0, spacing="log"),
                               math.pi * 2 ** torch.linspace(0, math.log2(224) - 1, 3, dtype=torch.float64))
    assert axial_pixel((8, 8), 32.0).axis.tolist() == [0] * 4 + [1] * 4
    wan = named_plan("wan", head_dim=128)
    assert wan.counts == (22, 21, 21) and named_plan("cogvideox", head_dim=64).counts == (8, 12, 12)
    dinov3 = named_plan("dinov3", head_dim=64)
    torch.testing.assert_close(dinov3.inv_freq[:16], 2 * math.pi * 100.0 ** (-torch.arange(0, 64, 4) / 64).double())


def test_gather_and_matrix_angles_agree_and_positions_may_be_negative_and_fractional():
    plan = PLANS["mrope-interleaved"]()
    positions = torch.tensor([[0.5, -3.25, 7.0], [-1e6, 2.0, 1e7]], dtype=torch.float64)
    assert torch.equal(plan.angles(positions), matrix_angles(positions, plan.freq_matrix()))
    assert torch.equal(plan.angles(positions.float()), plan.angles(positions.float().double()))
    assert torch.equal(plan.angles(torch.tensor([[1, 2, 3]], dtype=torch.int32)),
                       plan.angles(torch.tensor([[1.0, 2.0, 3.0]])))
    x = torch.randn(2, 4, 16)
    cos, sin = plan.cos_sin(positions)
    out = ropekit.apply_rotary(x, cos[:, None], sin[:, None], layout="half")
    ref = apply_reference(x, positions[:, None], plan, layout="half")
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6 * x.abs().max().item())


def test_attention_scale_multiplies_the_tables():
    plan = axial((4, 4), 100.0, attention_scale=1.5)
    cos, sin = plan.cos_sin(torch.tensor([[2, 3]]))
    torch.testing.assert_close(cos ** 2 + sin ** 2, torch.full((1, 4), 2.25))
    ref = apply_reference(torch.eye(8)[None], torch.tensor([[2, 3]]), plan, layout="interleaved")
    assert ref[0].double().det() == pytest.approx(1.5**8)


def test_plans_are_values():
    plan = PLANS["flux-small"]()
    same = axial((4, 6, 6), 10000.0, axis_names=("index", "h", "w"))
    assert plan == same and hash(plan) == hash(same) and plan != axial((4, 6, 6), 10000.0)
    assert pickle.loads(pickle.dumps(plan)) == plan and copy.deepcopy(plan) == plan
    with pytest.raises(AttributeError, match="immutable"):
        plan.attention_scale = 2.0
    plan.inv_freq.mul_(0)  # a new tensor: the plan is unchanged
    assert plan == same
    assert repr(plan) == "AxisPlan(pairs=8, axes=(index: 2, h: 3, w: 3))"
    assert plan.axis_index("h") == 1 and plan.pairs_on("w").tolist() == [5, 6, 7] and plan.rotary_dim == 16
    torch.testing.assert_close(plan.freq_matrix().sum(0), plan.inv_freq)


@pytest.mark.parametrize(
    "build, error, words",
    [
        (lambda: AxisPlan([1.0, 0.5], [0, 2], ("h", "w")), ValueError, ["axis[1]", "[0, 2)", "2"]),
        (lambda: AxisPlan([1.0, 0.5], [0], ("h", "w")), ValueError, ["one entry per pair", "2 and 1"]),
        (lambda: AxisPlan([1.0, float("nan")], [0, 1], ("h", "w")), ValueError, ["inv_freq[1]", "nan"]),
        (lambda: AxisPlan([1.0, -1.0], [0, 1], ("h", "w")), ValueError, ["inv_freq[1]", ">= 0", "-1.0"]),
        (lambda: AxisPlan([], [], ("h",)), ValueError, ["inv_freq", "empty"]),
        (lambda: AxisPlan([1.0], [0], ("h", "h")), ValueError, ["axis_names", "distinct"]),
        (lambda: AxisPlan([1.0], [0], "hw"), TypeError, ["axis_names", "'hw'"]),
        (lambda: AxisPlan([1.0], [0.0], ("h",)), ValueError, ["axis[0]", "0.0"]),
        (lambda: AxisPlan([1.0], [0], ("h",), attention_scale=0), ValueError, ["attention_scale", "0"]),
        (lambda: mrope(torch.ones(8), [2, 3, 2]), ValueError, ["mrope_section [2, 3, 2]", "7 pairs", "8 pairs"]),
        (lambda: mrope(torch.ones(8), [4, 4], interleaved=True), ValueError, ["2 entries", "3 axes"]),
        (lambda: mrope(torch.ones(8), [4, -1, 5]), ValueError, ["mrope_section[1]", "-1"]),
        (lambda: axial((16, 7)), ValueError, ["axes_dims[1]", "even", "7"]),
        (lambda: axial((16, 8), (100.0,)), ValueError, ["base", "one per axis", "[100.0]"]),
        (lambda: axial((4, 4), 100.0, axis_names=("h",)), ValueError, ["axis[2]", "[0, 1)"]),
        (lambda: pixel_ladder(4, 64.0, spacing="cubic"), ValueError, ["spacing", "'cubic'"]),
        (lambda: named_plan("sora"), ValueError, ["'sora'", "flux"]),
        (lambda: named_plan("eva02", head_dim=18), ValueError, ["multiple of 4", "18"]),
    ],
)
def test_bad_plans_are_refused_with_the_argument_named(build, error, words):
    with pytest.raises(error) as info:
        build()
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    "positions, error, words",
    [
        (torch.zeros(4, 2), ValueError, ["n_axes=3", "(4, 2)"]),
        (torch.tensor([[0.0, float("inf"), 1.0]]), ValueError, ["finite"]),
        (torch.ones(2, 3, dtype=torch.bool), TypeError, ["real", "torch.bool"]),
        ([[0, 1, 2]], TypeError, ["torch.Tensor", "list"]),
        (torch.tensor(3.0), ValueError, ["n_axes=3", "()"]),
    ],
)
def test_bad_positions_are_refused(positions, error, words):
    plan = PLANS["mrope-contiguous"]()
    with pytest.raises(error) as info:
        plan.cos_sin(positions)
    for word in words:
        assert word in str(info.value)
