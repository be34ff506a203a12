"""Sinusoidal (Vaswani et al.) and learned absolute position encodings."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ropekit.nn import LearnedPositionalEmbedding, SinusoidalPositionalEncoding

torch.set_num_threads(1)


# --------------------------------------------------------------------------------------------
# sinusoidal
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("dim", "base"), [(8, 10000.0), (6, 10000.0), (16, 500.0)])
@pytest.mark.parametrize("k", [0, 1, 5, 37, 1000])
def test_sinusoidal_values_by_hand(dim, base, k):
    """p[k, 2i] = sin(k / base^(2i/d)), p[k, 2i+1] = cos(k / base^(2i/d)), from math.sin/cos."""
    enc = SinusoidalPositionalEncoding(dim, base=base).encoding(torch.tensor([k]), dtype=torch.float64)[0]
    for i in range(dim // 2):
        angle = k / base ** (2 * i / dim)
        assert enc[2 * i].item() == pytest.approx(math.sin(angle), abs=1e-12)
        assert enc[2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-12)


def test_sinusoidal_angles_are_float64_at_large_positions():
    """Float32 angles k*theta at k = 12345679 are off by up to 0.02 rad; float64 ones keep the table exact."""
    k = 12_345_679
    enc = SinusoidalPositionalEncoding(8).encoding(torch.tensor([k]))[0]
    assert enc.dtype == torch.float32
    expected = [f(k / 10000.0 ** (2 * i / 8)) for i in range(4) for f in (math.sin, math.cos)]
    torch.testing.assert_close(enc, torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)


@settings(max_examples=40, deadline=None)
@given(k=st.integers(0, 10_000), r=st.integers(0, 500), dim=st.sampled_from([2, 8, 32]))
def test_sinusoidal_shift_is_a_fixed_rotation_per_pair(k, r, dim):
    """(p_{k+r,2i}, p_{k+r,2i+1}) = M_i(r) (p_{k,2i}, p_{k,2i+1}) with M_i(r) independent of k.

    sin(a + b) = cos b sin a + sin b cos a and cos(a + b) = -sin b sin a + cos b cos a, so
    M_i(r) = [[cos r w_i, sin r w_i], [-sin r w_i, cos r w_i]] with w_i = base^(-2i/d).
    """
    module = SinusoidalPositionalEncoding(dim)
    table = module.encoding(torch.tensor([k, k + r]), dtype=torch.float64)
    p_k, p_kr = table[0].reshape(-1, 2), table[1].reshape(-1, 2)
    for i in range(dim // 2):
        b = r * 10000.0 ** (-2 * i / dim)
        rotation = torch.tensor([[math.cos(b), math.sin(b)], [-math.sin(b), math.cos(b)]], dtype=torch.float64)
        torch.testing.assert_close(p_kr[i], rotation @ p_k[i], atol=1e-9, rtol=0)


def test_sinusoidal_forward_adds_encoding():
    module = SinusoidalPositionalEncoding(8)
    x = torch.randn(2, 5, 8)
    table = module.encoding(torch.arange(20))
    torch.testing.assert_close(module(x), x + table[:5])
    torch.testing.assert_close(module(x, offset=7), x + table[7:12])
    rows = torch.tensor([[0, 1, 2, 3, 4], [9, 10, 11, 12, 13]])
    torch.testing.assert_close(module(x, rows), x + table[rows])
    torch.testing.assert_close(module(x, torch.arange(3, 8)), x + table[3:8])
    half = module(x.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16


def test_sinusoidal_has_no_state_and_survives_dtype_casts():
    module = SinusoidalPositionalEncoding(8)
    assert len(module.state_dict()) == 0 and not list(module.parameters())
    before = module.encoding(torch.arange(4000, 4010))
    module.to(torch.bfloat16)
    torch.testing.assert_close(module.encoding(torch.arange(4000, 4010)), before, atol=0, rtol=0)


def test_sinusoidal_errors_name_the_argument():
    with pytest.raises(ValueError, match="dim"):
        SinusoidalPositionalEncoding(7)
    with pytest.raises(ValueError, match="base"):
        SinusoidalPositionalEncoding(8, base=-1.0)
    module = SinusoidalPositionalEncoding(8)
    with pytest.raises(ValueError, match="x must have shape"):
        module(torch.randn(5, 8))
    with pytest.raises(ValueError, match="x must have shape"):
        module(torch.randn(1, 5, 6))
    with pytest.raises(ValueError, match="positions"):
        module(torch.randn(1, 5, 8), torch.arange(4))
    with pytest.raises(ValueError, match="positions"):
        module(torch.randn(2, 5, 8), torch.zeros(3, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="positions"):
        module(torch.randn(1, 5, 8), torch.arange(5.0))
    with pytest.raises(ValueError, match="offset"):
        module(torch.randn(1, 5, 8), offset=-1)
    with pytest.raises(ValueError, match="offset"):
        module(torch.randn(1, 5, 8), torch.arange(5), offset=2)


# --------------------------------------------------------------------------------------------
# learned
# --------------------------------------------------------------------------------------------
def test_learned_shapes_and_values():
    module = LearnedPositionalEmbedding(16, 8)
    weight = module.embedding.weight
    assert weight.shape == (16, 8)
    assert 0.005 < weight.std().item() < 0.05  # GPT-2 initialisation N(0, 0.02^2)
    x = torch.randn(2, 5, 8)
    out = module(x)
    assert out.shape == (2, 5, 8)
    torch.testing.assert_close(out, x + weight[:5])
    torch.testing.assert_close(module(x, offset=11), x + weight[11:16])
    rows = torch.tensor([[0, 1, 2, 3, 4], [3, 3, 3, 3, 15]])
    torch.testing.assert_close(module(x, rows), x + weight[rows])
    assert module.encoding(torch.zeros(3, 4, dtype=torch.long)).shape == (3, 4, 8)


def test_learned_is_trained_through_forward():
    module = LearnedPositionalEmbedding(10, 4)
    module(torch.zeros(1, 3, 4), torch.tensor([2, 5, 5])).sum().backward()
    touched = module.embedding.weight.grad.abs().sum(dim=-1)
    assert touched.nonzero().flatten().tolist() == [2, 5]
    assert touched[5] == 2 * touched[2]


def test_learned_cannot_extrapolate():
    module = LearnedPositionalEmbedding(16, 8)
    with pytest.raises(ValueError, match="max_positions=16.*extrapolate"):
        module(torch.randn(1, 17, 8))
    with pytest.raises(ValueError, match="extrapolate"):
        module(torch.randn(1, 2, 8), offset=15)
    with pytest.raises(ValueError, match="extrapolate"):
        module.encoding(torch.tensor([16]))
    module(torch.randn(1, 1, 8), offset=15)  # the last row is fine


def test_learned_errors_name_the_argument():
    with pytest.raises(ValueError, match="max_positions"):
        LearnedPositionalEmbedding(0, 8)
    with pytest.raises(TypeError, match="dim"):
        LearnedPositionalEmbedding(8, 4.0)
    module = LearnedPositionalEmbedding(8, 4)
    with pytest.raises(ValueError, match="x must have shape"):
        module(torch.randn(4))
    with pytest.raises(ValueError, match="positions"):
        module(torch.randn(1, 3, 4), torch.tensor([0, -1, 2]))
