"""ropekit against the implementations in the wild (seed 004): HF Llama, rotary-embedding-torch, Meta."""

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ropekit import RotaryEmbedding, apply_rotary, base_inv_freq, cos_sin

transformers = pytest.importorskip("transformers")
rotary_embedding_torch = pytest.importorskip("rotary_embedding_torch")

from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb  # noqa: E402


def hf_rotary(head_dim, base, n_heads=4, n_kv_heads=2):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = LlamaConfig(
            hidden_size=head_dim * n_heads,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": base},
        )
    assert config.rope_parameters["rope_theta"] == base
    return LlamaRotaryEmbedding(config)


@given(
    head_dim=st.sampled_from([16, 64, 128]),
    base=st.sampled_from([10000.0, 500000.0]),
    start=st.integers(0, 2048 - 16),
    seed=st.integers(0, 1000),
)
def test_hf_llama_matches_half_layout(head_dim, base, start, seed):
    g = torch.Generator().manual_seed(seed)
    batch, seq = 2, 16
    q = torch.randn(batch, 4, seq, head_dim, generator=g)
    k = torch.randn(batch, 2, seq, head_dim, generator=g)
    position_ids = torch.stack([torch.arange(start, start + seq), torch.arange(seq) * 127 % 2048])
    cos_hf, sin_hf = hf_rotary(head_dim, base)(q, position_ids)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos_hf, sin_hf)

    rope = RotaryEmbedding(head_dim, base=base, layout="half")
    q_rk, k_rk = rope(q, k, positions=position_ids)
    # HF's float32 angles are off by up to ~2048 * 2**-24 rad: ~1e-4 relative to the largest entry
    torch.testing.assert_close(q_rk, q_hf, rtol=0, atol=2e-4 * float(q.abs().max()))
    torch.testing.assert_close(k_rk, k_hf, rtol=0, atol=2e-4 * float(k.abs().max()))
    assert (q_rk - q_hf).abs().mean() < 1e-5

    # fed HF's own tables (first half of its duplicated cos/sin), the arithmetic is the same
    half = head_dim // 2
    c, s = cos_hf[..., :half].unsqueeze(1), sin_hf[..., :half].unsqueeze(1)
    assert torch.equal(cos_hf[..., :half], cos_hf[..., half:])
    assert torch.equal(apply_rotary(q, c, s, layout="half"), q_hf)
    assert torch.equal(apply_rotary(k, c, s, layout="half"), k_hf)


def test_hf_llama_matches_our_tables_at_small_positions():
    """HF's tables agree with ropekit's float64-angle tables within float32 angle rounding."""
    head_dim, base = 64, 10000.0
    position_ids = torch.arange(2048)[None]
    cos_hf, sin_hf = hf_rotary(head_dim, base)(torch.zeros(1, dtype=torch.float32), position_ids)
    cos, sin = cos_sin(position_ids, base_inv_freq(head_dim, base))
    torch.testing.assert_close(cos, cos_hf[..., : head_dim // 2], rtol=0, atol=5e-4)
    torch.testing.assert_close(sin, sin_hf[..., : head_dim // 2], rtol=0, atol=5e-4)


@pytest.mark.parametrize("head_dim,rotary_dim", [(16, 16), (32, 32), (32, 8)])
@pytest.mark.parametrize("offset", [0, 100])
def test_rotary_embedding_torch_matches_interleaved(head_dim, rotary_dim, offset):
    """lucidrains' rotary-embedding-torch pairs (2i, 2i+1): ropekit's interleaved layout."""
    g = torch.Generator().manual_seed(head_dim + offset)
    t = torch.randn(2, 3, 40, head_dim, generator=g)
    theirs = rotary_embedding_torch.RotaryEmbedding(dim=rotary_dim).rotate_queries_or_keys(t, offset=offset)
    rope = RotaryEmbedding(head_dim, rotary_dim=rotary_dim, layout="interleaved")
    ours, _ = rope(t, None, offset=offset)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    assert torch.equal(ours[..., rotary_dim:], theirs[..., rotary_dim:])
    # and it is not the half layout
    half, _ = RotaryEmbedding(head_dim, rotary_dim=rotary_dim, layout="half")(t, None, offset=offset)
    assert (half - theirs).abs().max() > 0.1


def meta_apply_rotary_emb(x, freqs_cis):
    """Meta's LLaMA ``apply_rotary_emb`` (seed 004), float64: pairs are complex numbers x_2i + i x_2i+1."""
    x_ = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * freqs_cis).flatten(-2)


@given(
    head_dim=st.sampled_from([2, 8, 64]),
    base=st.sampled_from([10000.0, 500000.0]),
    start=st.integers(0, 10**6),
    seed=st.integers(0, 1000),
)
def test_meta_complex_matches_interleaved(head_dim, base, start, seed):
    g = torch.Generator().manual_seed(seed)
    seq = 8
    x = torch.randn(2, seq, 3, head_dim, generator=g, dtype=torch.float64)  # (b, s, h, d) as in Meta's code
    # Meta's precompute_freqs_cis, in float64
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    t = torch.arange(start, start + seq, dtype=torch.float64)
    freqs_cis = torch.polar(torch.ones(seq, head_dim // 2, dtype=torch.float64), torch.outer(t, freqs))
    theirs = meta_apply_rotary_emb(x, freqs_cis[:, None, :])

    angles = torch.outer(t, base_inv_freq(head_dim, base))
    ours = apply_rotary(x, angles.cos()[:, None, :], angles.sin()[:, None, :], layout="interleaved")
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-9)

    # through the module (float32 tables) to float32 accuracy
    rope = RotaryEmbedding(head_dim, base=base, layout="interleaved")
    mod, _ = rope(x, None, offset=start, seq_dim=-3)
    torch.testing.assert_close(mod, theirs, rtol=0, atol=5e-6 * float(x.abs().max()))
