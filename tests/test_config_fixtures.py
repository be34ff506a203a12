"""Published model configs (tests/fixtures/configs/*.json) against the models' own transformers rotary modules.

For every fixture and layer type, ``RopeConfig.from_hf`` of the JSON dict and of the transformers
config object must agree with each other and with the inv_freq buffer and ``attention_scaling``
of the model's ``*RotaryEmbedding`` (after a forward at each probe length, so dynamic NTK and
LongRoPE are checked on both sides of their switch): inv_freq to a relative 2e-6 (transformers
computes in float32), the attention scale to 1e-6. ``RotaryEmbedding.from_hf`` must produce the
same cos/sin tables, attention scale included, as the model's forward.
"""

import copy
import importlib
import json
from pathlib import Path

import pytest
import torch

from ropekit import RopeConfig, RotaryEmbedding
from ropekit.scaling import DynamicNTK, Linear, Llama3, LongRoPE, NTKAlpha, Proportional, YaRN

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
torch.set_num_threads(1)

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
ROTARY_CLASSES = {
    "llama": ("llama", "LlamaRotaryEmbedding"),
    "mistral": ("mistral", "MistralRotaryEmbedding"),
    "qwen2": ("qwen2", "Qwen2RotaryEmbedding"),
    "phi3": ("phi3", "Phi3RotaryEmbedding"),
    "deepseek_v2": ("deepseek_v2", "DeepseekV2RotaryEmbedding"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3RotaryEmbedding"),
    "gpt_neox": ("gpt_neox", "GPTNeoXRotaryEmbedding"),
    "gpt_oss": ("gpt_oss", "GptOssRotaryEmbedding"),
    "gemma3_text": ("gemma3", "Gemma3RotaryEmbedding"),
    "gemma4_text": ("gemma4", "Gemma4TextRotaryEmbedding"),
    "llama4_text": ("llama4", "Llama4TextRotaryEmbedding"),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", "HunYuanDenseV1RotaryEmbedding"),
}
# (head_dim, rotary_dim, layout, rule) per fixture and layer type: what a reader of the config expects
EXPECTED = {
    ("codellama-7b", None): (128, 128, "half", type(None)),
    ("deepseek-v2-lite", None): (64, 64, "interleaved", YaRN),
    ("deepseek-v3", None): (64, 64, "interleaved", YaRN),
    ("gemma-3-4b-legacy", "full_attention"): (256, 256, "half", Linear),
    ("gemma-3-4b-legacy", "sliding_attention"): (256, 256, "half", type(None)),
    ("gemma-3-4b-text", "full_attention"): (256, 256, "half", Linear),
    ("gemma-3-4b-text", "sliding_attention"): (256, 256, "half", type(None)),
    ("gemma-4-style-proportional", "full_attention"): (512, 512, "half", Proportional),
    ("gemma-4-style-proportional", "sliding_attention"): (256, 256, "half", type(None)),
    ("gpt-neox-20b", None): (96, 24, "half", type(None)),
    ("gpt-oss-20b", None): (64, 64, "half", YaRN),
    ("hunyuan-7b-instruct", None): (128, 128, "half", NTKAlpha),
    ("llama-2-7b", None): (128, 128, "half", type(None)),
    ("llama-2-7b-dynamic-ntk", None): (128, 128, "half", DynamicNTK),
    ("llama-3.1-8b", None): (128, 128, "half", Llama3),
    ("llama-3.2-1b", None): (64, 64, "half", Llama3),
    ("llama-4-scout", None): (128, 128, "interleaved", Llama3),
    ("mistral-7b-v0.1", None): (128, 128, "half", type(None)),
    ("phi-3-mini-128k-instruct", None): (96, 96, "half", LongRoPE),
    ("phi-3.5-mini-instruct", None): (96, 96, "half", LongRoPE),
    ("qwen2.5-7b-instruct-yarn", None): (128, 128, "half", YaRN),
}


def load(name):
    return json.loads((FIXTURES / f"{name}.json").read_text())


def hf_config(cfg):
    text = cfg.get("text_config", cfg)
    kwargs = {key: value for key, value in copy.deepcopy(text).items() if key != "model_type" and key[0] != "_"}
    rope = kwargs.get("rope_scaling") or {}
    if rope.get("type") == "su":
        # transformers 5.x renames "su" to "longrope" only after moving original_max_position_embeddings
        # into the rope dict (which it does for "longrope" alone), then fails validation: feed it the new name
        kwargs["rope_scaling"] = {**rope, "type": "longrope"}
    return transformers.AutoConfig.for_model(text["model_type"], **kwargs)


def hf_rotary(config):
    module_name, class_name = ROTARY_CLASSES[config.model_type]
    module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    return getattr(module, class_name)(config)


def hf_state(rotary, layer_type, seq_len):
    """(inv_freq, attention_scale, cos, sin) of the transformers module after a forward at ``seq_len``."""
    positions = torch.arange(seq_len - 1, seq_len)[None] if seq_len else torch.arange(64)[None]
    x = torch.zeros(1, dtype=torch.float32)
    out = rotary(x, positions) if layer_type is None else rotary(x, positions, layer_type)
    prefix = "" if layer_type is None else f"{layer_type}_"
    inv_freq = getattr(rotary, f"{prefix}inv_freq")
    scale = getattr(rotary, f"{prefix}attention_scaling", None) if layer_type else rotary.attention_scaling
    return inv_freq, scale, out


CASES = sorted(EXPECTED, key=lambda case: (case[0], case[1] or ""))


def test_every_fixture_and_layer_type_is_covered():
    found = set()
    for path in FIXTURES.glob("*.json"):
        rotary = hf_rotary(hf_config(load(path.stem)))
        layer_types = sorted(rotary.rope_type) if isinstance(rotary.rope_type, dict) else [None]
        found.update((path.stem, layer_type) for layer_type in layer_types)
    assert found == set(EXPECTED)


def probe_lengths(rope):
    rule = rope.scaling
    if isinstance(rule, DynamicNTK):
        length = rule.original_max_position_embeddings
        return [None, length, length + 1, 4 * length]
    if isinstance(rule, LongRoPE):
        length = rule.original_max_position_embeddings
        return [None, length, length + 1, 2 * length]
    return [None]


@pytest.mark.parametrize("name, layer_type", CASES, ids=[f"{n}-{t}" for n, t in CASES])
def test_fixture_matches_the_models_rotary_module(name, layer_type):
    cfg = load(name)
    config = hf_config(cfg)
    rope = RopeConfig.from_hf(cfg, layer_type=layer_type)
    assert RopeConfig.from_hf(config, layer_type=layer_type) == rope
    head_dim, rotary_dim, layout, rule = EXPECTED[name, layer_type]
    assert (rope.head_dim, rope.rotary_dim, rope.layout, type(rope.scaling)) == (head_dim, rotary_dim, layout, rule)
    rotary = hf_rotary(config)
    for seq_len in probe_lengths(rope):
        expected, expected_scale, _ = hf_state(rotary, layer_type, seq_len)
        inv_freq, scale = rope.inv_frequencies(seq_len)
        torch.testing.assert_close(inv_freq, expected.double(), rtol=2e-6, atol=0.0, msg=f"seq_len={seq_len}")
        assert scale == pytest.approx(expected_scale, rel=1e-6, abs=0.0)


def half_tables(out, rotary_dim):
    """transformers' (cos, sin) as half-width tables: one entry per rotary pair."""
    if torch.is_tensor(out) and out.is_complex():  # DeepSeek-V2, Llama 4: complex freqs_cis, scale folded in
        return out.real[0], out.imag[0]
    cos, sin = out
    return cos[0, :, : rotary_dim // 2], sin[0, :, : rotary_dim // 2]


@pytest.mark.parametrize("name, layer_type", CASES, ids=[f"{n}-{t}" for n, t in CASES])
def test_rotary_embedding_from_hf_tables_match_the_model(name, layer_type):
    cfg = load(name)
    module = RotaryEmbedding.from_hf(cfg, layer_type=layer_type)
    assert RotaryEmbedding.from_hf(hf_config(cfg), layer_type=layer_type).inv_freq.equal(module.inv_freq)
    rotary = hf_rotary(hf_config(cfg))
    _, expected_scale, out = hf_state(rotary, layer_type, None)
    expected_cos, expected_sin = half_tables(out, module.rotary_dim)
    cos, sin = module.cos_sin(torch.arange(64))
    # float32 angles position * inv_freq on their side: a few ulp of 64 rad
    torch.testing.assert_close(cos, expected_cos.float(), rtol=0, atol=2e-5)
    torch.testing.assert_close(sin, expected_sin.float(), rtol=0, atol=2e-5)
    assert module.attention_scale == pytest.approx(expected_scale, rel=1e-6)
    for seq_len in probe_lengths(RopeConfig.from_hf(cfg, layer_type=layer_type))[1:]:
        expected, expected_scale, _ = hf_state(rotary, layer_type, seq_len)
        module.cos_sin(torch.tensor([seq_len - 1]))  # the module switches / rescales like the model
        torch.testing.assert_close(module.inv_freq, expected.double(), rtol=2e-6, atol=0.0)
        assert module.attention_scale == pytest.approx(expected_scale, rel=1e-6)


def test_deepseek_v2_lite_attention_factor_is_one_and_v3_likewise():
    # mscale == mscale_all_dim: the cos/sin factor cancels; DeepSeek folds mscale(40, 0.707)^2 into the
    # softmax scale instead, which is the attention module's business, not the rotary embedding's
    for name in ("deepseek-v2-lite", "deepseek-v3"):
        assert RopeConfig.from_hf(load(name)).inv_frequencies()[1] == 1.0
