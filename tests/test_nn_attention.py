"""RotarySelfAttention and KVCache against a from-scratch float64 softmax attention."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ropekit
from ropekit.nn import KVCache, RotaryEmbedding, RotarySelfAttention
from ropekit.nn.attention import attention_bias_mask

torch.set_num_threads(1)

# Tolerance against the float64 oracle: the module's cos/sin tables are float32 by design
# (ropekit convention), so a float64 forward carries ~1e-7 relative error in the rotation.
ORACLE_ATOL = 2e-6
# Two float64 forwards of the same module that differ only in how the work is split.
SAME_MATH_ATOL = 1e-12


# --------------------------------------------------------------------------------------------
# the oracle
# --------------------------------------------------------------------------------------------
def inv_freq_by_hand(rotary_dim: int, base: float) -> torch.Tensor:
    return torch.tensor([base ** (-2.0 * i / rotary_dim) for i in range(rotary_dim // 2)], dtype=torch.float64)


def head_rotation(position: int, head_dim: int, rotary_dim: int, base: float, layout: str) -> torch.Tensor:
    """R(m) for one head: the explicit RoFormer matrix on the rotary channels, identity on the tail."""
    rot = torch.eye(head_dim, dtype=torch.float64)
    rot[:rotary_dim, :rotary_dim] = ropekit.rotation_matrix(
        position, inv_freq_by_hand(rotary_dim, base), layout=layout
    )
    return rot


def linear64(lin: torch.nn.Linear, t: torch.Tensor) -> torch.Tensor:
    out = t @ lin.weight.detach().double().T
    if lin.bias is not None:
        out = out + lin.bias.detach().double()
    return out


def oracle_attention(
    module: RotarySelfAttention,
    x: torch.Tensor,
    positions: torch.Tensor,
    *,
    base: float = 10000.0,
    layout: str = "half",
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax((R_m q_m)^T (R_n k_n) / sqrt(d)) v_n, head by head, in float64, with explicit matrices.

    positions: (batch, seq). key_mask: optional bool (batch, seq), True = attend.
    """
    x = x.detach().double()
    batch, seq, _ = x.shape
    heads, kv_heads, d, r = module.num_heads, module.num_kv_heads, module.head_dim, module.rope.rotary_dim
    q = linear64(module.q_proj, x).reshape(batch, seq, heads, d)
    k = linear64(module.k_proj, x).reshape(batch, seq, kv_heads, d)
    v = linear64(module.v_proj, x).reshape(batch, seq, kv_heads, d)
    out = torch.zeros(batch, seq, heads, d, dtype=torch.float64)
    for b in range(batch):
        rots = torch.stack([head_rotation(int(m), d, r, base, layout) for m in positions[b]])  # (seq, d, d)
        q_rot = torch.einsum("nij,nhj->nhi", rots, q[b])
        k_rot = torch.einsum("nij,nhj->nhi", rots, k[b])
        allowed = torch.ones(seq, seq, dtype=torch.bool)
        if module.causal:
            allowed = torch.tril(allowed)
        if key_mask is not None:
            allowed = allowed & key_mask[b][None, :]
        for h in range(heads):
            g = h // (heads // kv_heads)  # the key/value head shared by this query head
            scores = q_rot[:, h] @ k_rot[:, g].T / math.sqrt(d)
            weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
            out[b, :, h] = weights @ v[b, :, g]
    return linear64(module.o_proj, out.reshape(batch, seq, heads * d))


def make_module(**kwargs) -> RotarySelfAttention:
    torch.manual_seed(kwargs.pop("seed", 0))
    return RotarySelfAttention(**kwargs).double().eval()


