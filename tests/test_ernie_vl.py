"""ERNIE-4.5-VL against transformers: the text rotary module, get_rope_index, the patched language model.

Oracles: transformers' ``Ernie4_5_VLMoeTextRotaryEmbedding`` (built from the config in
tests/fixtures/multiaxis: transformers' defaults, the 28B-A3B's), ``Ernie4_5_VLMoeModel.get_rope_index``
on random left-padded text + image + video batches, and a tiny random-weight
``Ernie4_5_VLMoeForConditionalGeneration`` (4 experts; tests/multimodal_models.py) run patched and unpatched.
"""

import copy
import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe import (  # noqa: E402
    Ernie4_5_VLMoeTextRotaryEmbedding,
)

import multimodal_models as mm  # noqa: E402
from ropekit import RopeConfig  # noqa: E402
from ropekit.integrations.transformers import patch, unpatch  # noqa: E402
from ropekit.multiaxis import LAYOUTS, mrope, mrope_position_ids, named_plan  # noqa: E402
from ropekit.rope.plans import hw_alternating_mrope  # noqa: E402

RAW = json.loads((Path(__file__).parent / "fixtures" / "multiaxis" / "ernie-4.5-vl-28b-a3b.json").read_text())


def published():
    kwargs = {k: v for k, v in copy.deepcopy(RAW).items() if k[0] != "_" and k != "model_type"}
    return transformers.AutoConfig.for_model("ernie4_5_vl_moe", **kwargs)


# -- the text rotary module -------------------------------------------------------------------------
def test_published_config_reads_as_h_w_alternating_then_t():
    hf = published()
    rope = RopeConfig.from_hf(RAW)
    assert rope == RopeConfig.from_hf(hf) == RopeConfig.from_hf(hf.to_dict()) == RopeConfig.from_hf(hf.text_config)
    assert (rope.head_dim, rope.rotary_dim, rope.base, rope.layout) == (128, 128, 500000.0, "interleaved")
    plan = rope.axis_plan()
    assert plan.axis.tolist() == [1, 2] * 22 + [0] * 20 and plan.counts == (20, 22, 22)
    assert plan == named_plan("ernie4.5-vl") and LAYOUTS["ernie4.5-vl"] == "interleaved"
    silent = {**RAW, "text_config": {**RAW["text_config"], "rope_parameters": {"rope_theta": 500000.0}}}
    assert RopeConfig.from_hf(silent).axis_plan() == plan  # the modeling code's default section [22, 22, 20]


def test_the_axis_map_is_the_ernie_rotary_modules_bit_for_bit():
    rotary = Ernie4_5_VLMoeTextRotaryEmbedding(published().text_config)
    plan = RopeConfig.from_hf(RAW).axis_plan()
    positions = torch.randint(0, 5000, (3, 2, 9))
    cos, sin = rotary(torch.zeros(1), positions)  # (batch, seq, head_dim): each pair's value twice, (2i, 2i+1)
    assert cos.shape == (2, 9, 128) and torch.equal(sin[..., 0::2], sin[..., 1::2])
    # transformers' float32 recipe over the natural ladder with ropekit's axis map: its tables exactly (the
    # module permutes its ladder and un-permutes it when it recomposes; the two steps cancel)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float) / 128))
    angles = positions.permute(1, 2, 0).float()[..., plan.axis] * inv_freq
    assert torch.equal(cos[..., 0::2], angles.cos()) and torch.equal(sin[..., 0::2], angles.sin())
    small = positions % 64
    ours_cos, ours_sin = plan.cos_sin(small.permute(1, 2, 0))
    hf_cos, hf_sin = rotary(torch.zeros(1), small)
    torch.testing.assert_close(ours_cos, hf_cos[..., 0::2], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours_sin, hf_sin[..., 0::2], rtol=0, atol=1e-5)


@pytest.mark.parametrize("section", [(22, 22, 20), (3, 3, 2), (0, 0, 8), (1, 1, 6)])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_one_axis_moves_only_its_own_pairs(section, axis):
    pairs = sum(section)
    config = transformers.Ernie4_5_VLMoeTextConfig(hidden_size=2 * pairs * 4, num_attention_heads=4,
                                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                    "mrope_section": list(section)})
    rotary = Ernie4_5_VLMoeTextRotaryEmbedding(config)
    plan = RopeConfig.from_hf(config).axis_plan()
    positions = torch.zeros(3, 1, 5, dtype=torch.long)
    positions[axis] = torch.arange(1, 6)
    _, sin = rotary(torch.zeros(1), positions)
    assert (sin[0, :, 0::2] != 0).any(0).tolist() == (plan.axis == axis).tolist()


