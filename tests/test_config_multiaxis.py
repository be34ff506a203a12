"""RopeConfig.from_hf on multi-axis configs: every form of the Qwen-VL families, diffusers configs, and refusals.

A config whose RoPE ropekit cannot represent raises (naming the model type and the keys); it is never
read as 1-D RoPE. The numbers are checked against transformers' modules in tests/test_qwen_vl.py and
against diffusers in tests/test_peer_diffusers.py; here: which plan each form gives, and the errors.
"""

import copy
import json
from pathlib import Path

import pytest
import torch

from ropekit import AxisPlan, RopeConfig, RotaryEmbedding
from ropekit.multiaxis import axial, mrope, named_plan, single_axis
from ropekit.nn import MultiAxisRotaryEmbedding
from ropekit.scaling import YaRN

FIXTURES = Path(__file__).parent / "fixtures" / "multiaxis"


def load(name):
    return json.loads((FIXTURES / f"{name}.json").read_text())


QWEN2 = load("qwen2-vl-7b-instruct")
QWEN3 = load("qwen3-vl-8b-instruct")


def contiguous(counts):
    return [a for a, n in enumerate(counts) for _ in range(n)]


@pytest.mark.parametrize(
    "cfg",
    [
        QWEN2,  # 4.x flat: rope_scaling {"type": "mrope", "mrope_section": ...}, rope_theta at the top
        {**QWEN2, "rope_scaling": {"type": "default", "rope_type": "default", "mrope_section": [16, 24, 24]}},
        {**QWEN2, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24],
                                                            "rope_theta": 1e6}},
        {**QWEN2, "rope_scaling": None},  # silent config: the modeling code's default section
        {"model_type": "qwen2_vl", "text_config": {  # a transformers 5 save: nested, type and rope_type both
            "model_type": "qwen2_vl_text", "hidden_size": 3584, "num_attention_heads": 28,
            "rope_parameters": {"type": "mrope", "rope_type": "default", "mrope_section": [16, 24, 24],
                                "rope_theta": 1e6}}},
        {"model_type": "qwen2_5_vl_text", "hidden_size": 3584, "num_attention_heads": 28, "rope_theta": 1e6},
    ],
    ids=["v4-flat", "type-default", "rope-parameters", "no-section", "v5-nested", "text-config-alone"],
)
def test_qwen2_vl_forms_give_contiguous_sections(cfg):
    rope = RopeConfig.from_hf(cfg)
    assert (rope.head_dim, rope.rotary_dim, rope.base, rope.layout, rope.scaling) == (128, 128, 1e6, "half", None)
    assert rope.axes.axis.tolist() == contiguous((16, 24, 24)) and rope.is_multi_axis
    torch.testing.assert_close(rope.axes.inv_freq, 1e6 ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128))


@pytest.mark.parametrize("where", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("flag", [True, None])
def test_qwen3_vl_interleaves_by_model_type(where, flag):
    cfg = copy.deepcopy(QWEN3)
    params = cfg["text_config"].pop("rope_scaling")
    if flag is None:
        del params["mrope_interleaved"]  # transformers interleaves Qwen3-VL without the flag too
    cfg["text_config"][where] = params
    rope = RopeConfig.from_hf(cfg)
    axis = rope.axes.axis.tolist()
    assert axis[:6] == [0, 1, 2, 0, 1, 2] and axis[60:] == [0, 0, 0, 0] and rope.axes.counts == (24, 20, 20)
    assert rope.base == 5e6 and rope.max_positions == 262144


def test_yarn_and_mrope_keep_both():
    cfg = {**QWEN2, "max_position_embeddings": 128000,
           "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                            "mrope_section": [16, 24, 24]}}
    rope = RopeConfig.from_hf(cfg)
    inv_freq, scale = rope.inv_frequencies()
    assert rope.scaling == YaRN(4.0, 32768) and scale > 1.1
    plan = rope.axis_plan()
    assert torch.equal(plan.inv_freq, inv_freq) and plan.attention_scale == scale and plan.counts == (16, 24, 24)


@pytest.mark.parametrize(
    "cfg, words",
    [
        ({**QWEN2, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 20]}},
         ["mrope_section [16, 24, 20]", "60 pairs", "64 pairs"]),
        ({**QWEN2, "rope_scaling": {"type": "mrope", "mrope_section": [16, 48]}}, ["mrope_section", "3 ints"]),
        ({**QWEN2, "rope_scaling": {"type": "mrope", "mrope_section": "16,24,24"}}, ["mrope_section", "'16,24,24'"]),
        ({**QWEN2, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24], "mrope_interleaved": True}},
         ["mrope_interleaved=True", "'qwen2_vl'", "contiguous"]),
        ({**QWEN3, "text_config": {**QWEN3["text_config"], "rope_scaling": {
            "mrope_interleaved": False, "mrope_section": [24, 20, 20], "rope_type": "default"}}},
         ["mrope_interleaved=False", "'qwen3_vl_text'", "interleaves"]),
        ({**QWEN2, "model_type": "hunyuan_vl"}, ["'hunyuan_vl'", "splits the two channels of a rotary pair"]),
        ({**QWEN2, "model_type": "glm4v", "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]}},
         ["mrope_section [8, 12, 12]", "32 pairs", "64 pairs"]),
        ({**QWEN2, "model_type": "ernie4_5_vl_moe", "rope_scaling": {"type": "mrope", "mrope_section": [24, 20, 20]}},
         ["ERNIE-4.5-VL", "h == w", "(24, 20, 20)"]),
        ({"model_type": "ernie4_5_moe_vl", "hidden_size": 2560, "num_attention_heads": 20, "rope_theta": 500000,
          "rope_3d": True, "freq_allocation": 20}, ["'ernie4_5_moe_vl'", "remote-code", "'ernie4_5_vl_moe'"]),
        ({**QWEN2, "model_type": "qwen3_5", "rope_scaling": {"rope_type": "default", "mrope_interleaved": True,
                                                             "mrope_section": [11, 11, 10]}},
         ["'qwen3_5'", "cannot represent", "Supported"]),
        ({**QWEN2, "model_type": "llama"}, ["'llama'", "mrope_section=[16, 24, 24]"]),
    ],
)
def test_configs_ropekit_cannot_represent_raise(cfg, words):
    with pytest.raises(ValueError) as info:
        RopeConfig.from_hf(cfg)
    for word in words:
        assert word in str(info.value)


