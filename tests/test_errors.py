"""Bad input raises ValueError/TypeError whose message names the offending argument."""

import pytest
import torch

from ropekit import (
    RotaryEmbedding,
    apply_reference,
    apply_rotary,
    base_inv_freq,
    channel_permutation,
    cos_sin,
    inv_frequencies,
    permute_qk_weight,
    rotation_angles,
    rotation_matrix,
)


def tables(n=4, half=4):
    return cos_sin(torch.arange(n), base_inv_freq(2 * half))


# -- dimensions ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [7, 0, -2])
def test_odd_or_nonpositive_rotary_dim(bad):
    with pytest.raises(ValueError, match="rotary_dim"):
        inv_frequencies(bad)
    with pytest.raises(ValueError, match="rotary_dim"):
        base_inv_freq(bad)
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(8, rotary_dim=bad)


@pytest.mark.parametrize("bad", [7, 0])
def test_odd_head_dim(bad):
    with pytest.raises(ValueError, match="head_dim"):
        RotaryEmbedding(bad)
    with pytest.raises(ValueError, match="head_dim"):
        channel_permutation(bad, "interleaved", "half")


def test_non_int_dims():
    with pytest.raises(TypeError, match="rotary_dim"):
        inv_frequencies(8.0)
    with pytest.raises(TypeError, match="head_dim"):
        RotaryEmbedding(True)


def test_rotary_dim_larger_than_head_dim():
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(8, rotary_dim=16)
    with pytest.raises(ValueError, match="rotary_dim"):
        channel_permutation(8, "interleaved", "half", rotary_dim=16)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_base(bad):
    with pytest.raises(ValueError, match="base"):
        inv_frequencies(8, bad)
    with pytest.raises(ValueError, match="base"):
        RotaryEmbedding(8, base=bad)


def test_bad_seq_len():
    with pytest.raises(ValueError, match="seq_len"):
        inv_frequencies(8, seq_len=-1)


# -- tables against x ----------------------------------------------------------------------


def test_x_narrower_than_tables():
    cos, sin = tables(half=4)  # rotary_dim 8
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary(torch.randn(2, 4, 6), cos, sin)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_reference(torch.randn(2, 4, 6), torch.arange(4), base_inv_freq(8))


def test_module_head_dim_mismatch():
    with pytest.raises(ValueError, match="head_dim"):
        RotaryEmbedding(8)(torch.randn(1, 2, 3, 6), None)


@pytest.mark.parametrize(
    "x_shape,table_shape",
    [((2, 3, 5, 8), (4, 4)), ((2, 3, 5, 8), (3, 1, 5, 4)), ((5, 8), (2, 5, 4)), ((2, 5, 8), (3, 4))],
)
def test_mismatched_broadcast_shapes(x_shape, table_shape):
    cos = torch.zeros(table_shape)
    with pytest.raises(ValueError, match="cos"):
        apply_rotary(torch.randn(x_shape), cos, cos.clone())


def test_mismatched_broadcast_names_x():
    with pytest.raises(ValueError, match=r"x .*shape|x of shape"):
        apply_rotary(torch.randn(2, 5, 8), torch.zeros(4, 4), torch.zeros(4, 4))


def test_cos_sin_shape_mismatch():
    with pytest.raises(ValueError, match="cos and sin"):
        apply_rotary(torch.randn(2, 5, 8), torch.zeros(5, 4), torch.zeros(5, 3))
    with pytest.raises(ValueError, match="cos"):
        apply_rotary(torch.randn(2, 5, 8), torch.zeros(()), torch.zeros(()))


def test_non_float_inputs():
    cos, sin = tables()
    with pytest.raises(TypeError, match="x"):
        apply_rotary(torch.ones(4, 8, dtype=torch.int64), cos, sin)
    with pytest.raises(TypeError, match="cos"):
        apply_rotary(torch.randn(4, 8), cos.long(), sin)
    with pytest.raises(TypeError, match="sin"):
        apply_rotary(torch.randn(4, 8), cos, sin.long())
    with pytest.raises(TypeError, match="x"):
        apply_rotary([1.0, 2.0], cos, sin)
    with pytest.raises(TypeError, match="inplace"):
        apply_rotary(torch.randn(4, 8), cos, sin, inplace=1)


# -- positions -----------------------------------------------------------------------------