@pytest.mark.parametrize("section, words", [
    ((22, 20, 22), ["h == w", "(22, 20, 22)"]),
    ((22, 22, 22), ["adding up to the 64 pairs"]),
    ((22, 22), ["three ints"]),
    ((22, -1, 43), ["three ints"]),
])
def test_sections_transformers_cannot_recompose_raise(section, words):
    with pytest.raises(ValueError) as info:
        hw_alternating_mrope(torch.ones(64, dtype=torch.float64), section)
    for word in words:
        assert word in str(info.value)


# -- positions: get_rope_index -----------------------------------------------------------------------
@pytest.mark.parametrize("temporal_merge_size", [2, 3])
def test_mrope_position_ids_equal_ernie_get_rope_index_on_random_padded_batches(temporal_merge_size):
    rng = random.Random(temporal_merge_size)
    get_rope_index = mm.rope_index("ernie", temporal_merge_size=temporal_merge_size)
    for _ in range(25):
        input_ids, mask, images, videos = mm.random_batch(rng, "ernie", temporal_merge=temporal_merge_size)
        grids = dict(image_grid_thw=torch.tensor(images) if images else None,
                     video_grid_thw=torch.tensor(videos) if videos else None)
        types = mm.token_types(input_ids)
        expected, expected_deltas = get_rope_index(input_ids=input_ids, mm_token_type_ids=types, attention_mask=mask,
                                                   **grids)
        positions, deltas = mrope_position_ids(types, **grids, attention_mask=mask, spatial_merge_size=2,
                                               family="ernie4_5_vl_moe", temporal_merge_size=temporal_merge_size)
        assert torch.equal(positions.permute(2, 0, 1), expected) and torch.equal(deltas, expected_deltas)


@pytest.mark.parametrize("change, words", [
    (dict(temporal_merge_size=None), ["ernie4_5_vl_moe videos need temporal_merge_size"]),
    (dict(temporal_merge_size=8), ["t=5 frames, fewer than temporal_merge_size=8"]),
    (dict(temporal_merge_size=1), ["run of 8 video tokens", "(5, 4, 4)", "20 tokens"]),
])
def test_ernie_video_errors_say_what_is_wrong(change, words):
    kwargs = dict(mm_token_type_ids=torch.tensor([[0] + [2] * 8 + [0]]), video_grid_thw=[[5, 4, 4]],
                  spatial_merge_size=2, family="ernie4_5_vl_moe", temporal_merge_size=2)
    kwargs.update(change)
    with pytest.raises(ValueError) as info:
        mrope_position_ids(**kwargs)
    for word in words:
        assert word in str(info.value)


# -- the patch on a tiny model ---------------------------------------------------------------------------
def ernie_inputs(model):
    """Text + one image (1, 4, 6) + one 4-frame video (two temporal tokens of 2 x 2), as the processor lays them out."""
    image, video = torch.tensor([[1, 4, 6]]), torch.tensor([[4, 4, 4]])
    ids = [1, 2, 3, mm.VS] + [mm.IMG] * 6 + [mm.VE, 4, 5, mm.AS] + [mm.VID] * 8 + [mm.AE, 6, 7, 8]
    input_ids = torch.tensor([ids])
    return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                mm_token_type_ids=mm.token_types(input_ids), pixel_values=mm.pixels(image, 1), image_grid_thw=image,
                pixel_values_videos=mm.pixels(video, 1), video_grid_thw=video)


def test_patched_language_model_matches_transformers_and_leaves_the_vision_tower_alone():
    model = mm.build("ernie")
    kwargs = ernie_inputs(model)
    with torch.no_grad():
        expected = model(**kwargs).logits
        expected_out = model.generate(**kwargs, max_new_tokens=5, do_sample=False, output_scores=True,
                                      return_dict_in_generate=True)
    patch(model)  # interleaved, ERNIE's own pairing: no layout= needed
    assert model._ropekit_patch["rope"].axis_plan().axis.tolist() == [1, 2, 1, 2, 1, 2, 0, 0]
    assert not any("forward" in m.__dict__ for m in model.model.vision_tower.modules())
    with torch.no_grad():
        logits = model(**kwargs).logits
        out = model.generate(**kwargs, max_new_tokens=5, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    assert torch.equal(out.sequences, expected_out.sequences)
    for step, expected_step in zip(out.scores, expected_out.scores, strict=True):  # every decoding step's logits
        torch.testing.assert_close(step, expected_step, rtol=0, atol=1e-5)
    unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(**kwargs).logits, expected)


def test_contiguous_sections_instead_of_the_alternation_change_the_logits():
    # negative control: Qwen2-VL's map over the same ladder and sections is visibly another model
    model = mm.build("ernie")
    kwargs = ernie_inputs(model)
    with torch.no_grad():
        expected = model(**kwargs).logits
    own = RopeConfig.from_hf(model.config)
    wrong = RopeConfig(16, base=own.base, layout="interleaved", axes=mrope(own.axes.inv_freq, (2, 3, 3)))
    patch(model, rope=wrong)
    with torch.no_grad():
        assert (model(**kwargs).logits - expected).abs().max() > 1e-4
    unpatch(model)
