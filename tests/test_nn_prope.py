"""p-RoPE and partial rotary: which pairs turn, at which frequencies, in each layout.

p-RoPE (Barbero et al. 2024, "Round and Round We Go!"): the ``k = int(p * d // 2)`` fastest pairs
keep their full-head frequencies ``theta_i = base^(-2i/d)``; the others are not rotated. In
ropekit it is ``RotaryEmbedding(d, scaling=Proportional(partial_rotary_factor=p))``.
Partial rotary (GPT-NeoX ``rotary_pct``): the first ``r`` channels are rotated, as a RoPE of
dimension ``r`` (``theta_i = base^(-2i/r)``); ``RotaryEmbedding(d, rotary_dim=r)``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ropekit.nn import RotaryEmbedding
from ropekit.scaling import Proportional

torch.set_num_threads(1)


def pair_channels(i: int, width: int, layout: str) -> tuple[int, int]:
    return (2 * i, 2 * i + 1) if layout == "interleaved" else (i, i + width // 2)


def rotate_pairs_by_hand(x: torch.Tensor, positions: list[int], thetas: list[float], width: int,
                         layout: str) -> torch.Tensor:
    """Rotate pair ``i`` (channels of ``layout`` within the first ``width``) by ``n * thetas[i]``; nothing else.

    x: (seq, d) float64; a theta of 0 leaves its pair as it is.
    """
    out = x.clone()
    for row, n in enumerate(positions):
        for i, theta in enumerate(thetas):
            a, b = pair_channels(i, width, layout)
            c, s = math.cos(n * theta), math.sin(n * theta)
            out[row, a] = x[row, a] * c - x[row, b] * s
            out[row, b] = x[row, b] * c + x[row, a] * s
    return out


def p_rope_by_hand(x, positions, p, layout, base=10000.0):
    d = x.shape[-1]
    kept = int(p * d // 2)
    thetas = [base ** (-2.0 * i / d) if i < kept else 0.0 for i in range(d // 2)]
    return rotate_pairs_by_hand(x, positions, thetas, d, layout)


def partial_by_hand(x, positions, rotary_dim, layout, base=10000.0):
    thetas = [base ** (-2.0 * i / rotary_dim) for i in range(rotary_dim // 2)]
    return rotate_pairs_by_hand(x, positions, thetas, rotary_dim, layout)


@settings(max_examples=30, deadline=None)
@given(d=st.sampled_from([4, 8, 16, 32]), p=st.sampled_from([0.0, 0.25, 0.4, 0.5, 0.75, 1.0]),
       layout=st.sampled_from(["half", "interleaved"]),
       positions=st.lists(st.integers(0, 100_000), min_size=1, max_size=4), seed=st.integers(0, 1000))
def test_p_rope_is_the_papers_definition(d, p, layout, positions, seed):
    x = torch.randn(len(positions), d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    rope = RotaryEmbedding(d, scaling=Proportional(partial_rotary_factor=p), layout=layout)
    got = rope.rotate_one(x[None, None], torch.tensor(positions))[0, 0]
    torch.testing.assert_close(got, p_rope_by_hand(x, positions, p, layout), atol=2e-6 * (1 + max(positions) / 1e4),
                               rtol=0)


@pytest.mark.parametrize("layout, untouched", [
    ("half", [4, 5, 6, 7, 12, 13, 14, 15]),          # pairs (i, i + 8), i >= k = 4
    ("interleaved", [8, 9, 10, 11, 12, 13, 14, 15]),  # pairs (2i, 2i + 1), i >= 4: a suffix of the head
])
def test_which_channels_p_rope_leaves_alone(layout, untouched):
    rope = RotaryEmbedding(16, scaling=Proportional(partial_rotary_factor=0.5), layout=layout)
    x = torch.randn(1, 1, 6, 16, dtype=torch.float64)
    y = rope.rotate_one(x, torch.arange(100, 106))
    moved = [c for c in range(16) if not torch.equal(y[..., c], x[..., c])]
    assert moved == sorted(set(range(16)) - set(untouched))


@pytest.mark.parametrize("p", [0.25, 0.5, 0.75])
def test_p_rope_equals_partial_rotary_with_a_smaller_base_only_in_the_interleaved_layout(p):
    """Kept pairs i < k with base^(-2i/d) = (base^(2k/d))^(-2i/(2k)): a RoPE of dimension 2k on channels [0, 2k)."""
    d, base = 32, 10000.0
    kept = int(p * d // 2)
    x = torch.randn(2, 3, 40, d, dtype=torch.float64)
    positions = torch.arange(40) * 37
    for layout, equal in (("interleaved", True), ("half", False)):
        p_rope = RotaryEmbedding(d, base=base, scaling=Proportional(partial_rotary_factor=p), layout=layout)
        partial = RotaryEmbedding(d, base=base ** (2 * kept / d), rotary_dim=2 * kept, layout=layout)
        diff = (p_rope.rotate_one(x, positions) - partial.rotate_one(x, positions)).abs().max()
        assert (diff < 1e-5) if equal else (diff > 0.1), (layout, float(diff))


@settings(max_examples=25, deadline=None)
@given(d=st.sampled_from([8, 16, 32]), share=st.sampled_from([0.25, 0.5, 1.0]),
       layout=st.sampled_from(["half", "interleaved"]),
       positions=st.lists(st.integers(0, 50_000), min_size=1, max_size=4), seed=st.integers(0, 1000))
def test_partial_rotary_is_a_rope_of_its_own_width(d, share, layout, positions, seed):
    rotary_dim = int(d * share)
    x = torch.randn(len(positions), d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    rope = RotaryEmbedding(d, rotary_dim=rotary_dim, layout=layout)
    got = rope.rotate_one(x[None, None], torch.tensor(positions))[0, 0]
    expected = partial_by_hand(x, positions, rotary_dim, layout)
    torch.testing.assert_close(got, expected, atol=2e-6 * (1 + max(positions) / 1e4), rtol=0)
    assert torch.equal(got[:, rotary_dim:], x[:, rotary_dim:])


def test_partial_rotary_matches_gpt_neox():
    """transformers' GPT-NeoX: rotary_pct 0.25, its rotary embedding and apply_rotary_pos_emb on the first channels."""
    neox = pytest.importorskip("transformers.models.gpt_neox.modeling_gpt_neox")
    from transformers import GPTNeoXConfig

    config = GPTNeoXConfig(hidden_size=256, num_attention_heads=4, rotary_pct=0.25, max_position_embeddings=512)
    q, k = torch.randn(2, 4, 50, 64), torch.randn(2, 4, 50, 64)
    position_ids = torch.arange(200, 250).expand(2, 50)
    cos, sin = neox.GPTNeoXRotaryEmbedding(config)(q, position_ids)
    peer_q, peer_k = neox.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = RotaryEmbedding(64, rotary_dim=16)(q, k, position_ids)
    torch.testing.assert_close(got_q, peer_q, atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, peer_k, atol=5e-5, rtol=1e-5)


def test_p_rope_matches_transformers_proportional_rotation():
    """transformers' ``proportional`` rope (Gemma 4) rotated with Llama's apply_rotary_pos_emb: the half layout."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=512,
                         rope_parameters={"rope_type": "proportional", "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.25})
    q, k = torch.randn(1, 4, 30, 64), torch.randn(1, 4, 30, 64)
    position_ids = torch.arange(300, 330)[None]
    cos, sin = llama.LlamaRotaryEmbedding(config)(q, position_ids)
    peer_q, peer_k = llama.apply_rotary_pos_emb(q, k, cos, sin)
    rope = RotaryEmbedding(64, scaling=Proportional(partial_rotary_factor=0.25))
    got_q, got_k = rope(q, k, position_ids)
    torch.testing.assert_close(got_q, peer_q, atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, peer_k, atol=5e-5, rtol=1e-5)
    assert torch.equal(got_q[..., 8:32], q[..., 8:32]) and torch.equal(got_q[..., 40:], q[..., 40:])
