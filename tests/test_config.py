"""RopeConfig: construction, every config.json form from_hf reads, and its errors."""

import dataclasses

import pytest
import torch

import ropekit
from ropekit import RopeConfig, RotaryEmbedding
from ropekit.scaling import DynamicNTK, Linear, Llama3, LongRoPE, Proportional, YaRN

torch.set_num_threads(1)

LLAMA2 = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "max_position_embeddings": 4096,
          "rope_theta": 10000.0}


# -- construction ---------------------------------------------------------------------------------


def test_defaults_and_inv_frequencies():
    rope = RopeConfig(64)
    assert (rope.rotary_dim, rope.base, rope.layout, rope.scaling, rope.max_positions) == (64, 10000.0, "half",
                                                                                           None, None)
    inv_freq, scale = rope.inv_frequencies()
    torch.testing.assert_close(inv_freq, ropekit.base_inv_freq(64, 10000.0), rtol=0, atol=0)
    assert scale == 1.0
    rope = RopeConfig(128, 32, base=1e6, scaling=YaRN(4.0, 2048), max_positions=8192)
    expected = ropekit.inv_frequencies(32, 1e6, YaRN(4.0, 2048), seq_len=9000)
    assert rope.inv_frequencies(9000)[1] == expected[1]
    torch.testing.assert_close(rope.inv_frequencies(9000)[0], expected[0], rtol=0, atol=0)


def test_scaling_dict_is_converted():
    rope = RopeConfig(64, scaling={"type": "dynamic", "factor": 2.0}, max_positions=2048)
    assert rope.scaling == DynamicNTK(2.0, 2048)
    assert RopeConfig(64, scaling={"rope_type": "linear", "factor": 2}) == RopeConfig(64, scaling=Linear(2.0))


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"head_dim": 63}, ValueError, ["head_dim", "63"]),
        ({"head_dim": 64.0}, TypeError, ["head_dim", "64.0"]),
        ({"head_dim": 64, "rotary_dim": 96}, ValueError, ["rotary_dim", "96", "64"]),
        ({"head_dim": 64, "rotary_dim": 31}, ValueError, ["rotary_dim", "31"]),
        ({"head_dim": 64, "base": -1.0}, ValueError, ["base", "-1.0"]),
        ({"head_dim": 64, "layout": "spiral"}, ValueError, ["layout", "'spiral'"]),
        ({"head_dim": 64, "max_positions": 0}, ValueError, ["max_positions", "0"]),
        ({"head_dim": 64, "scaling": "yarn"}, TypeError, ["scaling", "str"]),
        ({"head_dim": 64, "scaling": LongRoPE([1.0] * 4, [1.0] * 4, 64, factor=2.0)}, ValueError,
         ["4 entries", "rotary_dim=64", "32"]),
        ({"head_dim": 64, "scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0],
                                      "factor": 2.0, "original_max_position_embeddings": 8}}, ValueError,
         ["1 entries", "32"]),
    ],
)
def test_construction_errors(kwargs, error, words):
    with pytest.raises(error) as info:
        RopeConfig(**kwargs)
    for word in words:
        assert word in str(info.value)


# -- from_hf: the forms in circulation ------------------------------------------------------------


def test_rope_scaling_with_type_or_rope_type_and_v5_rope_parameters_agree():
    yarn = {"factor": 4.0, "original_max_position_embeddings": 32768}
    old = {**LLAMA2, "rope_theta": 1e6, "rope_scaling": {**yarn, "type": "yarn"}}
    new = {**LLAMA2, "rope_scaling": {**yarn, "rope_type": "yarn"}, "rope_theta": 1e6}
    v5 = {**{k: v for k, v in LLAMA2.items() if k != "rope_theta"},
          "rope_parameters": {**yarn, "rope_type": "yarn", "rope_theta": 1e6}}
    ropes = {RopeConfig.from_hf(cfg) for cfg in (old, new, v5)}
    assert ropes == {RopeConfig(128, 128, 1e6, "half", YaRN(4.0, 32768), 4096)}


def test_head_dim_sources():
    assert RopeConfig.from_hf(LLAMA2).head_dim == 128
    assert RopeConfig.from_hf({**LLAMA2, "head_dim": 64}).head_dim == 64
    assert RopeConfig.from_hf({**LLAMA2, "head_dim": None}).head_dim == 128  # null falls back, as in transformers
    mla = {**LLAMA2, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128}
    assert RopeConfig.from_hf(mla).head_dim == RopeConfig.from_hf(mla).rotary_dim == 64


