"""Interleaved <-> half layouts: the q/k weight permutation of seed 004 and attention invariance."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ropekit import apply_rotary, base_inv_freq, channel_permutation, convert_layout, permute_qk_weight


def hf_permute(w, n_heads, dim1, dim2):
    """HF's convert_llama_weights_to_hf.py ``permute`` (seed 004), verbatim."""
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def expected_to_half(head_dim, rotary_dim):
    """Half position i holds interleaved channel 2i, position i + r/2 holds 2i+1; tail stays."""
    half = rotary_dim // 2
    perm = list(range(head_dim))
    for i in range(half):
        perm[i] = 2 * i
        perm[i + half] = 2 * i + 1
    return perm


@pytest.mark.parametrize("head_dim,rotary_dim", [(2, 2), (6, 6), (8, 8), (8, 4), (10, 6), (128, 32)])
def test_channel_permutation_by_hand(head_dim, rotary_dim):
    to_half = channel_permutation(head_dim, "interleaved", "half", rotary_dim=rotary_dim)
    to_inter = channel_permutation(head_dim, "half", "interleaved", rotary_dim=rotary_dim)
    assert to_half.tolist() == expected_to_half(head_dim, rotary_dim)
    assert to_half[to_inter].tolist() == list(range(head_dim))
    assert to_inter[to_half].tolist() == list(range(head_dim))
    for layout in ("half", "interleaved"):
        assert channel_permutation(head_dim, layout, layout).tolist() == list(range(head_dim))


def test_seed_004_six_by_six():
    """Seed 004: rows [2k-1, 2k] move to [k, d/2+k]: order 0,2,4,1,3,5."""
    w = torch.randn(6, 6)
    got = permute_qk_weight(w, 1, src="interleaved", dst="half")
    assert torch.equal(got, w[[0, 2, 4, 1, 3, 5]])
    assert torch.equal(got, hf_permute(w, 1, 6, 6))


@pytest.mark.parametrize("n_heads,head_dim,in_features", [(1, 2, 3), (4, 16, 64), (8, 64, 32), (2, 6, 5)])
def test_matches_hf_conversion_script(n_heads, head_dim, in_features):
    w = torch.randn(n_heads * head_dim, in_features)
    got = permute_qk_weight(w, n_heads, src="interleaved", dst="half")
    assert torch.equal(got, hf_permute(w, n_heads, n_heads * head_dim, in_features))


