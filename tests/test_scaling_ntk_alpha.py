"""HunYuan's NTK-alpha (``ntk_alpha``) against transformers' own HunYuan code, and the patched HunYuan model.

Oracles: ``HunYuanDenseV1RotaryEmbedding.compute_ntk_alpha_rope_parameters`` run with float32 mapped
to float64 (the formula, to 1e-12) and as shipped (float32, to a relative 2e-6); the module's own
cos/sin tables; ropekit's float64 rotation matrices; a tiny random-weight ``HunYuanDenseV1ForCausalLM``
run patched and unpatched (logits to 1e-5, the same greedy tokens, ``unpatch`` bit for bit).
"""

import json
import types
from pathlib import Path

import pytest
import torch

import ropekit
from ropekit import RopeConfig
from ropekit.config.rules import rule_from_dict
from ropekit.integrations.transformers import patch, unpatch
from ropekit.rope.frequencies import base_inv_freq
from ropekit.scaling import NTK, DynamicNTK, NTKAlpha

transformers = pytest.importorskip("transformers")
hunyuan = pytest.importorskip("transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense")
transformers.logging.set_verbosity_error()

PUBLISHED = json.loads((Path(__file__).parent / "fixtures" / "configs" / "hunyuan-7b-instruct.json").read_text())
HUNYUAN_SCALING = PUBLISHED["rope_scaling"]  # {"type": "dynamic", "alpha": 1000.0, "factor": 1.0, "beta_fast": 32, ...}


class _Float64Torch(types.ModuleType):
    """``torch`` with ``float`` / ``float32`` meaning float64, for running reference code exactly."""

    def __getattr__(self, name):
        return torch.float64 if name in ("float", "float32") else getattr(torch, name)


def hf_config(head_dim=128, base=10000.0, alpha=1000.0, **extra):
    scaling = {**HUNYUAN_SCALING, "alpha": alpha}
    return transformers.HunYuanDenseV1Config(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=head_dim, rope_theta=base, rope_scaling=scaling, **extra)


@pytest.mark.parametrize("head_dim, base, alpha", [(128, 10000.0, 1000.0), (64, 10000.0, 50.0),
                                                    (256, 1e6, 8.0), (16, 500.0, 1.0), (4, 10000.0, 3.0)])
def test_frequencies_are_transformers_hunyuan_formula(monkeypatch, head_dim, base, alpha):
    config = hf_config(head_dim, base, alpha)
    rope = RopeConfig.from_hf(config)
    assert rope.scaling == NTKAlpha(alpha) and rope.rotary_dim == head_dim and not rope.scaling.dynamic
    inv_freq, scale = rope.inv_frequencies()
    shipped, shipped_scale = hunyuan.HunYuanDenseV1RotaryEmbedding.compute_ntk_alpha_rope_parameters(config)
    torch.testing.assert_close(inv_freq, shipped.double(), rtol=2e-6, atol=0)
    assert scale == shipped_scale == 1.0
    monkeypatch.setattr(hunyuan, "torch", _Float64Torch("torch"))
    exact, _ = hunyuan.HunYuanDenseV1RotaryEmbedding.compute_ntk_alpha_rope_parameters(config)
    assert exact.dtype == torch.float64
    torch.testing.assert_close(inv_freq, exact, rtol=1e-12, atol=0)


def test_the_lowest_frequency_is_divided_by_alpha_and_the_highest_kept():
    # the property that defines the exponent d / (d - 2), checked against the unscaled ladder
    for d, alpha in [(128, 1000.0), (64, 7.5), (6, 2.0)]:
        inv_freq, _ = NTKAlpha(alpha).compute(d, 10000.0)
        plain = base_inv_freq(d, 10000.0)
        assert inv_freq[0] == plain[0] == 1.0
        torch.testing.assert_close(inv_freq[-1], plain[-1] / alpha, rtol=1e-12, atol=0)
        assert bool((inv_freq <= plain).all())
    assert torch.equal(NTKAlpha(9.0).compute(2, 10000.0)[0], base_inv_freq(2, 10000.0))  # d = 2: one pair, unchanged


