"""ropekit.mla: DeepSeek MLA's decoupled RoPE against transformers, vLLM's reference and the float64 oracle.

Oracles: the float64 rotation matrices (``ropekit.apply_reference``); transformers' own
DeepSeek-V3 functions (``apply_rotary_pos_emb_interleave``, ``apply_rotary_pos_emb``, the
attention's ``scaling`` and the rotary module's ``attention_scaling``); vLLM's
``DeepseekScalingRotaryEmbedding`` ported into tests/mla_reference.py (its file names the sources).
"""

import math

import pytest
import torch

import ropekit
from mla_reference import (
    deepseek_cos_sin_cache,
    deepseek_forward_native,
    deepseek_mscale,
    deepseek_softmax_scale,
    yarn_get_mscale,
)
from ropekit import mla, ops
from ropekit.scaling import YaRN

torch.set_num_threads(1)

BACKENDS = [b for b in ("cpu", "torch") if b in ops.available()]
OTHER = {"half": "interleaved", "interleaved": "half"}
NOPE, ROPE = 16, 8  # channels of a query head: [q_nope (16) | q_pe (8)]


def inputs(dtype=torch.float32, batch=2, heads=3, seq=5, seed=0):
    """q ``(batch, heads, seq, NOPE + ROPE)``, k_pe ``(batch, 1, seq, ROPE)`` and their positions ``(batch, seq)``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, NOPE + ROPE, generator=gen).to(dtype)
    k_pe = torch.randn(batch, 1, seq, ROPE, generator=gen).to(dtype)
    positions = torch.tensor([[3, 4, 5, 6, 7], [0, 9, 17, 40, 41]])[:batch, :seq]
    return q, k_pe, positions


def tables(positions, scaling=None, factor=1.0):
    inv_freq, _ = ropekit.inv_frequencies(ROPE, 10000.0, scaling)
    cos, sin = ropekit.cos_sin(positions, inv_freq, attention_scale=factor)
    return cos[:, None], sin[:, None], inv_freq  # (batch, 1, seq, ROPE // 2)


def deinterleave(x):
    return ropekit.convert_layout(x, src="interleaved", dst="half")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("reorder", [False, True])
def test_rotation_equals_the_float64_rotation_matrices(backend, layout, reorder):
    q, k_pe, positions = inputs()
    rule = YaRN(factor=8.0, original_max_position_embeddings=16, mscale=0.707, mscale_all_dim=0.707)
    factor = mla.attention_factor(rule)
    cos, sin, inv_freq = tables(positions, rule, factor)
    output_layout = OTHER[layout] if reorder else None
    q_out, k_out = mla.apply_rotary_mla(q, k_pe, cos, sin, layout=layout, output_layout=output_layout,
                                        backend=backend)
    want_q = ropekit.apply_reference(q[..., NOPE:], positions[:, None], inv_freq, layout=layout,
                                     attention_scale=factor)
    want_k = ropekit.apply_reference(k_pe, positions[:, None], inv_freq, layout=layout, attention_scale=factor)
    if reorder:
        want_q, want_k = (ropekit.convert_layout(w, src=layout, dst=OTHER[layout]) for w in (want_q, want_k))
    assert torch.equal(q_out[..., :NOPE], q[..., :NOPE])
    torch.testing.assert_close(q_out[..., NOPE:].double(), want_q, rtol=0, atol=2e-6)
    torch.testing.assert_close(k_out.double(), want_k, rtol=0, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("interleave", [True, False])
def test_equals_transformers_deepseek_v3_rotations_bit_for_bit(backend, interleave):
    """float32 with the same tables: transformers' rope_interleave true (de-interleaved outputs) and false."""
    modeling = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    q, k_pe, positions = inputs()
    cos, sin, _ = tables(positions)
    full_cos, full_sin = torch.cat([cos[:, 0]] * 2, -1), torch.cat([sin[:, 0]] * 2, -1)  # transformers' width
    if interleave:
        want_q, want_k = modeling.apply_rotary_pos_emb_interleave(q[..., NOPE:], k_pe, full_cos, full_sin)
        q_out, k_out = mla.apply_rotary_mla(q, k_pe, cos, sin, layout="interleaved", output_layout="half",
                                            backend=backend)
    else:
        want_q, want_k = modeling.apply_rotary_pos_emb(q[..., NOPE:], k_pe, full_cos, full_sin)
        q_out, k_out = mla.apply_rotary_mla(q, k_pe, cos, sin, layout="half", backend=backend)
    assert torch.equal(q_out[..., NOPE:], want_q) and torch.equal(k_out, want_k)
    assert torch.equal(q_out[..., :NOPE], q[..., :NOPE])


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place_in_interleaved_pairs_and_the_permuted_copy_differ_only_by_the_permutation(backend):
    q, k_pe, positions = inputs()
    cos, sin, _ = tables(positions)
    q_half, k_half = mla.apply_rotary_mla(q, k_pe, cos, sin, layout="interleaved", output_layout="half",
                                          backend=backend)
    q_in, k_in = q.clone(), k_pe.clone()
    out = mla.apply_rotary_mla(q_in, k_in, cos, sin, layout="interleaved", inplace=True, backend=backend)
    assert out[0] is q_in and out[1] is k_in
    assert torch.equal(deinterleave(q_in[..., NOPE:]), q_half[..., NOPE:]) and torch.equal(deinterleave(k_in), k_half)
    assert torch.equal(q_in[..., :NOPE], q[..., :NOPE])
    # the scores: q . k over the rope channels, in either order
    scores = q_half[..., NOPE:] @ k_half.transpose(-1, -2)
    torch.testing.assert_close(q_in[..., NOPE:] @ k_in.transpose(-1, -2), scores, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_permuted_once_then_half_pairs_equal_transformers_interleave(backend):
    """The other way to DeepSeek's order: permute the projections' rope rows once, then rotate in half pairs."""
    heads, hidden, kv_lora_rank = 3, 20, 12
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, hidden, generator=gen)
    w_q = torch.randn(heads * (NOPE + ROPE), hidden, generator=gen)
    w_kv = torch.randn(kv_lora_rank + ROPE, hidden, generator=gen)
    _, _, positions = inputs()
    cos, sin, _ = tables(positions)

    def project(wq, wkv):
        q = (x @ wq.T).view(2, 5, heads, NOPE + ROPE).transpose(1, 2)
        k_pe = (x @ wkv.T)[..., kv_lora_rank:].unsqueeze(1)
        return q, k_pe

    want = mla.apply_rotary_mla(*project(w_q, w_kv), cos, sin, layout="interleaved", output_layout="half",
                                backend=backend)
    wq_half = mla.permute_mla_weight(w_q, heads, nope_dim=NOPE, rotary_dim=ROPE, src="interleaved", dst="half")
    wkv_half = mla.permute_mla_weight(w_kv, 1, nope_dim=kv_lora_rank, rotary_dim=ROPE, src="interleaved", dst="half")
    got = mla.apply_rotary_mla(*project(wq_half, wkv_half), cos, sin, layout="half", backend=backend)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    back = mla.permute_mla_weight(wq_half, heads, nope_dim=NOPE, rotary_dim=ROPE, src="half", dst="interleaved")
    assert torch.equal(back, w_q)
    assert torch.equal(wkv_half[:kv_lora_rank], w_kv[:kv_lora_rank])  # the compressed kv rows stay put
    with pytest.raises(ValueError, match="n_heads \\* \\(nope_dim \\+ rotary_dim\\)"):
        mla.permute_mla_weight(w_q, 2, nope_dim=NOPE, rotary_dim=ROPE, src="interleaved", dst="half")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("output_layout", [None, "half"])