# --------------------------------------------------------------------------------------------
# against the oracle
# --------------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    heads_kv=st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]),
    head_dim=st.sampled_from([2, 4, 6, 8]),
    layout=st.sampled_from(["half", "interleaved"]),
    causal=st.booleans(),
    bias=st.booleans(),
    base=st.sampled_from([10000.0, 500.0]),
    batch=st.integers(1, 2),
    seq=st.integers(1, 6),
)
def test_matches_float64_oracle(data, heads_kv, head_dim, layout, causal, bias, base, batch, seq):
    num_heads, num_kv_heads = heads_kv
    rotary_dim = data.draw(st.sampled_from(list(range(2, head_dim + 1, 2))), label="rotary_dim")
    embed_dim = data.draw(st.sampled_from([4, 8, 12]), label="embed_dim")
    module = make_module(
        embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        rotary_dim=rotary_dim, base=base, layout=layout, causal=causal, bias=bias,
    )
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    x = torch.randn(batch, seq, embed_dim, dtype=torch.float64, generator=gen)
    positions = torch.randint(0, 60, (batch, seq), generator=gen)
    expected = oracle_attention(module, x, positions, base=base, layout=layout)
    got = module(x, positions if batch > 1 else positions[0])
    assert got.shape == (batch, seq, embed_dim) and got.dtype == torch.float64
    torch.testing.assert_close(got, expected, atol=ORACLE_ATOL, rtol=0)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_default_positions_float32(layout):
    """Default positions are arange(seq); a float32 module stays within float32 accuracy."""
    torch.manual_seed(1)
    module = RotarySelfAttention(16, 4, num_kv_heads=2, rotary_dim=2, layout=layout).eval()
    x = torch.randn(2, 7, 16)
    got = module(x)
    assert got.dtype == torch.float32
    expected = oracle_attention(module, x, torch.arange(7).expand(2, 7), layout=layout)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)


def test_rotation_is_actually_applied():
    """Negative control: the oracle without rotation (all positions 0) gives a different answer."""
    module = make_module(embed_dim=8, num_heads=2)
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    unrotated = oracle_attention(module, x, torch.zeros(1, 6, dtype=torch.long))
    assert (module(x) - unrotated).abs().max() > 1e-3


def test_hf_projection_names_and_shapes():
    module = RotarySelfAttention(32, 8, num_kv_heads=2, bias=True)
    shapes = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    assert shapes == {
        "q_proj.weight": (32, 32), "q_proj.bias": (32,),
        "k_proj.weight": (8, 32), "k_proj.bias": (8,),
        "v_proj.weight": (8, 32), "v_proj.bias": (8,),
        "o_proj.weight": (32, 32), "o_proj.bias": (32,),
    }