@pytest.mark.parametrize(
    "extra, rotary_dim",
    [
        ({"partial_rotary_factor": 0.5}, 64),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}}, 32),
        ({"partial_rotary_factor": 0.4, "head_dim": 80}, 32),  # phi-2
        ({"rotary_pct": 0.25, "rotary_emb_base": 10000}, 32),  # GPT-NeoX
        ({"rotary_dim": 64, "head_dim": 256}, 64),  # GPT-J
    ],
)
def test_partial_rotary_forms(extra, rotary_dim):
    cfg = {k: v for k, v in {**LLAMA2, **extra}.items() if not ("rope_parameters" in extra and k == "rope_theta")}
    assert RopeConfig.from_hf(cfg).rotary_dim == rotary_dim


def test_gpt_j_style_keys():
    gptj = {"model_type": "gptj", "n_embd": 4096, "n_head": 16, "n_positions": 2048, "rotary_dim": 64}
    assert RopeConfig.from_hf(gptj) == RopeConfig(256, 64, 10000.0, "interleaved", None, 2048)


def test_base_sources():
    no_base = {k: v for k, v in LLAMA2.items() if k != "rope_theta"}
    assert RopeConfig.from_hf(no_base).base == 10000.0
    assert RopeConfig.from_hf({**no_base, "rotary_emb_base": 25000}).base == 25000.0
    assert RopeConfig.from_hf({**LLAMA2, "rope_theta": 1e6}).base == 1e6
    inner = {**LLAMA2, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert RopeConfig.from_hf(inner).base == 5e5


def test_top_level_original_length_wins_for_phi3():
    params = {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48,
              "original_max_position_embeddings": 8192}
    cfg = {"hidden_size": 3072, "num_attention_heads": 32, "max_position_embeddings": 131072,
           "original_max_position_embeddings": 4096, "rope_scaling": params}
    rule = RopeConfig.from_hf(cfg).scaling
    assert rule.original_max_position_embeddings == 4096 and rule.factor == 32.0
    yarn = {**cfg, "rope_scaling": {"type": "yarn", "factor": 8.0}}
    assert RopeConfig.from_hf(yarn).scaling == YaRN(8.0, 4096)
    linear = {**cfg, "rope_scaling": {"type": "linear", "factor": 8.0}}  # not a key linear reads: left alone
    assert RopeConfig.from_hf(linear).scaling == Linear(8.0)


def per_layer(**extra):
    return {"hidden_size": 2560, "num_attention_heads": 8, "head_dim": 256, "max_position_embeddings": 131072,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **extra}


def test_per_layer_type_rope_parameters():
    full = RopeConfig.from_hf(per_layer(), layer_type="full_attention")
    sliding = RopeConfig.from_hf(per_layer(), layer_type="sliding_attention")
    assert (full.base, full.scaling) == (1e6, Linear(8.0))
    assert (sliding.base, sliding.scaling) == (1e4, None)
    with pytest.raises(ValueError, match=r"per layer type \['full_attention', 'sliding_attention'\].*layer_type="):
        RopeConfig.from_hf(per_layer())
    with pytest.raises(ValueError, match=r"layer_type 'global' is not in rope_parameters"):
        RopeConfig.from_hf(per_layer(), layer_type="global")
    nope = per_layer(rope_parameters={"full_attention": None, "sliding_attention": {"rope_theta": 1e4}})
    with pytest.raises(ValueError, match=r"rope_parameters\['full_attention'\] is None"):
        RopeConfig.from_hf(nope, layer_type="full_attention")
    single = per_layer(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6}},
                       layer_types=None)
    assert RopeConfig.from_hf(single).base == 1e6
    # a flat dict applies to every declared layer type, but not to undeclared ones
    flat = {**LLAMA2, "layer_types": ["full_attention", "sliding_attention"]}
    assert RopeConfig.from_hf(flat, layer_type="sliding_attention") == RopeConfig.from_hf(flat)
    with pytest.raises(ValueError, match=r"layer_type 'chunked' is not in layer_types"):
        RopeConfig.from_hf(flat, layer_type="chunked")