def test_by_position_equals_broadcast_tables(backend, output_layout):
    q, k_pe, positions = inputs()
    inv_freq, _ = ropekit.inv_frequencies(ROPE)
    cos_table, sin_table = ropekit.cos_sin(torch.arange(64), inv_freq)
    cos, sin, _ = tables(positions)
    want = mla.apply_rotary_mla(q, k_pe, cos, sin, layout="interleaved", output_layout=output_layout, backend=backend)
    got = mla.rotate_mla(q, k_pe, cos_table, sin_table, positions=positions, tensor_format="bhsd",
                         layout="interleaved", output_layout=output_layout, backend=backend)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # a decode step by an int offset (the C++ kernel reads the table rows where they lie), packed tokens
    q1, k1 = q[:, :, -1:], k_pe[:, :, -1:]
    step = mla.rotate_mla(q1, k1, cos_table, sin_table, offsets=41, tensor_format="bhsd", layout="interleaved",
                          output_layout=output_layout, backend=backend)
    c41, s41 = cos_table[41:42], sin_table[41:42]
    want = mla.apply_rotary_mla(q1, k1, c41, s41, layout="interleaved", output_layout=output_layout, backend=backend)
    assert torch.equal(step[0], want[0]) and torch.equal(step[1], want[1])
    with pytest.raises(ValueError, match="positions"):
        mla.rotate_mla(q, k_pe, cos_table, sin_table, positions=positions + 60, tensor_format="bhsd",
                       layout="interleaved", backend=backend)


