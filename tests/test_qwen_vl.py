"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL against transformers: text rotary modules, get_rope_index, the patch.

Oracles: transformers' own ``*RotaryEmbedding`` modules (built from the published configs in
tests/fixtures/multiaxis), its ``get_rope_index`` on random padded text + image + video batches,
and tiny random-weight models (tests/qwen_vl_models.py) run patched and unpatched.
"""

import json
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding  # noqa: E402
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding  # noqa: E402
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding  # noqa: E402

import qwen_vl_models as qv  # noqa: E402
import ropekit  # noqa: E402
from ropekit import RopeConfig  # noqa: E402
from ropekit.integrations.transformers import patch, unpatch  # noqa: E402
from ropekit.multiaxis import mrope, mrope_next_positions, mrope_position_ids  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "multiaxis"
PUBLISHED = {"qwen2_vl": ("qwen2-vl-7b-instruct", Qwen2VLRotaryEmbedding),
             "qwen2_5_vl": ("qwen2.5-vl-7b-instruct", Qwen2_5_VLRotaryEmbedding),
             "qwen3_vl": ("qwen3-vl-8b-instruct", Qwen3VLTextRotaryEmbedding)}


def published(kind):
    name, rotary_class = PUBLISHED[kind]
    raw = json.loads((FIXTURES / f"{name}.json").read_text())
    kwargs = {k: v for k, v in raw.items() if k[0] != "_" and k != "model_type"}
    hf = qv.transformers.AutoConfig.for_model(kind, **kwargs)
    return raw, hf, rotary_class(hf.text_config)


# -- the text rotary modules -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", qv.FAMILIES)
def test_plan_of_published_config_reproduces_the_text_rotary_module(kind):
    raw, hf, rotary = published(kind)
    rope = RopeConfig.from_hf(raw)
    assert RopeConfig.from_hf(hf) == rope == RopeConfig.from_hf(hf.to_dict()) == RopeConfig.from_hf(hf.text_config)
    plan = rope.axis_plan()
    assert rope.layout == "half" and plan.axis_names == ("t", "h", "w")
    assert plan.counts == ((24, 20, 20) if kind == "qwen3_vl" else (16, 24, 24))
    positions = torch.randint(0, 5000, (3, 2, 9))
    cos, sin = rotary(torch.zeros(1), positions)  # (batch, seq, head_dim), half layout, float32 angles
    half = plan.pairs
    assert torch.equal(cos[..., :half], cos[..., half:])
    # exact: transformers' float32 recipe with ropekit's axis map gives its tables bit for bit
    angles32 = positions.permute(1, 2, 0).float()[..., plan.axis] * rotary.inv_freq.float()
    assert torch.equal(angles32.cos(), cos[..., :half]) and torch.equal(angles32.sin(), sin[..., :half])
    # and ropekit's float64 tables differ only by transformers' float32 angles (|angle| <= 5000 rad)
    ours_cos, ours_sin = plan.cos_sin(positions.permute(1, 2, 0))
    torch.testing.assert_close(ours_cos, cos[..., :half], rtol=0, atol=1e-3)
    torch.testing.assert_close(ours_sin, sin[..., :half], rtol=0, atol=1e-3)
    small = positions % 64  # small angles: transformers' float32 inv_freq and angles cost a few ulp of 64 rad
    ours_cos, _ = plan.cos_sin(small.permute(1, 2, 0))
    torch.testing.assert_close(ours_cos, rotary(torch.zeros(1), small)[0][..., :half], rtol=0, atol=1e-5)


def test_yarn_with_mrope_sections_scales_like_transformers():
    params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6,
              "mrope_section": [16, 24, 24]}
    hf = qv.transformers.Qwen2_5_VLTextConfig(hidden_size=3584, num_attention_heads=28, max_position_embeddings=128000,
                                              rope_parameters=dict(params))
    rotary = Qwen2_5_VLRotaryEmbedding(hf)
    rope = RopeConfig.from_hf({"model_type": "qwen2_5_vl", "hidden_size": 3584, "num_attention_heads": 28,
                               "max_position_embeddings": 128000, "rope_scaling": params})
    plan = rope.axis_plan()
    assert isinstance(rope.scaling, ropekit.scaling.YaRN) and plan.counts == (16, 24, 24)
    assert plan.attention_scale == pytest.approx(rotary.attention_scaling, rel=1e-6) and plan.attention_scale > 1.1
    positions = torch.randint(0, 200, (3, 1, 9))
    cos, _ = rotary(torch.zeros(1), positions)
    torch.testing.assert_close(plan.cos_sin(positions.permute(1, 2, 0))[0], cos[..., :64], rtol=0, atol=3e-5)


def test_text_only_ids_give_1d_rope():
    # (batch, seq) position ids put every axis at the token's position: M-RoPE is then 1-D RoPE, bit for bit
    _, _, rotary = published("qwen3_vl")
    plan = RopeConfig.from_hf(published("qwen3_vl")[0]).axis_plan()
    positions = torch.arange(300)[None]
    one_d = ropekit.cos_sin(positions, plan.inv_freq)
    multi = plan.cos_sin(positions[..., None].expand(1, 300, 3))
    assert torch.equal(one_d[0], multi[0]) and torch.equal(one_d[1], multi[1])
    assert torch.equal(rotary(torch.zeros(1), positions)[0], rotary(torch.zeros(1), positions.expand(3, 1, 300))[0])


def test_vision_tower_rotary_is_the_two_halves_plan_in_merge_block_order():
    # left alone by the patch, but representable: pairs [0, d/4) on the row, [d/4, d/2) on the column
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLVisionRotaryEmbedding

    from ropekit.multiaxis import named_plan, vision_patch_positions

    rotary = Qwen2VLVisionRotaryEmbedding(qv.transformers.Qwen2VLVisionConfig(embed_dim=1280, num_heads=16))
    grid = torch.tensor([[2, 4, 6], [1, 6, 4]])
    positions = vision_patch_positions(grid, 2)
    cos, sin = rotary(torch.zeros(1), positions)  # (N, 80), half layout
    ours_cos, ours_sin = named_plan("qwen-vl-vision", head_dim=80).cos_sin(positions)
    torch.testing.assert_close(ours_cos, cos[:, :40], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_sin, sin[:, :40], rtol=0, atol=1e-6)


# -- positions: get_rope_index -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", qv.FAMILIES)
def test_mrope_position_ids_equal_get_rope_index_on_random_padded_batches(kind):
    rng = random.Random(qv.FAMILIES.index(kind))
    get_rope_index = qv.rope_index(kind, {"tokens_per_second": 2} if kind == "qwen2_5_vl" else None)
    for _ in range(25):
        input_ids, mask, images, videos, seconds = qv.random_batch(rng, kind)
        grids = dict(image_grid_thw=torch.tensor(images) if images else None,
                     video_grid_thw=torch.tensor(videos) if videos else None)
        extra = {"second_per_grid_ts": torch.tensor(seconds)} if kind == "qwen2_5_vl" and videos else {}
        types = qv.token_types(input_ids)
        expected, expected_deltas = get_rope_index(input_ids=input_ids, mm_token_type_ids=types, attention_mask=mask,
                                                   **{k: (v.clone() if v is not None else v) for k, v in grids.items()},
                                                   **extra)
        positions, deltas = mrope_position_ids(types, **grids, attention_mask=mask, spatial_merge_size=2, family=kind,
                                               tokens_per_second=2, **extra)
        assert torch.equal(positions.permute(2, 0, 1), expected)
        assert torch.equal(deltas, expected_deltas)


def test_text_after_a_video_continues_from_its_spatial_extent_as_transformers_5():
    # video of 2 frames at 1 s per grid, 2 tokens per second: t ids 0 and 2 (+2); text resumes at 2 + 4 // 2 = 4,
    # the second frame's t id (transformers 4.x resumed at max + 1 = 5); docs/multiaxis.md
    types = torch.tensor([[0, 0] + [2] * 8 + [0, 0]], dtype=torch.int32)
    positions, deltas = mrope_position_ids(types, video_grid_thw=[[2, 4, 4]], spatial_merge_size=2, family="qwen2_5_vl",
                                           tokens_per_second=2, second_per_grid_ts=torch.tensor([1.0]))
    assert positions[0, :, 0].tolist() == [0, 1, 2, 2, 2, 2, 4, 4, 4, 4, 4, 5]
    expected, expected_deltas = qv.rope_index("qwen2_5_vl", {"tokens_per_second": 2})(
        input_ids=torch.zeros(1, 12, dtype=torch.long), mm_token_type_ids=types,
        video_grid_thw=torch.tensor([[2, 4, 4]]), second_per_grid_ts=torch.tensor([1.0]))
    assert torch.equal(positions.permute(2, 0, 1), expected) and torch.equal(deltas, expected_deltas)
    assert mrope_next_positions(deltas, 12, 2)[0].tolist() == [[6, 6, 6], [7, 7, 7]]


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(image_grid_thw=[[1, 2, 4]]), ["run of 4 image tokens", "(1, 2, 4)"]),
        (dict(image_grid_thw=[[1, 4, 4], [1, 2, 2]]), ["image_grid_thw has 1 grid(s) more"]),
        (dict(image_grid_thw=None), ["more image runs than image_grid_thw"]),
        (dict(family="qwen2"), ["family", "'qwen2'"]),
        (dict(spatial_merge_size=0), ["spatial_merge_size", "0"]),
        (dict(attention_mask=torch.zeros(1, 8, dtype=torch.long)), ["row 0", "no token"]),
        (dict(mm_token_type_ids=torch.full((1, 8), 3)), ["mm_token_type_ids", "[3]"]),
    ],
)
def test_mrope_position_ids_errors_say_what_is_wrong(change, words):
    kwargs = dict(mm_token_type_ids=torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0]]), image_grid_thw=[[1, 4, 4]],
                  spatial_merge_size=2, family="qwen2_vl")
    kwargs.update(change)
    with pytest.raises(ValueError) as info:
        mrope_position_ids(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_qwen2_5_videos_need_tokens_per_second():
    with pytest.raises(ValueError, match="tokens_per_second"):
        mrope_position_ids(torch.tensor([[2] * 4]), video_grid_thw=[[1, 4, 4]], spatial_merge_size=2,
                           family="qwen2_5_vl")


# -- the patch on tiny models ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", qv.FAMILIES)
def test_patched_language_model_matches_transformers_and_leaves_the_vision_tower_alone(kind):
    model = qv.build(kind)
    kwargs = qv.inputs(model, kind)
    with torch.no_grad():
        expected = model(**kwargs).logits
        expected_tokens = model.generate(**kwargs, max_new_tokens=4, do_sample=False)
    vision_state = {k: v.clone() for k, v in model.model.visual.state_dict().items()}
    patch(model)
    assert RopeConfig.from_hf(model.config).axes is not None
    assert not any("forward" in m.__dict__ for m in model.model.visual.modules())
    assert "forward" in model.model.language_model.rotary_emb.__dict__
    with torch.no_grad():
        logits = model(**kwargs).logits
        tokens = model.generate(**kwargs, max_new_tokens=4, do_sample=False)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    assert torch.equal(tokens, expected_tokens)
    unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(**kwargs).logits, expected)
    assert all(torch.equal(v, model.model.visual.state_dict()[k]) for k, v in vision_state.items())


def test_the_wrong_axis_map_changes_the_logits():
    # negative control: Qwen3-VL patched with contiguous sections is visibly another model
    model = qv.build("qwen3_vl")
    kwargs = qv.inputs(model, "qwen3_vl")
    with torch.no_grad():
        expected = model(**kwargs).logits
    own = RopeConfig.from_hf(model.config)
    wrong = RopeConfig(16, base=own.base, axes=mrope(own.axes.inv_freq, qv.SECTION))
    patch(model, rope=wrong)
    with torch.no_grad():
        assert (model(**kwargs).logits - expected).abs().max() > 1e-3
    unpatch(model)


def test_patch_refuses_a_1d_rope_for_a_multi_axis_model():
    model = qv.build("qwen2_vl")
    with pytest.raises(ValueError, match="rope has 1 position axes but Qwen2VLForConditionalGeneration has 3"):
        patch(model, rope=RopeConfig(16, base=10000.0))
    assert not hasattr(model, "_ropekit_patch")