@given(
    n_heads=st.integers(1, 4),
    head_dim=st.sampled_from([2, 4, 8, 12]),
    rotary_frac=st.sampled_from([1.0, 0.5, 0.25]),
    in_features=st.integers(1, 5),
    bias=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    seed=st.integers(0, 1000),
)
def test_permute_round_trip_bit_exact(n_heads, head_dim, rotary_frac, in_features, bias, dtype, seed):
    rotary_dim = max(2, int(head_dim * rotary_frac) // 2 * 2)
    shape = (n_heads * head_dim,) if bias else (n_heads * head_dim, in_features)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    there = permute_qk_weight(w, n_heads, src="interleaved", dst="half", rotary_dim=rotary_dim)
    back = permute_qk_weight(there, n_heads, src="half", dst="interleaved", rotary_dim=rotary_dim)
    assert there.dtype == dtype and there.shape == w.shape
    assert torch.equal(back, w)
    # rows are only moved: same multiset per head, tails untouched
    heads = there.reshape(n_heads, head_dim, -1)
    orig = w.reshape(n_heads, head_dim, -1)
    assert torch.equal(heads[:, rotary_dim:], orig[:, rotary_dim:])
    assert torch.equal(heads[:, : rotary_dim // 2], orig[:, 0:rotary_dim:2])
    assert torch.equal(heads[:, rotary_dim // 2 : rotary_dim], orig[:, 1:rotary_dim:2])


def test_permute_returns_new_tensor():
    w = torch.randn(8, 3)
    out = permute_qk_weight(w, 2, src="half", dst="half")
    assert torch.equal(out, w) and out.data_ptr() != w.data_ptr()


def _tables(positions, rotary_dim):
    angles = positions.to(torch.float64)[:, None] * base_inv_freq(rotary_dim)
    return angles.cos(), angles.sin()


def _attention(x, wq, bq, wk, bk, wv, n_heads, n_kv_heads, head_dim, cos, sin, layout):
    seq = x.shape[0]
    q = (x @ wq.T + bq).reshape(seq, n_heads, head_dim).transpose(0, 1)  # (h, s, d)
    k = (x @ wk.T + bk).reshape(seq, n_kv_heads, head_dim).transpose(0, 1)
    v = (x @ wv.T).reshape(seq, n_kv_heads, head_dim).transpose(0, 1)
    q = apply_rotary(q, cos, sin, layout=layout)
    k = apply_rotary(k, cos, sin, layout=layout)
    group = n_heads // n_kv_heads
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    scores = q @ k.transpose(-1, -2) / head_dim**0.5
    return torch.softmax(scores, dim=-1) @ v, scores


@given(
    head_dim=st.sampled_from([4, 8, 16]),
    rotary_frac=st.sampled_from([1.0, 0.5]),
    start=st.integers(0, 10**5),
    seed=st.integers(0, 1000),
)
def test_attention_invariant_under_layout_conversion(head_dim, rotary_frac, start, seed):
    """softmax(RoPE_inter(x Wq^T) RoPE_inter(x Wk^T)^T) V == same with half layout and permuted Wq, Wk, biases."""
    n_heads, n_kv_heads, seq, d_model = 4, 2, 7, 12
    rotary_dim = max(2, int(head_dim * rotary_frac))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x = rnd(seq, d_model)
    wq, bq = rnd(n_heads * head_dim, d_model), rnd(n_heads * head_dim)
    wk, bk = rnd(n_kv_heads * head_dim, d_model), rnd(n_kv_heads * head_dim)
    wv = rnd(n_kv_heads * head_dim, d_model)
    cos, sin = _tables(torch.arange(start, start + seq), rotary_dim)

    out_inter, s_inter = _attention(x, wq, bq, wk, bk, wv, n_heads, n_kv_heads, head_dim, cos, sin, "interleaved")

    def perm(w, h):
        return permute_qk_weight(w, h, src="interleaved", dst="half", rotary_dim=rotary_dim)

    out_half, s_half = _attention(x, perm(wq, n_heads), perm(bq, n_heads), perm(wk, n_kv_heads), perm(bk, n_kv_heads),
                                  wv, n_heads, n_kv_heads, head_dim, cos, sin, "half")
    torch.testing.assert_close(s_half, s_inter, rtol=0, atol=1e-10)
    torch.testing.assert_close(out_half, out_inter, rtol=0, atol=1e-10)

    # without the permutation the half layout gives different scores (the bug of seed 004)
    _, s_wrong = _attention(x, wq, bq, wk, bk, wv, n_heads, n_kv_heads, head_dim, cos, sin, "half")
    if start + seq > 1 and rotary_dim > 2:
        assert (s_wrong - s_inter).abs().max() > 1e-6


@given(head_dim=st.sampled_from([4, 8, 10]), rotary_frac=st.sampled_from([1.0, 0.5]), m=st.integers(0, 10**4))
def test_convert_layout_commutes_with_rope(head_dim, rotary_frac, m):
    """RoPE_half(P q) = P RoPE_interleaved(q)."""
    rotary_dim = max(2, int(head_dim * rotary_frac) // 2 * 2)
    q = torch.randn(3, head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(m))
    cos, sin = _tables(torch.tensor([m, m + 1, 2 * m]), rotary_dim)
    lhs = apply_rotary(convert_layout(q, src="interleaved", dst="half", rotary_dim=rotary_dim), cos, sin, layout="half")
    rhs = convert_layout(apply_rotary(q, cos, sin, layout="interleaved"), src="interleaved", dst="half",
                         rotary_dim=rotary_dim)
    torch.testing.assert_close(lhs, rhs, rtol=0, atol=1e-12)
    back = convert_layout(convert_layout(q, src="half", dst="interleaved", rotary_dim=rotary_dim),
                          src="interleaved", dst="half", rotary_dim=rotary_dim)
    assert torch.equal(back, q)