def test_vllm_deepseek_scaling_rotary_embedding_reference():
    """vLLM's DeepseekScalingRotaryEmbedding (float32 tables, interleaved pairs) vs ropekit's tables and rotation."""
    rotary_dim, base, original, factor = 16, 10000.0, 64, 4.0
    for mscale, mscale_all_dim in ((1.0, 1.0), (0.707, 0.707), (1.0, 0.0), (0.5, 1.0)):
        rule = YaRN(factor=factor, original_max_position_embeddings=original, mscale=mscale,
                    mscale_all_dim=mscale_all_dim)
        cache = deepseek_cos_sin_cache(rotary_dim, base, original, factor, mscale=mscale,
                                       mscale_all_dim=mscale_all_dim)
        assert mla.attention_factor(rule) == pytest.approx(deepseek_mscale(factor, mscale=mscale,
                                                                           mscale_all_dim=mscale_all_dim), rel=1e-15)
        inv_freq, _ = ropekit.inv_frequencies(rotary_dim, base, rule)
        positions = torch.arange(cache.shape[0])
        cos, sin = ropekit.cos_sin(positions, inv_freq, attention_scale=mla.attention_factor(rule))
        # vLLM's angles are float32 products t * inv_freq: their error grows with the position (~t * 2**-24)
        atol = 4e-7 * positions[:, None].double() + 1e-6
        assert ((torch.cat((cos, sin), -1).double() - cache.double()).abs() <= atol).all()
        # the rotation with vLLM's own table: tokens (tokens, heads, rotary_dim), k_pe (tokens, 1, rotary_dim)
        gen = torch.Generator().manual_seed(7)
        tokens = torch.tensor([0, 1, 5, 63, 64, 200, 255])
        q = torch.randn(tokens.numel(), 4, 24, generator=gen)
        k_pe = torch.randn(tokens.numel(), 1, rotary_dim, generator=gen)
        want_q, want_k = deepseek_forward_native(tokens, q[..., 8:], k_pe, cache, rotary_dim, rotary_dim,
                                                 is_neox_style=False)
        half = rotary_dim // 2
        got_q, got_k = mla.apply_rotary_mla(q, k_pe, cache[tokens, None, :half], cache[tokens, None, half:],
                                            layout="interleaved")
        by_position = mla.rotate_mla(q, k_pe, cache[:, :half].contiguous(), cache[:, half:].contiguous(),
                                     positions=tokens, tensor_format="thd", layout="interleaved")
        assert torch.equal(by_position[0], got_q) and torch.equal(by_position[1], got_k)
        assert torch.equal(got_q[..., :8], q[..., :8])
        torch.testing.assert_close(got_q[..., 8:], want_q, rtol=0, atol=2e-6)
        torch.testing.assert_close(got_k, want_k, rtol=0, atol=2e-6)


def test_vllm_neox_style_reference_equals_the_half_layout():
    """``is_neox_style=True`` (transformers' rope_interleave false) with (batch, seq) positions, as vLLM assumes."""
    rotary_dim, base, original, factor = 16, 10000.0, 64, 4.0
    cache = deepseek_cos_sin_cache(rotary_dim, base, original, factor, mscale=1.0, mscale_all_dim=1.0)
    gen = torch.Generator().manual_seed(8)
    positions = torch.tensor([[0, 3, 9], [100, 101, 102]])
    q = torch.randn(2, 3, 4, rotary_dim, generator=gen)  # (batch, seq, heads, rotary_dim): "bshd"
    k_pe = torch.randn(2, 3, 1, rotary_dim, generator=gen)
    want_q, want_k = deepseek_forward_native(positions, q, k_pe, cache, rotary_dim, rotary_dim, is_neox_style=True)
    half = rotary_dim // 2
    got_q, got_k = mla.rotate_mla(q, k_pe, cache[:, :half].contiguous(), cache[:, half:].contiguous(),
                                  positions=positions, tensor_format="bshd", layout="half")
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=2e-6)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=2e-6)


