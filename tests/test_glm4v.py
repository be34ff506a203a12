"""GLM-4.1V / GLM-4.5V against transformers: the text rotary modules, get_rope_index, the patched language model.

Oracles: transformers' ``Glm4vTextRotaryEmbedding`` and ``Glm4vMoeTextRotaryEmbedding`` (built from
the published config in tests/fixtures/multiaxis), ``Glm4vModel.get_rope_index`` on random left-padded
text + image + video batches, and tiny random-weight ``Glm4vForConditionalGeneration`` and
``Glm4vMoeForConditionalGeneration`` (tests/multimodal_models.py) run patched and unpatched.
"""

import copy
import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.glm4v.modeling_glm4v import Glm4vTextRotaryEmbedding  # noqa: E402
from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeTextRotaryEmbedding  # noqa: E402

import multimodal_models as mm  # noqa: E402
from ropekit import RopeConfig  # noqa: E402
from ropekit.integrations.transformers import patch, unpatch  # noqa: E402
from ropekit.multiaxis import LAYOUTS, mrope_position_ids, named_plan  # noqa: E402

RAW = json.loads((Path(__file__).parent / "fixtures" / "multiaxis" / "glm-4.1v-9b-thinking.json").read_text())


def published(model_type="glm4v"):
    kwargs = {k: v for k, v in copy.deepcopy(RAW).items() if k[0] != "_" and k != "model_type"}
    return transformers.AutoConfig.for_model(model_type, **kwargs)  # (it rewrites the dicts it is given)


