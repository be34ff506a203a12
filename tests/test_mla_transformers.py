"""patch() on transformers' DeepSeek-V3 (MLA): tiny random models match the unpatched ones.

Two layers (one dense via ``first_k_dense_replace``, one MoE with 4 small experts), both rope
pairings (``rope_interleave`` true: transformers' ``apply_rotary_pos_emb_interleave``; false:
``apply_rotary_pos_emb``), with and without YaRN (DeepSeek's ``mscale`` / ``mscale_all_dim``).
The q and compressed-kv projections are scaled up (:func:`sharp`) so that attention depends on
position: a wrong pairing then moves the logits ~1000x past the 1e-5 bound (checked below), and
the rotated keys in the cache are compared too (the logits cannot see the order of the rope
channels, which q and k share).
"""

import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model_compare import FLOAT32_ATOL, assert_logits_match, logits_mismatch  # noqa: E402
from ropekit.integrations import transformers_mla  # noqa: E402
from ropekit.integrations.transformers import patch, unpatch  # noqa: E402

torch.set_num_threads(1)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
ROPE_CASES = {
    "plain": None,
    "yarn-v3": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},  # DeepSeek-V3 / Kimi K2
    "yarn-v2": {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707},  # DeepSeek-V2
    "yarn-unequal": {**YARN, "mscale": 0.5, "mscale_all_dim": 1.0},  # tables scaled by 0.898
    "yarn-only-mscale": {**YARN, "mscale": 0.707},  # transformers' tables: mscale(s, 1)
}
IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
GAIN = 8.0