YARN_CASES = [  # (mscale, mscale_all_dim): DeepSeek-V3 / Kimi K2, V2, and the two where transformers differs
    (1.0, 1.0), (0.707, 0.707), (0.707, 1.0), (None, None), (0.5, None), (None, 1.0),
]


@pytest.mark.parametrize("mscale,mscale_all_dim", YARN_CASES)
def test_softmax_scale_equals_transformers_and_vllm(mscale, mscale_all_dim):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    params = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    params.update({k: v for k, v in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)) if v is not None})
    config = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32,
                                           q_lora_rank=None, max_position_embeddings=2560, rope_parameters=params)
    rule = ropekit.RopeConfig.from_hf(config).scaling
    hf_scaling = DeepseekV3Attention(config, 0).scaling
    assert mla.softmax_scale(24, rule) == pytest.approx(hf_scaling, rel=1e-15)
    assert mla.softmax_scale(24, rule) == pytest.approx(deepseek_softmax_scale(24, params), rel=1e-15)
    assert mla.softmax_scale(24) == 24 ** -0.5 == deepseek_softmax_scale(24, None)
    # the cos/sin factor: DeepSeek's (vLLM) and transformers' agree unless exactly one of the two keys is set
    hf_factor = DeepseekV3RotaryEmbedding(config).attention_scaling
    vllm_factor = deepseek_mscale(40.0, mscale=1 if mscale is None else mscale,
                                  mscale_all_dim=0 if mscale_all_dim is None else mscale_all_dim)
    assert mla.attention_factor(rule) == pytest.approx(vllm_factor, rel=1e-15)
    assert rule.attention_scale() == pytest.approx(hf_factor, rel=1e-15)
    if (mscale is None) == (mscale_all_dim is None):
        assert mla.attention_factor(rule) == pytest.approx(hf_factor, rel=1e-15)
    else:  # transformers then uses mscale(s, 1)
        assert hf_factor == pytest.approx(yarn_get_mscale(40.0), rel=1e-15)
        assert not math.isclose(mla.attention_factor(rule), hf_factor, rel_tol=1e-6)


