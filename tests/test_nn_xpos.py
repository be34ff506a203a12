"""XPosEmbedding against the paper's formula written out here, and against rotary-embedding-torch's xPos.

Sun et al. 2022 ("A Length-Extrapolatable Transformer", torchscale ``XPOS``): after RoPE, pair ``i``
of a query at position ``n`` is multiplied by ``zeta_i^((n - c)/B)`` and of a key at ``m`` by
``zeta_i^(-(m - c)/B)``, ``zeta_i = (2i/d + 0.4) / 1.4``, ``B = 512``.

Each property is one comparison (``*_mismatch``: ``None`` when it holds, else what differs) run
over fixed cases (``*_CASES``) by a test here; tests/test_mutations.py breaks the module and runs
the same comparisons over the same cases to show that each one notices.
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
PEER_RTOL = 1e-5  # float32 on both sides; the smallest mutation in tests/test_mutations.py moves ~2e-3
SCORE_RTOL = 1e-5  # of the sum of the score's terms' sizes: float32 tables, positions up to ~10,000


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


def formula_mismatch(head_dim: int, rotary_dim: int, layout: str, positions: list[int], scale_base: float,
                     center: int, seed: int) -> str | None:
    """XPosEmbedding's q' and k' (two heads, float64) against :func:`xpos_by_hand`, element by element."""
    gen = torch.Generator().manual_seed(seed)
    seq = len(positions)
    q = torch.randn(1, 2, seq, head_dim, dtype=torch.float64, generator=gen)
    k = torch.randn(1, 2, seq, head_dim, dtype=torch.float64, generator=gen)
    xpos = XPosEmbedding(head_dim, rotary_dim=rotary_dim, layout=layout, scale_base=scale_base, center=center)
    got_q, got_k = xpos(q, k, torch.tensor(positions))
    if got_q.dtype != torch.float64 or got_q.shape != q.shape or got_k.shape != k.shape:
        return f"q' {got_q.dtype} {tuple(got_q.shape)}, k' {tuple(got_k.shape)} for float64 {tuple(q.shape)}"
    for h in range(2):
        for name, got, x, key in (("q", got_q, q, False), ("k", got_k, k, True)):
            expected = xpos_by_hand(x[0, h], positions, key=key, rotary_dim=rotary_dim, layout=layout,
                                    scale_base=scale_base, center=center)
            # the float32 tables err by ~6e-8 of a pair's size, and a key's pair can be large (zeta^(-m/B))
            # while one of its channels nearly cancels: bound the error by each row's size
            error = (got[0, h] - expected).abs() / (1 + expected.abs().amax(-1, keepdim=True))
            if not (error <= ORACLE_ATOL).all():
                return f"{name}' head {h} differs from the paper's formula by {error.max().item():.3g} (relative)"
    return None


# (head_dim, rotary_dim, layout, positions, scale_base, center, seed): position 0 and its neighbours,
# far positions, both layouts, partial rotation and the paper's scale base
FORMULA_CASES = [
    (8, 8, "half", [0, 1, 2, 5, 100, 3000], 512.0, 0, 0),
    (8, 8, "interleaved", [0, 1, 2, 5, 100, 3000], 512.0, 0, 1),
    (12, 8, "half", [0, 3, 7, 1000, 4000], 64.0, -20, 2),
    (12, 4, "interleaved", [0, 1, 4095], 64.0, 40, 3),
]


@pytest.mark.parametrize("case", FORMULA_CASES)
def test_matches_the_paper_formula_fixed_cases(case):
    problem = formula_mismatch(*case)
    assert problem is None, problem


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
    seed = data.draw(st.integers(0, 2**16), label="seed")
    problem = formula_mismatch(head_dim, rotary_dim, layout, positions, scale_base, center, seed)
    assert problem is None, problem