def float32_tables(positions, axis, head_dim, base):
    """transformers' float32 recipe (its inv_freq, float32 angles) with ropekit's axis map: ``(b, s, pairs)``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    angles = positions.permute(1, 2, 0).float()[..., axis] * inv_freq
    return angles.cos(), angles.sin()


# -- the text rotary modules -----------------------------------------------------------------------
def test_published_config_reads_as_contiguous_sections_over_the_partial_rotary_ladder():
    hf = published()
    rope = RopeConfig.from_hf(RAW)
    assert rope == RopeConfig.from_hf(hf) == RopeConfig.from_hf(hf.to_dict()) == RopeConfig.from_hf(hf.text_config)
    assert (rope.head_dim, rope.rotary_dim, rope.base, rope.layout) == (128, 64, 10000.0, "interleaved")
    plan = rope.axis_plan()
    assert plan.axis.tolist() == [0] * 8 + [1] * 12 + [2] * 12 and plan.axis_names == ("t", "h", "w")
    assert plan == named_plan("glm4v") and LAYOUTS["glm4v"] == "interleaved"


def test_the_axis_map_is_the_glm4v_rotary_modules_bit_for_bit():
    hf = published()
    rotary = Glm4vTextRotaryEmbedding(hf.text_config)
    plan = RopeConfig.from_hf(RAW).axis_plan()
    positions = torch.randint(0, 5000, (3, 2, 9))
    cos, sin = rotary(torch.zeros(1), positions)  # (batch, seq, rotary_dim): each pair's value twice, (2i, 2i+1)
    assert cos.shape == (2, 9, 64) and torch.equal(cos[..., 0::2], cos[..., 1::2])
    expected_cos, expected_sin = float32_tables(positions, plan.axis, 64, 10000.0)
    assert torch.equal(cos[..., 0::2], expected_cos) and torch.equal(sin[..., 0::2], expected_sin)
    small = positions % 64  # ropekit's float64 tables against theirs where float32 angles cost only ulps
    ours_cos, ours_sin = plan.cos_sin(small.permute(1, 2, 0))
    hf_cos, hf_sin = rotary(torch.zeros(1), small)
    torch.testing.assert_close(ours_cos, hf_cos[..., 0::2], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours_sin, hf_sin[..., 0::2], rtol=0, atol=1e-5)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_one_axis_moves_only_its_own_pairs(axis):
    rotary = Glm4vTextRotaryEmbedding(published().text_config)
    plan = RopeConfig.from_hf(RAW).axis_plan()
    positions = torch.zeros(3, 1, 5, dtype=torch.long)
    positions[axis] = torch.arange(1, 6)
    _, sin = rotary(torch.zeros(1), positions)
    moved = (sin[0, :, 0::2] != 0).any(0)
    assert moved.tolist() == (plan.axis == axis).tolist()


def test_glm4_5v_has_the_same_plan_in_the_half_layout():
    cfg = {**RAW, "model_type": "glm4v_moe", "text_config": {**RAW["text_config"], "model_type": "glm4v_moe_text"}}
    rope = RopeConfig.from_hf(cfg)
    assert rope.layout == "half" and rope.axis_plan() == named_plan("glm4v")
    hf = transformers.AutoConfig.for_model("glm4v_moe", **{k: v for k, v in copy.deepcopy(cfg).items() if k[0] != "_"
                                                           and k != "model_type"})
    assert RopeConfig.from_hf(hf) == rope
    rotary = Glm4vMoeTextRotaryEmbedding(hf.text_config)
    positions = torch.randint(0, 5000, (3, 2, 9))
    cos, sin = rotary(torch.zeros(1), positions)  # (batch, seq, rotary_dim): halves, pairs (i, i + 32)
    expected_cos, expected_sin = float32_tables(positions, rope.axis_plan().axis, 64, 10000.0)
    assert torch.equal(cos[..., :32], expected_cos) and torch.equal(sin[..., 32:], expected_sin)


def test_a_section_that_does_not_cover_the_rotary_pairs_raises():
    cfg = {**RAW, "text_config": {**RAW["text_config"], "partial_rotary_factor": 1.0}}  # 64 pairs, sections 32
    with pytest.raises(ValueError, match=r"mrope_section \[8, 12, 12\] adds up to 32 pairs.*64 pairs"):
        RopeConfig.from_hf(cfg)


# -- positions: get_rope_index -----------------------------------------------------------------------
def test_mrope_position_ids_equal_glm4v_get_rope_index_on_random_padded_batches():
    rng = random.Random(4)
    get_rope_index = mm.rope_index("glm4v")
    for _ in range(25):
        input_ids, mask, images, videos = mm.random_batch(rng, "glm4v")
        grids = dict(image_grid_thw=torch.tensor(images) if images else None,
                     video_grid_thw=torch.tensor(videos) if videos else None)
        types = mm.token_types(input_ids)
        expected, expected_deltas = get_rope_index(input_ids=input_ids, mm_token_type_ids=types, attention_mask=mask,
                                                   **{k: (v.clone() if v is not None else v) for k, v in grids.items()})
        for family in ("glm4v", "glm4v_moe"):
            positions, deltas = mrope_position_ids(types, **grids, attention_mask=mask, spatial_merge_size=2,
                                                   family=family)
            assert torch.equal(positions.permute(2, 0, 1), expected) and torch.equal(deltas, expected_deltas)


# -- the patch on a tiny model ---------------------------------------------------------------------------
def glm_inputs(model, kind):
    """Text around one image (1, 4, 6), or around a 2-frame video (frames split by timestamps).

    GLM-4.1V marks video frames with the image token (its placeholder mask is the image token's), so
    one prompt holds images or a video; the token types tell them apart.
    """
    tp = model.config.vision_config.temporal_patch_size
    if kind == "image":
        grid = torch.tensor([[1, 4, 6]])
        ids = [1, 2, 3, mm.VS] + [mm.IMG] * 6 + [mm.VE, 4, 5, 6]
        input_ids = torch.tensor([ids])
        return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                    mm_token_type_ids=mm.token_types(input_ids), pixel_values=mm.pixels(grid, tp), image_grid_thw=grid)
    grid = torch.tensor([[2, 4, 4]])
    ids = [1, 2, 3]
    for frame in range(2):
        ids += [7 + frame, mm.AS] + [mm.VID] * 4 + [mm.AE]
    input_ids = torch.tensor([ids + [6, 7, 8]])
    types = mm.token_types(input_ids)
    input_ids = input_ids.masked_fill(input_ids == mm.VID, mm.IMG)
    return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=types,
                pixel_values_videos=mm.pixels(grid, tp), video_grid_thw=grid)


@pytest.mark.parametrize("kind", ["image", "video"])
def test_patched_language_model_matches_transformers_and_leaves_the_vision_tower_alone(kind):
    model = mm.build("glm4v")
    kwargs = glm_inputs(model, kind)
    with torch.no_grad():
        expected = model(**kwargs).logits
        expected_tokens = model.generate(**kwargs, max_new_tokens=5, do_sample=False)
    patch(model)  # the config's interleaved layout is the one GLM-4.1V's own code rotates in: no layout= needed
    assert model._ropekit_patch["rope"].layout == "interleaved" and model._ropekit_patch["rope"].rotary_dim == 16
    assert not any("forward" in m.__dict__ for m in model.model.visual.modules())
    with torch.no_grad():
        logits = model(**kwargs).logits
        tokens = model.generate(**kwargs, max_new_tokens=5, do_sample=False)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    assert torch.equal(tokens, expected_tokens)
    unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(**kwargs).logits, expected)


def test_patched_glm4_5v_matches_transformers_in_the_half_layout():
    model = mm.build("glm4v_moe")
    kwargs = glm_inputs(model, "image")
    with torch.no_grad():
        expected = model(**kwargs).logits
        expected_tokens = model.generate(**kwargs, max_new_tokens=5, do_sample=False)
    patch(model)
    assert model._ropekit_patch["rope"].layout == "half"
    with torch.no_grad():
        torch.testing.assert_close(model(**kwargs).logits, expected, rtol=0, atol=1e-5)
        assert torch.equal(model.generate(**kwargs, max_new_tokens=5, do_sample=False), expected_tokens)
    unpatch(model)


def test_the_half_layout_or_qwen3_interleave_changes_the_logits():
    # negative controls: the pairing and the axis map both matter, and the patch test above would see either
    model = mm.build("glm4v")
    kwargs = glm_inputs(model, "image")
    with torch.no_grad():
        expected = model(**kwargs).logits
    own = RopeConfig.from_hf(model.config)
    for wrong in (dict(layout="half"), dict(rope=RopeConfig(32, rotary_dim=16, layout="interleaved",
                                                            axes=named_plan("qwen3-vl", head_dim=16, base=10000.0,
                                                                            section=(2, 3, 3))))):
        patch(model, **wrong)
        with torch.no_grad():
            assert (model(**kwargs).logits - expected).abs().max() > 1e-4, wrong
        unpatch(model)
    assert own.layout == "interleaved"