def test_gemma3_before_v5_and_multimodal_text_config():
    text = {"hidden_size": 2560, "num_attention_heads": 8, "head_dim": 256, "max_position_embeddings": 131072,
            "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    cfg = {"model_type": "gemma3", "text_config": text}
    for layer_type in ("full_attention", "sliding_attention"):
        assert RopeConfig.from_hf(cfg, layer_type=layer_type) == RopeConfig.from_hf(per_layer(), layer_type=layer_type)
    with pytest.raises(ValueError, match=r"rope_local_base_freq=10000.0.*layer_type="):
        RopeConfig.from_hf(cfg)


def test_gemma4_global_head_dim_and_proportional():
    cfg = per_layer(global_head_dim=512, rope_parameters={
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    full = RopeConfig.from_hf(cfg, layer_type="full_attention")
    assert (full.head_dim, full.rotary_dim, full.scaling) == (512, 512, Proportional(0.25))
    assert RopeConfig.from_hf(cfg, layer_type="sliding_attention").head_dim == 256
    v5 = per_layer(per_layer_config={"5": {"head_dim": 512}}, rope_parameters=cfg["rope_parameters"])
    assert RopeConfig.from_hf(v5, layer_type="full_attention") == full


def test_layout_defaults_and_overrides():
    assert RopeConfig.from_hf(LLAMA2).layout == "half"
    assert RopeConfig.from_hf(LLAMA2, layout="interleaved").layout == "interleaved"
    assert RopeConfig.from_hf({**LLAMA2, "model_type": "deepseek_v2"}).layout == "interleaved"
    assert RopeConfig.from_hf({**LLAMA2, "model_type": "deepseek_v3", "rope_interleave": False}).layout == "half"
    assert RopeConfig.from_hf({**LLAMA2, "rope_interleave": True}).layout == "interleaved"
    with pytest.raises(ValueError, match="layout"):
        RopeConfig.from_hf(LLAMA2, layout="spiral")


def test_fixed_seq_len_freezes_length_dependent_rules_only():
    dynamic = {**LLAMA2, "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    assert RopeConfig.from_hf(dynamic, fixed_seq_len=16384).scaling == DynamicNTK(2.0, 4096, 16384)
    assert RopeConfig.from_hf(dynamic).scaling.dynamic
    llama3 = {**LLAMA2, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 2048}}
    assert RopeConfig.from_hf(llama3, fixed_seq_len=16384).scaling == Llama3(8.0, 1.0, 4.0, 2048)
    with pytest.raises(ValueError, match=r"fixed_seq_len must be a positive int, got 0"):
        RopeConfig.from_hf(llama3, fixed_seq_len=0)


@pytest.mark.parametrize(
    "cfg, words",
    [
        ({"num_attention_heads": 32}, ["head_dim", "hidden_size", "None"]),
        ({"hidden_size": 4000, "num_attention_heads": 24}, ["hidden_size", "4000", "24"]),
        ({**LLAMA2, "head_dim": -8}, ["head_dim", "-8"]),
        ({**LLAMA2, "partial_rotary_factor": 1.5}, ["partial_rotary_factor", "1.5"]),
        ({**LLAMA2, "partial_rotary_factor": 0.2}, ["partial_rotary_factor", "0.2", "rotary_dim=25"]),
        ({**LLAMA2, "rotary_pct": 0}, ["rotary_pct", "0"]),
        ({**LLAMA2, "rope_scaling": {"type": "ntk-by-parts", "factor": 2.0}}, ["type", "'ntk-by-parts'"]),
        ({**LLAMA2, "rope_scaling": {"type": "linear", "factor": 0.5}}, ["factor", "0.5"]),
        ({**LLAMA2, "rope_scaling": {"type": "linear"}}, ["'factor'"]),
        ({**LLAMA2, "rope_scaling": {"type": "linear", "factor": 2.0, "low_freq_factor": 1}},
         ["'low_freq_factor'=1"]),
        ({**LLAMA2, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3}},
         ["3 entries", "64"]),
        ({**LLAMA2, "rope_scaling": "yarn"}, ["rope_scaling", "'yarn'"]),
        ({**LLAMA2, "rope_scaling": {"factor": 2.0}}, ["'default'", "'factor'=2.0"]),  # a factor but no type
    ],
)
def test_from_hf_errors_name_the_key_and_value(cfg, words):
    with pytest.raises(ValueError) as info:
        RopeConfig.from_hf(cfg)
    for word in words:
        assert word in str(info.value)


def test_from_hf_rejects_other_objects():
    with pytest.raises(TypeError, match="config.json dict or a transformers config, got int"):
        RopeConfig.from_hf(3)


def test_default_type_is_plain_rope():
    for params in ({"rope_type": "default"}, None, {}):
        rope = RopeConfig.from_hf({**LLAMA2, "rope_scaling": params})
        assert rope.scaling is None and rope.axes is None


def test_mrope_keys_on_a_model_without_a_known_axis_map_raise_instead_of_becoming_1d():
    # this used to be read as plain 1-D RoPE without a word (tests/test_config_multiaxis.py has the rest)
    for params in ({"type": "mrope", "mrope_section": [16, 24, 24]},
                   {"rope_type": "default", "mrope_section": [16, 24, 24]}):
        with pytest.raises(ValueError, match="model_type 'llama' has multi-axis RoPE"):
            RopeConfig.from_hf({**LLAMA2, "rope_scaling": params})


# -- RotaryEmbedding ----------------------------------------------------------------------------


def test_rotary_embedding_from_config_and_from_hf():
    cfg = {**LLAMA2, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}
    rope = RopeConfig.from_hf(cfg, layout="interleaved")
    module = RotaryEmbedding.from_config(rope)
    assert (module.head_dim, module.rotary_dim, module.base, module.layout, module.scaling) == (
        128, 128, 10000.0, "interleaved", YaRN(4.0, 1024))
    assert module.attention_scale == rope.inv_frequencies()[1] > 1
    same = RotaryEmbedding.from_hf(cfg, layout="interleaved")
    torch.testing.assert_close(same.inv_freq, module.inv_freq, rtol=0, atol=0)
    # the attention scale is folded into both tables
    cos, sin = module.cos_sin(torch.arange(5))
    angles = torch.arange(5, dtype=torch.float64)[:, None] * rope.inv_frequencies()[0]
    scale = rope.inv_frequencies()[1]
    torch.testing.assert_close(cos, (scale * angles.cos()).float())
    torch.testing.assert_close(sin, (scale * angles.sin()).float())


def test_dynamic_ntk_kv_cache_consistency():
    """Per-length frequencies make cached keys disagree with later queries; fixed_seq_len does not."""
    cfg = {"hidden_size": 64, "num_attention_heads": 2, "max_position_embeddings": 16,
           "rope_scaling": {"type": "dynamic", "factor": 4.0}}
    torch.manual_seed(0)
    q = torch.randn(1, 1, 48, 32, dtype=torch.float64)
    k = torch.randn(1, 1, 48, 32, dtype=torch.float64)

    def logits(module, prefill):
        """Decode: keys rotated at the step that produced them, the last query at the end."""
        keys = [module.rotate_one(k[:, :, :prefill].float())]
        for step in range(prefill, 48):
            keys.append(module.rotate_one(k[:, :, step:step + 1].float(), offset=step))
        query = module.rotate_one(q[:, :, -1:].float(), offset=47)
        return (query @ torch.cat(keys, dim=2).transpose(-1, -2)).squeeze()

    def full(module):
        """Everything rotated at the final length: what the model would see without a cache."""
        query, keys = module(q.float(), k.float())
        return (query[:, :, -1:] @ keys.transpose(-1, -2)).squeeze()

    recomputing = RotaryEmbedding.from_hf(cfg)
    assert recomputing.scaling.dynamic
    assert not torch.allclose(logits(recomputing, 20), full(RotaryEmbedding.from_hf(cfg)), atol=1e-3)

    consistent = RotaryEmbedding.from_hf(cfg, fixed_seq_len=48)
    assert not consistent.scaling.dynamic
    torch.testing.assert_close(logits(consistent, 20), full(RotaryEmbedding.from_hf(cfg, fixed_seq_len=48)))
    # and it is exactly the dynamic rule at the final length
    final = dataclasses.replace(recomputing.scaling, fixed_seq_len=None).compute(32, 10000.0, 48)[0]
    torch.testing.assert_close(consistent.inv_freq, final, rtol=0, atol=0)