def test_float_positions():
    inv_freq = base_inv_freq(8)
    with pytest.raises(TypeError, match="positions"):
        cos_sin(torch.tensor([0.0, 1.0]), inv_freq)
    with pytest.raises(TypeError, match="positions"):
        rotation_angles(torch.tensor([0.5]), inv_freq)
    with pytest.raises(TypeError, match="positions"):
        RotaryEmbedding(8)(torch.randn(1, 1, 2, 8), None, positions=torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="positions"):
        cos_sin([0, 1], inv_freq)
    with pytest.raises(TypeError, match="positions"):
        cos_sin(torch.tensor([True, False]), inv_freq)


def test_negative_positions():
    with pytest.raises(ValueError, match="positions"):
        cos_sin(torch.tensor([0, -1]), base_inv_freq(8))
    rope = RotaryEmbedding(8)
    with pytest.raises(ValueError, match="positions"):
        rope(torch.randn(1, 1, 2, 8), None, positions=torch.tensor([3, -1]))
    with pytest.raises(ValueError, match="offset"):
        rope(torch.randn(1, 1, 2, 8), None, offset=-1)
    with pytest.raises(ValueError, match="offset"):
        rope(torch.randn(2, 1, 2, 8), None, offset=torch.tensor([0, -5]))


def test_positions_wrong_shape():
    rope = RotaryEmbedding(8)
    with pytest.raises(ValueError, match="positions"):
        rope(torch.randn(1, 1, 3, 8), None, positions=torch.arange(4))
    with pytest.raises(ValueError, match="positions"):
        rope(torch.randn(2, 1, 3, 8), None, positions=torch.zeros(3, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="positions"):
        rope(torch.randn(1, 1, 3, 8), None, positions=torch.arange(3), offset=2)
    with pytest.raises(ValueError, match="offset"):
        rope(torch.randn(1, 1, 3, 8), None, offset=1.5)


def test_seq_dim_and_length_mismatch():
    rope = RotaryEmbedding(8)
    with pytest.raises(ValueError, match="seq_dim"):
        rope(torch.randn(1, 1, 3, 8), None, seq_dim=-1)
    with pytest.raises(ValueError, match="seq_dim"):
        rope(torch.randn(1, 1, 3, 8), None, seq_dim=4)
    with pytest.raises(ValueError, match="seq_dim"):
        rope(torch.randn(1, 1, 3, 8), torch.randn(1, 1, 4, 8))


def test_inv_freq_shape_and_type():
    with pytest.raises(ValueError, match="inv_freq"):
        rotation_angles(torch.arange(3), torch.ones(2, 2))
    with pytest.raises(TypeError, match="inv_freq"):
        cos_sin(torch.arange(3), [1.0, 0.01])


# -- layouts and backends ------------------------------------------------------------------


def test_unknown_layout():
    cos, sin = tables()
    with pytest.raises(ValueError, match="layout"):
        apply_rotary(torch.randn(4, 8), cos, sin, layout="spiral")
    with pytest.raises(ValueError, match="layout"):
        RotaryEmbedding(8, layout="spiral")
    with pytest.raises(ValueError, match="layout"):
        rotation_matrix(0, base_inv_freq(4), layout="spiral")
    with pytest.raises(ValueError, match="src"):
        permute_qk_weight(torch.randn(8, 2), 1, src="spiral", dst="half")
    with pytest.raises(ValueError, match="dst"):
        permute_qk_weight(torch.randn(8, 2), 1, src="half", dst="spiral")


def test_unknown_backend():
    cos, sin = tables()
    with pytest.raises(ValueError, match="backend"):
        apply_rotary(torch.randn(4, 8), cos, sin, backend="cuda-magic")


@pytest.mark.parametrize("bad", [0, -2, 3, 2.0, True])
def test_bad_n_heads(bad):
    with pytest.raises((ValueError, TypeError), match="n_heads"):
        permute_qk_weight(torch.randn(8, 4), bad, src="interleaved", dst="half")


def test_permute_bad_weight():
    with pytest.raises(ValueError, match="head_dim"):
        permute_qk_weight(torch.randn(6, 4), 2, src="interleaved", dst="half")  # head_dim 3
    with pytest.raises(ValueError, match="w"):
        permute_qk_weight(torch.randn(2, 4, 4), 1, src="interleaved", dst="half")
    with pytest.raises(TypeError, match="w"):
        permute_qk_weight([[1.0]], 1, src="interleaved", dst="half")