def test_matches_hugging_face_llama_attention():
    """Second independent oracle: transformers' eager LlamaAttention with the same weights."""
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4, rope_theta=10000.0,
        attention_bias=False, attn_implementation="eager",
    )
    config._attn_implementation = "eager"
    hf = modeling_llama.LlamaAttention(config, layer_idx=0).double().eval()
    ours = RotarySelfAttention(16, 4, num_kv_heads=2, head_dim=4).double().eval()
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    position_ids = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    cos, sin = modeling_llama.LlamaRotaryEmbedding(config)(x, position_ids)
    causal = torch.full((5, 5), float("-inf"), dtype=torch.float64).triu(1)[None, None].expand(2, 1, 5, 5)
    expected, _ = hf(x, position_embeddings=(cos, sin), attention_mask=causal)
    torch.testing.assert_close(ours(x, position_ids), expected, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunks", [[1] * 7, [3, 1, 2, 1], [5, 2], [1, 6]])
@pytest.mark.parametrize("heads_kv", [(4, 4), (4, 2), (4, 1)])
def test_cached_decoding_equals_full_causal_forward(chunks, heads_kv):
    module = make_module(embed_dim=16, num_heads=heads_kv[0], num_kv_heads=heads_kv[1], rotary_dim=2)
    x = torch.randn(2, sum(chunks), 16, dtype=torch.float64)
    full = module(x)
    cache, outputs, start = KVCache(), [], 0
    for size in chunks:
        outputs.append(module(x[:, start : start + size], cache=cache))
        start += size
        assert cache.length == start
    torch.testing.assert_close(torch.cat(outputs, dim=1), full, atol=SAME_MATH_ATOL, rtol=0)


def test_cache_stores_keys_rotated_at_their_absolute_positions():
    module = make_module(embed_dim=8, num_heads=2, num_kv_heads=1, layout="interleaved")
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    cache = KVCache()
    module(x[:, :3], cache=cache)
    module(x[:, 3:], cache=cache)
    k = linear64(module.k_proj, x.double())[0]  # (seq, d): one kv head
    expected = torch.stack([head_rotation(m, 4, 4, 10000.0, "interleaved") @ k[m] for m in range(5)])
    assert cache.k.shape == (1, 1, 5, 4) and cache.v.shape == (1, 1, 5, 4)
    torch.testing.assert_close(cache.k[0, 0], expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(cache.v[0, 0], linear64(module.v_proj, x.double())[0], atol=1e-12, rtol=0)


def test_causal_mask_is_bottom_right_aligned():
    mask, is_causal = attention_bias_mask(1, 2, 5, causal=True, attention_mask=None, device=torch.device("cpu"))
    assert not is_causal
    assert mask[0, 0].tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    assert attention_bias_mask(1, 4, 4, causal=True, attention_mask=None, device=torch.device("cpu")) == (None, True)
    assert attention_bias_mask(1, 1, 9, causal=True, attention_mask=None, device=torch.device("cpu")) == (None, False)


def test_explicit_positions_with_cache():
    """Explicit positions with a cache mean the same as the default continuation."""
    module = make_module(embed_dim=8, num_heads=2)
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    cache_a, cache_b = KVCache(), KVCache()
    module(x[:, :2], cache=cache_a)
    module(x[:, :2], torch.tensor([0, 1]), cache=cache_b)
    torch.testing.assert_close(
        module(x[:, 2:], cache=cache_a), module(x[:, 2:], torch.tensor([2, 3]), cache=cache_b), atol=0, rtol=0
    )


# --------------------------------------------------------------------------------------------
# padded batches
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("causal", [True, False])
def test_padded_batch_equals_each_sequence_alone(side, causal):
    module = make_module(embed_dim=8, num_heads=4, num_kv_heads=2, causal=causal)
    lengths, width = [5, 3, 1], 5
    seqs = [torch.randn(1, n, 8, dtype=torch.float64) for n in lengths]
    x = torch.zeros(len(lengths), width, 8, dtype=torch.float64)
    positions = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    valid = []
    for row, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        x[row, cols], positions[row, cols], mask[row, cols] = seq[0], torch.arange(n), True
        valid.append(cols)
    x[~mask] = 100.0  # garbage in the padding must not leak into valid tokens
    out = module(x, positions, attention_mask=mask)
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(out[row, valid[row]], module(seq)[0], atol=1e-10, rtol=0)
    assert torch.isfinite(out).all()


def test_left_padded_decoding_with_cache():
    """Prefill a left-padded batch, then decode a token per row: each row equals its own run."""
    module = make_module(embed_dim=8, num_heads=2, num_kv_heads=1)
    a, b = torch.randn(1, 6, 8, dtype=torch.float64), torch.randn(1, 4, 8, dtype=torch.float64)
    # prompts: a[:, :4] (length 4) and b[:, :2] (length 2, two pads on the left)
    x = torch.zeros(2, 4, 8, dtype=torch.float64)
    x[0], x[1, 2:] = a[0, :4], b[0, :2]
    positions = torch.tensor([[0, 1, 2, 3], [0, 0, 0, 1]])
    mask = torch.tensor([[True] * 4, [False, False, True, True]])
    cache = KVCache()
    module(x, positions, cache=cache, attention_mask=mask)
    for step in range(2):
        token = torch.stack((a[0, 4 + step], b[0, 2 + step]))[:, None]  # (2, 1, 8)
        mask = torch.cat((mask, torch.ones(2, 1, dtype=torch.bool)), dim=1)
        out = module(token, torch.tensor([[4 + step], [2 + step]]), cache=cache, attention_mask=mask)
        torch.testing.assert_close(out[0, 0], module(a[:, : 5 + step])[0, -1], atol=1e-10, rtol=0)
        torch.testing.assert_close(out[1, 0], module(b[:, : 3 + step])[0, -1], atol=1e-10, rtol=0)


def test_rows_that_see_no_key_are_zero_and_gradients_finite():
    module = make_module(embed_dim=8, num_heads=2)
    x = torch.randn(1, 3, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[False, True, True]])
    out = module(x, attention_mask=mask)  # causal: query 0 sees only key 0, which is masked
    assert torch.equal(out[0, 0], torch.zeros(8, dtype=torch.float64))
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in module.parameters())


# --------------------------------------------------------------------------------------------
# relative positions
# --------------------------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(
    shift=st.integers(0, 5000),
    row_shift=st.integers(0, 300),
    causal=st.booleans(),
    layout=st.sampled_from(["half", "interleaved"]),
)
def test_shifting_all_positions_leaves_output_unchanged(shift, row_shift, causal, layout):
    module = make_module(embed_dim=8, num_heads=2, num_kv_heads=1, causal=causal, layout=layout)
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(shift))
    reference = module(x)
    shifted = torch.arange(5) + torch.tensor([[shift], [shift + row_shift]])
    torch.testing.assert_close(module(x, shifted), reference, atol=ORACLE_ATOL, rtol=0)