def test_released_configs_fold_the_whole_factor_into_the_softmax_scale():
    rope = ropekit.RopeConfig.from_hf({
        "model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "max_position_embeddings": 163840, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
                         "beta_slow": 1, "original_max_position_embeddings": 4096}})
    assert rope.layout == "interleaved" and rope.rotary_dim == 64
    assert mla.attention_factor(rope.scaling) == 1.0
    assert mla.softmax_scale(192, rope.scaling) == pytest.approx((0.1 * math.log(40) + 1) ** 2 / math.sqrt(192))
    with pytest.raises(TypeError, match="scaling"):
        mla.attention_factor(ropekit.scaling.Linear(2.0))
    with pytest.raises(TypeError, match="qk_head_dim"):
        mla.softmax_scale(192.0)
    with pytest.raises(ValueError, match="qk_head_dim"):
        mla.softmax_scale(0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("output_layout", [None, "half"])
def test_gradients_in_float64(backend, output_layout):
    q, k_pe, positions = inputs(torch.float64, batch=1, heads=2, seq=3)
    cos, sin, _ = tables(positions)
    cos, sin = cos.double(), sin.double()
    q.requires_grad_(True), k_pe.requires_grad_(True)

    def broadcast(q, k_pe):
        return mla.apply_rotary_mla(q, k_pe, cos, sin, layout="interleaved", output_layout=output_layout,
                                    backend=backend)

    inv_freq, _ = ropekit.inv_frequencies(ROPE)
    cos_table, sin_table = (t.double() for t in ropekit.cos_sin(torch.arange(16), inv_freq))

    def by_position(q, k_pe):
        return mla.rotate_mla(q, k_pe, cos_table, sin_table, positions=positions, tensor_format="bhsd",
                              layout="interleaved", output_layout=output_layout, backend=backend)

    assert torch.autograd.gradcheck(broadcast, (q, k_pe))
    assert torch.autograd.gradgradcheck(broadcast, (q, k_pe))
    assert torch.autograd.gradcheck(by_position, (q, k_pe))
    # the gradient is the rotation by -theta of the output gradient (the rotation is orthogonal)
    grad_q, grad_k = torch.randn_like(q), torch.randn_like(k_pe)
    q_out, k_out = broadcast(q, k_pe)
    gq, gk = torch.autograd.grad((q_out * grad_q).sum() + (k_out * grad_k).sum(), (q, k_pe))
    assert torch.equal(gq[..., :NOPE], grad_q[..., :NOPE])
    layout_out = output_layout or "interleaved"
    inverse = ropekit.apply_rotary(grad_k, cos, -sin, layout=layout_out)
    want_k = inverse if output_layout is None else ropekit.convert_layout(inverse, src="half", dst="interleaved")
    torch.testing.assert_close(gk, want_k, rtol=0, atol=1e-12)


def test_mla_keys_concatenate_as_transformers_expand_kv():
    gen = torch.Generator().manual_seed(9)
    k_nope = torch.randn(2, 3, 5, NOPE, generator=gen)
    k_pe = torch.randn(2, 1, 5, ROPE, generator=gen)
    keys = mla.mla_keys(k_nope, k_pe)
    assert keys.shape == (2, 3, 5, NOPE + ROPE)
    assert torch.equal(keys, torch.cat((k_nope, k_pe.expand(-1, 3, -1, -1)), -1))
    k_nope.requires_grad_(True), k_pe.requires_grad_(True)
    grad = torch.autograd.grad(mla.mla_keys(k_nope, k_pe).sum(), (k_nope, k_pe))
    assert torch.equal(grad[0], torch.ones_like(k_nope)) and torch.equal(grad[1], torch.full_like(k_pe, 3.0))
    with pytest.raises(ValueError, match="k_nope and k_pe"):
        mla.mla_keys(k_nope.detach(), k_pe.detach().double())
    with pytest.raises(ValueError, match="broadcast"):
        mla.mla_keys(k_nope.detach(), torch.randn(2, 1, 4, ROPE))


def test_bad_arguments_are_named():
    q, k_pe, positions = inputs()
    cos, sin, _ = tables(positions)
    rotate = mla.apply_rotary_mla
    with pytest.raises(TypeError):
        rotate(q, k_pe, cos, sin)  # the pairing is always named
    with pytest.raises(ValueError, match="k_pe must have a positive even"):
        rotate(q, k_pe[..., :7], cos, sin, layout="half")
    with pytest.raises(ValueError, match="full-width tables"):
        rotate(q, k_pe, torch.cat([cos] * 2, -1), torch.cat([sin] * 2, -1), layout="half")
    with pytest.raises(ValueError, match="sin must have"):
        rotate(q, k_pe, cos, sin[..., :2], layout="half")
    with pytest.raises(ValueError, match="fewer than k_pe's rotary_dim"):
        rotate(q[..., :4], k_pe, cos, sin, layout="half")
    with pytest.raises(ValueError, match="same number of dimensions"):
        rotate(q, k_pe[:, 0], cos, sin, layout="half")
    with pytest.raises(ValueError, match="output_layout"):
        rotate(q, k_pe, cos, sin, layout="interleaved", output_layout="half", inplace=True)
    with pytest.raises(ValueError, match="output_layout"):
        rotate(q, k_pe, cos, sin, layout="half", output_layout="zigzag")
    with pytest.raises(TypeError, match="inplace"):
        rotate(q, k_pe, cos, sin, layout="half", inplace=1)
    with pytest.raises(TypeError, match="k_pe"):
        rotate(q, k_pe.long(), cos, sin, layout="half")
    with pytest.raises(ValueError, match="k_pe has elements that share memory"):
        rotate(q, k_pe.expand(2, 3, 5, ROPE)[:, :1].expand(2, 2, 5, ROPE), cos, sin, layout="half", inplace=True)
    shared = torch.randn(2, 3, 5, NOPE + ROPE)
    with pytest.raises(ValueError, match="share memory"):  # k_pe a view of q's rope channels, in place
        rotate(shared, shared[:, :1, :, NOPE:], cos, sin, layout="half", inplace=True)
    with pytest.raises(ValueError, match="sin_table must have"):
        mla.rotate_mla(q, k_pe, cos[0, 0], sin[0, 0, :, :2], positions=positions, tensor_format="bhsd",
                       layout="half")