def score_by_distance(q: torch.Tensor, k: torch.Tensor, distance: int, layout: str, d: int) -> tuple[float, float]:
    """``sum_i zeta_i^(D/B) <q_[i], R_(-D theta_i) k_[i]>`` for ``D = n - m``: the score from the distance alone.

    ``<R_n q, R_m k> = <q, R_(m - n) k>`` pair by pair. Returns the score and the sum of its
    terms' sizes (what rounding is relative to). q, k: float64 ``(d,)``.
    """
    score = magnitude = 0.0
    for i in range(d // 2):
        zeta = (2.0 * i / d + 0.4) / 1.4
        weight = zeta ** (distance / 512.0)
        phi = -distance * 10000.0 ** (-2.0 * i / d)
        a, b = pair_channels(i, d, layout)
        qa, qb, ka, kb = float(q[a]), float(q[b]), float(k[a]), float(k[b])
        c, s = math.cos(phi), math.sin(phi)
        score += weight * (qa * (ka * c - kb * s) + qb * (kb * c + ka * s))
        magnitude += weight * math.hypot(qa, qb) * math.hypot(ka, kb)
    return score, magnitude


def shift_mismatch(n: int, m: int, shift: int, center: int, layout: str) -> str | None:
    """The score of a query at ``n`` and a key at ``m`` (d = 16, the paper's zeta and B) is
    :func:`score_by_distance` of ``n - m``, and stays so with both moved by ``shift`` and another centre."""
    d = 16
    gen = torch.Generator().manual_seed(n * 7919 + m)
    q = torch.randn(1, 1, 1, d, dtype=torch.float64, generator=gen)
    k = torch.randn(1, 1, 1, d, dtype=torch.float64, generator=gen)
    expected, magnitude = score_by_distance(q[0, 0, 0], k[0, 0, 0], n - m, layout, d)
    for offset, c in ((0, 0), (shift, center)):
        xpos = XPosEmbedding(d, layout=layout, center=c)
        q_out, _ = xpos(q, q, torch.tensor([n + offset]))
        _, k_out = xpos(k, k, torch.tensor([m + offset]))
        score = float((q_out * k_out).sum())
        if abs(score - expected) > SCORE_RTOL * magnitude:
            return (f"score of positions ({n + offset}, {m + offset}) with center {c}: {score:.9g}, "
                    f"from the distance {n - m} alone {expected:.9g}")
    return None


# (n, m, shift, center, layout): a token at position 0, neighbours, far pairs, both signs of n - m
SHIFT_CASES = [
    (0, 7, 5, 0, "half"),
    (9, 0, 100, -50, "interleaved"),
    (1, 2, 0, 30, "half"),
    (4000, 3, 1, 3000, "interleaved"),
    (250, 4999, 2, -1000, "half"),
]


@pytest.mark.parametrize("case", SHIFT_CASES)
def test_score_depends_on_the_distance_only_fixed_cases(case):
    problem = shift_mismatch(*case)
    assert problem is None, problem


@settings(max_examples=20, deadline=None)
@given(n=st.integers(0, 5000), m=st.integers(0, 5000), shift=st.integers(0, 5000), center=st.integers(-3000, 3000),
       layout=st.sampled_from(["half", "interleaved"]))
def test_score_is_zeta_weighted_rope_and_depends_on_the_distance_only(n, m, shift, center, layout):
    """q'_n . k'_m = sum_i zeta_i^((n-m)/B) <q_[i], R_(m-n) k_[i]>, whatever the centre, after any common shift."""
    problem = shift_mismatch(n, m, shift, center, layout)
    assert problem is None, problem


def test_the_fastest_pair_decays_most():
    """zeta_0 = gamma / (1 + gamma) < ... < zeta_{d/2-1} < 1: every pair decays with distance, the fastest most."""
    zeta = ropekit.nn.xpos_zeta(32)
    assert zeta[0].item() == pytest.approx(0.4 / 1.4, abs=1e-15)
    assert torch.all(zeta[1:] > zeta[:-1]) and zeta[-1] < 1


def interleaved_order(d: int) -> torch.Tensor:
    """Channel ``c`` of the interleaved layout is channel ``interleaved_order(d)[c]`` of the half layout."""
    return torch.stack((torch.arange(d // 2), torch.arange(d // 2) + d // 2), dim=-1).flatten()


def peer_mismatch(d: int, seq: int, base: float, scale_base: float, layout: str) -> str | None:
    """XPosEmbedding against rotary-embedding-torch's ``rotate_queries_and_keys`` (float32, seeded q and k).

    How the two meet (rotary-embedding-torch 0.9.1, ``RotaryEmbedding(dim, theta, use_xpos=True,
    xpos_scale_base)``):

    - ``theta`` is our ``base`` and ``xpos_scale_base`` our ``scale_base``; its
      ``scale = (arange(0, dim, 2) + 0.4 dim) / (1.4 dim)`` is our ``zeta`` with ``gamma = 0.4``;
    - its positions are ``0 .. seq - 1`` and its exponent ``(t - seq // 2) / scale_base``: our
      default positions with ``center = seq // 2``;
    - its pairs are interleaved (``rotate_half`` pairs channels 2i, 2i + 1): our ``"interleaved"``;
      our ``"half"`` pairs channels i, i + d/2, so a half-layout q is compared after reordering its
      channels with :func:`interleaved_order` (the peer rotates the reordered input).

    A fresh peer per call: it caches its scales by length, centred at the first length it saw.
    """
    ret = pytest.importorskip("rotary_embedding_torch")
    gen = torch.Generator().manual_seed(d * 1000 + seq)
    q, k = torch.randn(2, 3, seq, d, generator=gen), torch.randn(2, 3, seq, d, generator=gen)
    got_q, got_k = XPosEmbedding(d, base=base, layout=layout, scale_base=scale_base, center=seq // 2)(q, k)
    order = interleaved_order(d) if layout == "half" else torch.arange(d)
    peer = ret.RotaryEmbedding(dim=d, theta=base, use_xpos=True, xpos_scale_base=scale_base)
    peer_q, peer_k = peer.rotate_queries_and_keys(q[..., order], k[..., order])
    for name, got, want in (("q", got_q[..., order], peer_q), ("k", got_k[..., order], peer_k)):
        # both sides round to float32 (the peer its angles and factors too): bound by each row's size
        error = (got - want).abs() / (1 + want.abs().amax(-1, keepdim=True))
        if (error > PEER_RTOL).any():
            return f"{name}' differs from rotary-embedding-torch's by {error.max().item():.3g} (relative)"
    return None


# (d, seq, base, scale_base, layout)
PEER_CASES = [
    (32, 10, 10000.0, 512.0, "interleaved"),
    (64, 33, 10000.0, 512.0, "half"),
    (16, 40, 500.0, 16.0, "interleaved"),
    (8, 25, 10000.0, 8.0, "half"),
]


@pytest.mark.parametrize("case", PEER_CASES)
def test_matches_rotary_embedding_torch_xpos(case):
    problem = peer_mismatch(*case)
    assert problem is None, problem


def test_another_centre_moves_q_and_k_but_no_score():
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 33, 64), torch.randn(2, 3, 33, 64)
    centred_q, centred_k = XPosEmbedding(64, layout="interleaved", center=16)(q, k)
    other_q, other_k = XPosEmbedding(64, layout="interleaved")(q, k)
    assert (other_q - centred_q).abs().max() > 1e-4
    torch.testing.assert_close(other_q @ other_k.transpose(-1, -2), centred_q @ centred_k.transpose(-1, -2),
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
    alone = xpos.rotate_one(k, positions, key=True)
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