def test_output_depends_on_relative_distances():
    module = make_module(embed_dim=8, num_heads=2)
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    assert (module(x, 2 * torch.arange(5)) - module(x)).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------
# other behaviour
# --------------------------------------------------------------------------------------------
def test_shared_rope_and_dropout():
    rope = RotaryEmbedding(4, layout="interleaved", base=500.0)
    torch.manual_seed(3)
    shared = RotarySelfAttention(8, 2, rope=rope, dropout=0.5).double()
    assert shared.rope is rope
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    shared.eval()
    expected = oracle_attention(shared, x, torch.arange(6)[None], base=500.0, layout="interleaved")
    torch.testing.assert_close(shared(x), expected, atol=ORACLE_ATOL, rtol=0)
    shared.train()
    torch.manual_seed(0)
    assert not torch.allclose(shared(x), expected)


def test_backward_reaches_all_projections():
    module = RotarySelfAttention(8, 2, num_kv_heads=1, bias=True)
    module(torch.randn(2, 4, 8)).pow(2).sum().backward()
    for name, p in module.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"embed_dim": 16, "num_heads": 4, "num_kv_heads": 3}, ValueError, "num_kv_heads"),
        ({"embed_dim": 16, "num_heads": 4, "num_kv_heads": 0}, ValueError, "num_kv_heads"),
        ({"embed_dim": 10, "num_heads": 4}, ValueError, "embed_dim"),
        ({"embed_dim": 12, "num_heads": 4}, ValueError, "head_dim"),
        ({"embed_dim": 16, "num_heads": 4, "head_dim": 5}, ValueError, "head_dim"),
        ({"embed_dim": 16, "num_heads": 0}, ValueError, "num_heads"),
        ({"embed_dim": 16.0, "num_heads": 4}, TypeError, "embed_dim"),
        ({"embed_dim": 16, "num_heads": 4, "rotary_dim": 6}, ValueError, "rotary_dim"),
        ({"embed_dim": 16, "num_heads": 4, "layout": "spiral"}, ValueError, "layout"),
        ({"embed_dim": 16, "num_heads": 4, "dropout": 1.0}, ValueError, "dropout"),
        ({"embed_dim": 16, "num_heads": 4, "causal": 1}, TypeError, "causal"),
        ({"embed_dim": 16, "num_heads": 4, "rope": RotaryEmbedding(8)}, ValueError, "rope"),
        ({"embed_dim": 16, "num_heads": 4, "rope": RotaryEmbedding(4), "base": 500.0}, ValueError, "rope"),
        ({"embed_dim": 16, "num_heads": 4, "rope": "yes"}, TypeError, "rope"),
    ],
)
def test_constructor_errors_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        RotarySelfAttention(**kwargs)


def test_forward_errors_name_the_argument():
    module = RotarySelfAttention(8, 2)
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="x must have shape"):
        module(torch.randn(3, 8))
    with pytest.raises(ValueError, match="x must have shape"):
        module(torch.randn(2, 3, 6))
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        module(torch.ones(2, 3, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="positions"):
        module(x, torch.arange(4))
    with pytest.raises(TypeError, match="positions"):
        module(x, torch.arange(3.0))
    with pytest.raises(TypeError, match="attention_mask"):
        module(x, attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="attention_mask"):
        module(x, attention_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="cache"):
        module(x, cache={})


def test_failed_call_leaves_cache_untouched():
    module = RotarySelfAttention(8, 2)
    cache = KVCache()
    module(torch.randn(2, 3, 8), cache=cache)
    with pytest.raises(ValueError, match="attention_mask"):
        module(torch.randn(2, 1, 8), cache=cache, attention_mask=torch.ones(2, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="cache"):
        module(torch.randn(1, 1, 8), cache=cache)
    assert cache.length == 3


def test_kv_cache_update_validation():
    cache = KVCache()
    assert cache.length == 0 and cache.k is None
    k = torch.randn(1, 2, 3, 4)
    k_all, v_all = cache.update(k, k + 1)
    assert cache.length == 3 and torch.equal(k_all, k) and torch.equal(v_all, k + 1)
    k_all, _ = cache.update(k[:, :, :1], k[:, :, :1])
    assert k_all.shape == (1, 2, 4, 4) and torch.equal(k_all[:, :, 3], k[:, :, 0])
    with pytest.raises(ValueError, match="k and v"):
        cache.update(k, k[:, :1])
    with pytest.raises(ValueError, match="k of shape"):
        cache.update(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
    with pytest.raises(ValueError, match="k must be"):
        cache.update(torch.randn(2, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match="float64"):
        cache.update(k.double(), k.double())
    cache.reset()
    assert cache.length == 0
