"""XPosEmbedding against the paper's formula written out here, and against rotary-embedding-torch's xPos.

Sun et al. 2022 ("A Length-Extrapolatable Transformer", torchscale ``XPOS``): after RoPE, pair ``i``
of a query at position ``n`` is multiplied by ``zeta_i^((n - c)/B)`` and of a key at ``m`` by
``zeta_i^(-(m - c)/B)``, ``zeta_i = (2i/d + 0.4) / 1.4``, ``B = 512``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ropekit
from ropekit.nn import KVCache, RotarySelfAttention, XPosEmbedding

torch.set_num_threads(1)

ORACLE_ATOL = 2e-6  # float32 cos/sin tables inside a float64 forward (ropekit convention)


def pair_channels(i: int, rotary_dim: int, layout: str) -> tuple[int, int]:
    """The two channels of pair ``i`` in ``layout``."""
    return (2 * i, 2 * i + 1) if layout == "interleaved" else (i, i + rotary_dim // 2)


def xpos_by_hand(x: torch.Tensor, positions: list[int], *, key: bool, rotary_dim: int, layout: str,
                 base: float = 10000.0, scale_base: float = 512.0, gamma: float = 0.4, center: int = 0) -> torch.Tensor:
    """The paper's formula, one token and one pair at a time: a 2x2 rotation by n theta_i, then zeta_i^(+-(n-c)/B).

    x: (seq, head_dim) float64; positions: one int per row.
    """
    out = x.clone()
    for row, n in enumerate(positions):
        for i in range(rotary_dim // 2):
            theta = base ** (-2.0 * i / rotary_dim)
            zeta = (2.0 * i / rotary_dim + gamma) / (1.0 + gamma)
            factor = zeta ** ((-1 if key else 1) * (n - center) / scale_base)
            a, b = pair_channels(i, rotary_dim, layout)
            c, s = math.cos(n * theta), math.sin(n * theta)
            out[row, a] = factor * (x[row, a] * c - x[row, b] * s)
            out[row, b] = factor * (x[row, b] * c + x[row, a] * s)
    return out


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    head_dim=st.sampled_from([2, 4, 8, 12]),
    layout=st.sampled_from(["half", "interleaved"]),
    seq=st.integers(1, 5),
    scale_base=st.sampled_from([512.0, 64.0]),
    center=st.integers(-40, 40),
)
def test_matches_the_paper_formula(data, head_dim, layout, seq, scale_base, center):
    rotary_dim = data.draw(st.sampled_from(list(range(2, head_dim + 1, 2))), label="rotary_dim")
    positions = data.draw(st.lists(st.integers(0, 3000), min_size=seq, max_size=seq), label="positions")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    q = torch.randn(1, 2, seq, head_dim, dtype=torch.float64, generator=gen)
    k = torch.randn(1, 2, seq, head_dim, dtype=torch.float64, generator=gen)
    xpos = XPosEmbedding(head_dim, rotary_dim=rotary_dim, layout=layout, scale_base=scale_base, center=center)
    got_q, got_k = xpos(q, k, torch.tensor(positions))
    assert got_q.dtype == torch.float64 and got_q.shape == q.shape
    for h in range(2):
        for got, x, key in ((got_q, q, False), (got_k, k, True)):
            expected = xpos_by_hand(x[0, h], positions, key=key, rotary_dim=rotary_dim, layout=layout,
                                    scale_base=scale_base, center=center)
            # the float32 tables err by ~6e-8 of a pair's size, and a key's pair can be large (zeta^(-m/B))
            # while one of its channels nearly cancels: bound the error by each row's size
            error = (got[0, h] - expected).abs()
            assert (error <= ORACLE_ATOL * (1 + expected.abs().amax(-1, keepdim=True))).all(), error.max()


@settings(max_examples=20, deadline=None)
@given(n=st.integers(0, 5000), m=st.integers(0, 5000), shift=st.integers(0, 5000), center=st.integers(-3000, 3000),
       layout=st.sampled_from(["half", "interleaved"]))
def test_score_is_zeta_weighted_rope_and_depends_on_the_distance_only(n, m, shift, center, layout):
    """q'_n . k'_m = sum_i zeta_i^((n-m)/B) <(R_n q)_i, (R_m k)_i>, whatever the centre, after any common shift."""
    d = 16
    gen = torch.Generator().manual_seed(n * 7919 + m)
    q, k = torch.randn(1, 1, 1, d, dtype=torch.float64, generator=gen), torch.randn(1, 1, 1, d, dtype=torch.float64,
                                                                                      generator=gen)
    inv_freq = torch.tensor([10000.0 ** (-2.0 * i / d) for i in range(d // 2)], dtype=torch.float64)
    rq = ropekit.apply_reference(q[0, 0], torch.tensor([n]), inv_freq, layout=layout)[0]
    rk = ropekit.apply_reference(k[0, 0], torch.tensor([m]), inv_freq, layout=layout)[0]
    expected = magnitude = 0.0  # magnitude: the sum of the terms' sizes, what rounding is relative to
    for i in range(d // 2):
        zeta = (2.0 * i / d + 0.4) / 1.4
        a, b = pair_channels(i, d, layout)
        expected += zeta ** ((n - m) / 512.0) * float(rq[a] * rk[a] + rq[b] * rk[b])
        magnitude += zeta ** ((n - m) / 512.0) * float(rq[[a, b]].norm() * rk[[a, b]].norm())
    scores = []
    for offset, c in ((0, 0), (shift, center)):
        xpos = XPosEmbedding(d, layout=layout, center=c)
        q_out, _ = xpos(q, q, torch.tensor([n + offset]))
        _, k_out = xpos(k, k, torch.tensor([m + offset]))
        scores.append(float((q_out * k_out).sum()))
    assert abs(scores[0] - expected) <= 1e-5 * magnitude
    assert abs(scores[1] - scores[0]) <= 2e-5 * magnitude


def test_the_fastest_pair_decays_most():
    """zeta_0 = gamma / (1 + gamma) < ... < zeta_{d/2-1} < 1: every pair decays with distance, the fastest most."""
    zeta = ropekit.nn.xpos_zeta(32)
    assert zeta[0].item() == pytest.approx(0.4 / 1.4, abs=1e-15)
    assert torch.all(zeta[1:] > zeta[:-1]) and zeta[-1] < 1


def test_matches_rotary_embedding_torch_xpos():
    """rotary-embedding-torch 0.9.1: interleaved pairs, positions from 0, exponent centred at seq // 2."""
    ret = pytest.importorskip("rotary_embedding_torch")
    torch.manual_seed(0)
    for d, seq in ((32, 10), (64, 33)):
        q, k = torch.randn(2, 3, seq, d), torch.randn(2, 3, seq, d)
        peer = ret.RotaryEmbedding(dim=d, use_xpos=True, xpos_scale_base=512)
        peer_q, peer_k = peer.rotate_queries_and_keys(q, k)
        got_q, got_k = XPosEmbedding(d, layout="interleaved", center=seq // 2)(q, k)
        torch.testing.assert_close(got_q, peer_q, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(got_k, peer_k, atol=2e-6, rtol=1e-5)
        # a different centre changes q and k but not one attention score
        other_q, other_k = XPosEmbedding(d, layout="interleaved")(q, k)
        assert (other_q - got_q).abs().max() > 1e-4
        torch.testing.assert_close(other_q @ other_k.transpose(-1, -2), peer_q @ peer_k.transpose(-1, -2),
                                   atol=1e-4, rtol=1e-5)


def test_inside_attention_with_a_kv_cache_decoding_equals_the_full_forward():
    torch.manual_seed(1)
    attn = RotarySelfAttention(32, 4, num_kv_heads=2, rope=XPosEmbedding(8, scale_base=16.0, center=3)).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    full = attn(x)
    cache = KVCache()
    steps = [attn(x[:, :4], cache=cache)] + [attn(x[:, t:t + 1], cache=cache) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-12, rtol=0)
    plain = RotarySelfAttention(32, 4, num_kv_heads=2).double()
    plain.load_state_dict(attn.state_dict())
    assert (plain(x) - full).abs().max() > 1e-3  # the decay is applied


def test_dtypes_inplace_and_batched_positions():
    xpos = XPosEmbedding(16, scale_base=8.0)
    q, k = torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    out_q, out_k = xpos(q, k, positions)
    for row in range(2):
        ref_q, ref_k = xpos(q[row:row + 1], k[row:row + 1], positions[row])
        torch.testing.assert_close(out_q[row:row + 1], ref_q)
        torch.testing.assert_close(out_k[row:row + 1], ref_k)
    half_q, half_k = xpos(q.bfloat16(), k.bfloat16(), positions)
    assert half_q.dtype == half_k.dtype == torch.bfloat16
    torch.testing.assert_close(half_q.float(), out_q, atol=0.05, rtol=0.02)
    q2, k2 = q.clone(), k.clone()
    in_q, in_k = xpos(q2, k2, positions, inplace=True)
    assert in_q.data_ptr() == q2.data_ptr() and in_k.data_ptr() == k2.data_ptr()
    torch.testing.assert_close(in_q, out_q)
    torch.testing.assert_close(in_k, out_k)
    alone = xpos.rotate(k, positions, key=True)
    torch.testing.assert_close(alone, out_k)
    torch.testing.assert_close(xpos(q, None, positions)[0], out_q)


def test_sequence_axis_and_offset():
    xpos = XPosEmbedding(8, scale_base=4.0)
    q = torch.randn(1, 6, 3, 8)  # (batch, seq, heads, head_dim)
    seq_first, _ = xpos(q, q, seq_dim=-3, offset=5)
    heads_first, _ = xpos(q.transpose(1, 2), q.transpose(1, 2), torch.arange(5, 11))
    torch.testing.assert_close(seq_first, heads_first.transpose(1, 2))


def test_overflow_is_refused_and_the_limit_is_where_float32_ends():
    xpos = XPosEmbedding(64)
    limit = xpos.max_distance
    assert 30_000 < limit < 36_000  # 80 * 512 / ln(1.4 / 0.4)
    q = torch.randn(1, 1, 1, 64)
    edge_q, edge_k = xpos(q, q, torch.tensor([limit]))
    assert torch.isfinite(edge_q).all() and torch.isfinite(edge_k).all()
    with pytest.raises(ValueError, match=r"positions: .*overflow float32 .*center=0"):
        xpos(q, q, torch.tensor([limit + 1]))
    moved = XPosEmbedding(64, center=100_000)
    assert torch.isfinite(moved(q, q, torch.tensor([100_000 + limit]))[1]).all()


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"scale_base": 0.0}, ValueError, "scale_base"),
    ({"scale_base": float("nan")}, ValueError, "scale_base"),
    ({"gamma": -0.4}, ValueError, "gamma"),
    ({"center": 1.5}, TypeError, "center"),
    ({"center": True}, TypeError, "center"),
    ({"rotary_dim": 3}, ValueError, "rotary_dim"),
    ({"layout": "paired"}, ValueError, "layout"),
    ({"scaling": ropekit.scaling.Linear(2.0)}, ValueError, "scaling: xPos takes no scaling rule"),
])
def test_constructor_errors_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        XPosEmbedding(8, **kwargs)


def test_built_from_a_config_without_scaling():
    config = ropekit.RopeConfig(head_dim=16, base=500.0, layout="interleaved")
    xpos = XPosEmbedding.from_config(config)
    assert (xpos.head_dim, xpos.base, xpos.layout, xpos.scale_base) == (16, 500.0, "interleaved", 512.0)


def test_a_shard_with_its_global_positions_is_a_slice_of_the_whole():
    """Context parallelism: a rank rotates its part of the sequence with the global positions (and seq_len)."""
    xpos = XPosEmbedding(16, scale_base=32.0)
    q, k = torch.randn(2, 3, 12, 16), torch.randn(2, 3, 12, 16)
    full_q, full_k = xpos(q, k)
    part_q, part_k = xpos(q[:, :, 5:9], k[:, :, 5:9], torch.arange(5, 9), seq_len=12)
    torch.testing.assert_close(part_q, full_q[:, :, 5:9])
    torch.testing.assert_close(part_k, full_k[:, :, 5:9])
    with pytest.raises(ValueError, match="shard_scheme: XPosEmbedding takes plain tensors"):
        xpos(q, k, shard_scheme="contiguous")