def tiny(rope_parameters=None, **extra):
    """A 2-layer DeepSeek-V3 (layer 0 dense, layer 1 MoE), q_lora_rank 48, kv_lora_rank 32, rope 8 of 24 channels."""
    kwargs = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                  num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32,
                  q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256)
    if rope_parameters is not None:
        kwargs["rope_parameters"] = dict(rope_parameters)
    config = transformers.DeepseekV3Config(**kwargs, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return sharp(transformers.DeepseekV3ForCausalLM(config).eval())


def sharp(model, gain=GAIN):
    """The q and compressed-kv projections times ``gain``: q.k large enough that attention depends on position."""
    with torch.no_grad():
        for layer in model.model.layers:
            attention = layer.self_attn
            (attention.q_b_proj if attention.q_b_proj is not None else attention.q_proj).weight.mul_(gain)
            attention.kv_a_proj_with_mqa.weight.mul_(gain)
    return model


def forward(model, ids):
    """Logits and the rotated keys each layer cached (transformers' DynamicCache values: k_rot)."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
    return out.logits, [layer.values.clone() for layer in out.past_key_values.layers]


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_logits_and_cached_keys_match_and_unpatch_restores(interleave, case, monkeypatch):
    calls = []
    real = transformers_mla.apply_rotary_mla
    monkeypatch.setattr(transformers_mla, "apply_rotary_mla", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny(ROPE_CASES[case], rope_interleave=interleave)
    ref, ref_keys = forward(model, IDS)
    patch(model)
    out, keys = forward(model, IDS)
    assert len(calls) == (2 if interleave else 0)  # one call per layer for q_pe and k_pe together
    assert_logits_match(out, ref)
    for got, want in zip(keys, ref_keys, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # transformers' de-interleaved order
    unpatch(model)
    again, again_keys = forward(model, IDS)
    assert torch.equal(again, ref) and all(torch.equal(a, b) for a, b in zip(again_keys, ref_keys, strict=True))
    for module in model.modules():
        assert "forward" not in module.__dict__
    modeling = sys.modules[type(model).__module__]
    assert not hasattr(modeling.apply_rotary_pos_emb_interleave, "__ropekit_original__")
    assert not hasattr(modeling.apply_rotary_pos_emb, "__ropekit_original__")


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "half"])
def test_greedy_generation_identical(interleave):
    model = tiny(ROPE_CASES["yarn-v3"], rope_interleave=interleave)
    prompt = IDS[:1, :8]
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(prompt, **kwargs)
        patch(model)
        out = model.generate(prompt, **kwargs)
        unpatch(model)
    assert torch.equal(out, ref)
    assert len(set(ref[0, 8:].tolist())) > 1  # not one token repeated: the comparison has something to see


def test_the_comparison_detects_a_wrong_pairing_and_a_wrong_key_order(monkeypatch):
    """A patch that rotated the interleaved slices in half pairs, or cached them in the other order, must fail."""
    model = tiny(ROPE_CASES["yarn-v3"])
    ref, ref_keys = forward(model, IDS)
    patch(model, layout="half")  # what patch would do if it ignored rope_interleave
    wrong, _ = forward(model, IDS)
    unpatch(model)
    problem = logits_mismatch(wrong, ref)
    assert problem is not None and (wrong - ref).abs().max() > 100 * FLOAT32_ATOL, problem
    real = transformers_mla.apply_rotary_mla
    monkeypatch.setattr(transformers_mla, "apply_rotary_mla",
                        lambda *a, **k: real(*a, **{**k, "output_layout": "interleaved"}))
    patch(model)
    same_logits, reordered_keys = forward(model, IDS)
    unpatch(model)
    assert_logits_match(same_logits, ref)  # q and k share the order: the scores cannot tell
    assert (reordered_keys[0] - ref_keys[0]).abs().max() > 0.1  # the cache can


def test_weights_permuted_once_patched_with_half_pairs_match():
    """The other way to DeepSeek's order: the rope rows permuted once, then the half pairing, no per-call reorder."""
    from ropekit import mla

    model = tiny(ROPE_CASES["yarn-v2"])
    ref, ref_keys = forward(model, IDS)
    config = model.config
    with torch.no_grad():
        for layer in model.model.layers:
            attention = layer.self_attn
            for proj, heads, nope in ((attention.q_b_proj, config.num_attention_heads, config.qk_nope_head_dim),
                                      (attention.kv_a_proj_with_mqa, 1, config.kv_lora_rank)):
                proj.weight.copy_(mla.permute_mla_weight(proj.weight, heads, nope_dim=nope,
                                                         rotary_dim=config.qk_rope_head_dim, src="interleaved",
                                                         dst="half"))
    patch(model, layout="half")
    out, keys = forward(model, IDS)
    unpatch(model)
    assert_logits_match(out, ref)
    torch.testing.assert_close(keys[1], ref_keys[1], rtol=0, atol=1e-5)


def test_an_unpatched_deepseek_beside_a_patched_one_keeps_transformers_rotation():
    patched, other = tiny(), tiny(ROPE_CASES["yarn-v2"])
    ref, _ = forward(other, IDS)
    patch(patched)
    out, _ = forward(other, IDS)
    assert torch.equal(out, ref)
    patch(other)
    unpatch(patched)  # the dispatcher stays while `other` uses it
    modeling = sys.modules[type(other).__module__]
    assert hasattr(modeling.apply_rotary_pos_emb_interleave, "__ropekit_original__")
    assert_logits_match(forward(other, IDS)[0], ref)
    unpatch(other)
    assert not hasattr(modeling.apply_rotary_pos_emb_interleave, "__ropekit_original__")


def test_bfloat16_model_runs_with_float32_tables():
    from model_compare import assert_bfloat16_close

    model = tiny(ROPE_CASES["yarn-v3"]).to(torch.bfloat16)
    exact, _ = forward(tiny(ROPE_CASES["yarn-v3"]).to(torch.bfloat16).float(), IDS)
    ref, _ = forward(model, IDS)
    patch(model)
    out, _ = forward(model, IDS)
    unpatch(model)
    assert out.dtype == torch.bfloat16
    assert_bfloat16_close(out, ref, exact)


def test_deepseek_v2_is_refused_not_half_patched():
    """DeepSeek-V2's modeling rotates by complex ``freqs_cis`` (no ``apply_rotary_pos_emb``): patch refuses it."""
    config = transformers.DeepseekV2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                                           moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                                           first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
                                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    model = transformers.DeepseekV2ForCausalLM(config).eval()
    with pytest.raises(ValueError, match="DeepseekV2ForCausalLM"):
        patch(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