def test_tables_equal_the_hunyuan_rotary_module_and_the_float64_rotation():
    config = transformers.HunYuanDenseV1Config(**{k: v for k, v in PUBLISHED.items() if k[0] != "_"
                                                  and k != "model_type"})
    rotary = hunyuan.HunYuanDenseV1RotaryEmbedding(config)
    assert rotary.rope_type == "ntk_alpha"
    module = ropekit.RotaryEmbedding.from_hf(PUBLISHED)
    positions = torch.arange(64)
    cos, sin = module.cos_sin(positions)
    hf_cos, hf_sin = rotary(torch.zeros(1), positions[None])
    torch.testing.assert_close(cos, hf_cos[0, :, :64], rtol=0, atol=2e-5)  # their float32 angles: ulps of 64 rad
    torch.testing.assert_close(sin, hf_sin[0, :, :64], rtol=0, atol=2e-5)
    # ropekit's tables rotate exactly as the float64 rotation matrix of the rule's frequencies does
    q = torch.randn(1, 1, 64, 128, dtype=torch.float64)
    rotated = ropekit.apply_rotary(q, cos.double(), sin.double(), layout="half")
    inv_freq = NTKAlpha(1000.0).compute(128, 10000.0)[0]
    for m in (0, 1, 17, 63):
        matrix = ropekit.rotation_matrix(m, inv_freq)  # interleaved pairs (2i, 2i+1)
        order = torch.arange(128).view(2, 64).T.reshape(-1)  # half layout -> interleaved
        expected = (matrix @ q[0, 0, m, order])[torch.argsort(order)]
        torch.testing.assert_close(rotated[0, 0, m], expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("params", [
    HUNYUAN_SCALING,
    {"type": "dynamic", "alpha": 1000.0, "factor": 1.0},  # the form of HunYuan-A13B and the MoE tests
    {"rope_type": "dynamic", "alpha": 1000.0, "factor": 2.0},  # factor is read and ignored, as transformers does
    {"rope_type": "ntk_alpha", "alpha": 1000.0},
])
def test_every_form_of_the_rule_reads_alpha(params):
    assert rule_from_dict(params, max_position_embeddings=4096) == NTKAlpha(1000.0)
    inv_freq, _ = ropekit.inv_frequencies(128, 10000.0, params)
    torch.testing.assert_close(inv_freq, NTK(1000.0).compute(128, 10000.0)[0], rtol=0, atol=0)


def test_dynamic_without_alpha_is_still_dynamic_ntk():
    assert rule_from_dict({"type": "dynamic", "factor": 2.0}, max_position_embeddings=4096) == DynamicNTK(2.0, 4096)


@pytest.mark.parametrize("params, words", [
    ({"rope_type": "ntk_alpha", "alpha": 0.5}, ["NTKAlpha", "alpha", "0.5"]),
    ({"rope_type": "ntk_alpha", "alpha": "1000"}, ["alpha", "'1000'"]),
    ({"rope_type": "ntk_alpha"}, ["ntk_alpha", "'alpha'"]),
    ({"type": "dynamic", "alpha": 1000.0, "original_max_position_embeddings": 4096},
     ["ntk_alpha", "'original_max_position_embeddings'"]),
])
def test_bad_alpha_dicts_raise_naming_the_key(params, words):
    with pytest.raises(ValueError) as info:
        rule_from_dict(params, max_position_embeddings=4096)
    for word in words:
        assert word in str(info.value)


def tiny_hunyuan(seed=0):
    torch.manual_seed(seed)
    config = transformers.HunYuanDenseV1Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=10000.0,
        rope_scaling={**HUNYUAN_SCALING, "alpha": 50.0})
    return transformers.HunYuanDenseV1ForCausalLM(config).eval()


def test_patched_hunyuan_matches_transformers_and_unpatches_bit_for_bit():
    model = tiny_hunyuan()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
        expected_tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
    patch(model)
    assert model._ropekit_patch["rope"].scaling == NTKAlpha(50.0)  # static: no fixed_seq_len needed for the cache
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    assert torch.equal(tokens, expected_tokens)
    unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)


def test_plain_rope_instead_of_the_alpha_changes_the_logits():
    # negative control: the patch test above would notice a rope without HunYuan's alpha
    model = tiny_hunyuan()
    ids = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids).logits
    patch(model, rope=RopeConfig(16, base=10000.0))
    with torch.no_grad():
        assert (model(ids).logits - expected).abs().max() > 1e-3
    unpatch(model)