DIFFUSERS = {
    "flux.1-dev": (128, 10000.0, ("index", "h", "w"), (8, 28, 28), named_plan("flux")),
    "hunyuanvideo": (128, 256.0, ("t", "h", "w"), (8, 28, 28), named_plan("hunyuan-video")),
    "wan2.1-t2v-1.3b": (128, 10000.0, ("t", "h", "w"), (22, 21, 21), named_plan("wan", head_dim=128)),
    "cogvideox-5b": (64, 10000.0, ("t", "h", "w"), (8, 12, 12), named_plan("cogvideox", head_dim=64)),
}


@pytest.mark.parametrize("name", sorted(DIFFUSERS))
def test_diffusers_transformer_configs_are_axial_and_interleaved(name):
    head_dim, base, names, counts, plan = DIFFUSERS[name]
    rope = RopeConfig.from_hf(load(name))
    assert (rope.head_dim, rope.base, rope.layout, rope.scaling) == (head_dim, base, "interleaved", None)
    assert rope.axes == plan and plan.axis_names == names and plan.counts == counts
    assert torch.equal(rope.inv_frequencies()[0], plan.inv_freq)
    assert RopeConfig.from_hf(load(name), layout="half").layout == "half"


@pytest.mark.parametrize(
    "cfg, words",
    [
        ({**load("cogvideox-5b"), "use_rotary_positional_embeddings": False}, ["not RoPE"]),
        ({"_class_name": "SD3Transformer2DModel"}, ["'SD3Transformer2DModel'", "FluxTransformer2DModel"]),
        ({**load("flux.1-dev"), "axes_dims_rope": [16, 56, 48]}, ["120 channels", "128"]),
        ({**load("flux.1-dev"), "axes_dims_rope": [15, 57, 56]}, ["axes_dims[0]", "even"]),
        ({**load("cogvideox-5b"), "attention_head_dim": 72}, ["multiple of 16", "72"]),
        ({**load("hunyuanvideo"), "rope_theta": -1}, ["rope_theta", "-1"]),
    ],
)
def test_diffusers_config_errors(cfg, words):
    with pytest.raises(ValueError) as info:
        RopeConfig.from_hf(cfg)
    for word in words:
        assert word in str(info.value)


def test_ropeconfig_checks_its_axes():
    plan = mrope(torch.ones(4), [2, 1, 1])
    with pytest.raises(ValueError, match="axes has 4 pairs but rotary_dim=16 has 8"):
        RopeConfig(16, axes=plan)
    with pytest.raises(TypeError, match="axes must be None or a ropekit.AxisPlan, got list"):
        RopeConfig(8, axes=[0, 1, 2, 0])
    with pytest.raises(ValueError, match="scaling rule's frequencies"):
        RopeConfig(8, scaling=YaRN(4.0, 1024), axes=plan)
    rope = RopeConfig(8, axes=plan)
    assert rope.axis_plan() is plan and rope == RopeConfig(8, axes=mrope(torch.ones(4), [2, 1, 1]))
    assert hash(rope) == hash(RopeConfig(8, axes=mrope(torch.ones(4), [2, 1, 1])))


def test_a_1d_config_has_a_one_axis_plan():
    rope = RopeConfig(64, base=500000.0)
    assert rope.axis_plan() == single_axis(rope.inv_frequencies()[0]) and not rope.is_multi_axis


def test_modules_from_a_multi_axis_config():
    with pytest.raises(ValueError, match="MultiAxisRotaryEmbedding"):
        RotaryEmbedding.from_hf(QWEN2)
    module = MultiAxisRotaryEmbedding.from_hf(load("flux.1-dev"))
    assert module.layout == "interleaved" and module.plan == named_plan("flux") and module.head_dim == 128
    assert MultiAxisRotaryEmbedding.from_hf(QWEN2).plan.counts == (16, 24, 24)
    assert isinstance(axial((4, 4)), AxisPlan)
