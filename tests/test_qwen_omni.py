"""Qwen2.5-Omni's thinker against transformers: the rotary module, get_rope_index with audio, the patched thinker.

Oracles: transformers' ``Qwen2_5OmniRotaryEmbedding`` (built from the published config in
tests/fixtures/multiaxis), its ``get_rope_index`` on random left-padded batches of text, images,
videos and audio, with and without ``use_audio_in_video`` (videos and their soundtracks laid out by the
processor's own ``replace_video_with_audio_token``), and a tiny random-weight
``Qwen2_5OmniThinkerForConditionalGeneration`` (tests/multimodal_models.py) run patched and unpatched.
"""

import copy
import itertools
import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniRotaryEmbedding  # noqa: E402

import multimodal_models as mm  # noqa: E402
from ropekit import RopeConfig  # noqa: E402
from ropekit.integrations.transformers import patch, unpatch  # noqa: E402
from ropekit.multiaxis import LAYOUTS, named_plan, omni_position_ids  # noqa: E402
from ropekit.rope.omni_positions import time_chunks  # noqa: E402

RAW = json.loads((Path(__file__).parent / "fixtures" / "multiaxis" / "qwen2.5-omni-7b.json").read_text())
OMNI = dict(spatial_merge_size=2, position_id_per_seconds=25, seconds_per_chunk=2)


def published():
    kwargs = {k: v for k, v in copy.deepcopy(RAW).items() if k[0] != "_" and k != "model_type"}
    return transformers.AutoConfig.for_model("qwen2_5_omni", **kwargs)


# -- the thinker's rotary module ------------------------------------------------------------------------
def test_every_level_of_the_published_config_reads_as_the_thinkers_contiguous_sections():
    hf = published()
    rope = RopeConfig.from_hf(RAW)
    thinker = hf.thinker_config
    assert rope == RopeConfig.from_hf(RAW["thinker_config"]) == RopeConfig.from_hf(hf) == RopeConfig.from_hf(thinker)
    assert rope == RopeConfig.from_hf(thinker.to_dict()) == RopeConfig.from_hf(thinker.text_config)
    assert (rope.head_dim, rope.rotary_dim, rope.base, rope.layout) == (128, 128, 1e6, "half")
    assert rope.axis_plan() == named_plan("qwen2.5-omni") and LAYOUTS["qwen2.5-omni"] == "half"
    assert rope.axis_plan().counts == (16, 24, 24)


def test_the_axis_map_is_the_thinkers_rotary_module_bit_for_bit():
    rotary = Qwen2_5OmniRotaryEmbedding(published().thinker_config.text_config)
    plan = RopeConfig.from_hf(RAW).axis_plan()
    positions = torch.randint(0, 5000, (3, 2, 9))
    cos, sin = rotary(torch.zeros(1), positions)  # (batch, seq, head_dim), halves
    angles = positions.permute(1, 2, 0).float()[..., plan.axis] * rotary.inv_freq.float()
    assert torch.equal(cos[..., :64], angles.cos()) and torch.equal(sin[..., 64:], angles.sin())
    small = positions % 64
    ours_cos, ours_sin = plan.cos_sin(small.permute(1, 2, 0))
    hf_cos, hf_sin = rotary(torch.zeros(1), small)
    torch.testing.assert_close(ours_cos, hf_cos[..., :64], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours_sin, hf_sin[..., :64], rtol=0, atol=1e-5)


# -- positions: get_rope_index ---------------------------------------------------------------------------
def transformers_positions(input_ids, mask, images, videos, seconds, audio, use_audio_in_video):
    return mm.rope_index("omni")(input_ids, torch.tensor(images) if images else None,
                                 torch.tensor(videos) if videos else None, mask, use_audio_in_video,
                                 torch.tensor(audio) if audio else None, torch.tensor(seconds) if seconds else None)


def ropekit_positions(input_ids, mask, images, videos, seconds, use_audio_in_video):
    return omni_position_ids(mm.token_types(input_ids), images or None, videos or None, **OMNI,
                             second_per_grid_ts=seconds or None, use_audio_in_video=use_audio_in_video,
                             attention_mask=mask)


@pytest.mark.parametrize("use_audio_in_video", [False, True])
def test_omni_position_ids_equal_get_rope_index_on_random_padded_batches(use_audio_in_video):
    rng = random.Random(int(use_audio_in_video))
    kinds = set()
    for _ in range(40):
        input_ids, mask, images, videos, seconds, audio = mm.omni_batch(rng, use_audio_in_video=use_audio_in_video)
        kinds.update(mm.token_types(input_ids)[mask.bool()].tolist())
        expected, expected_deltas = transformers_positions(input_ids, mask, images, videos, seconds, audio,
                                                           use_audio_in_video)
        positions, deltas = ropekit_positions(input_ids, mask, images, videos, seconds, use_audio_in_video)
        assert torch.equal(positions.permute(2, 0, 1), expected) and torch.equal(deltas, expected_deltas)
    assert kinds == {0, 1, 2, 3}


def test_a_video_and_its_audio_share_the_clock():
    # 3 frames of 2 x 2 tokens at 1 s per grid and 80 audio tokens (3.2 s): frame i at t = 25 i, audio token k at
    # t = k, both from the same origin; chunks of 2 s = 50 positions alternate video, audio
    grid, section = (3, 4, 4), mm.video_with_audio_tokens((3, 4, 4), 1.0, 80)
    input_ids = torch.tensor([[5, 6, mm.VS] + section + [mm.VE, 7]])
    positions, deltas = ropekit_positions(input_ids, torch.ones_like(input_ids), [], [grid], [1.0], True)
    expected, expected_deltas = transformers_positions(input_ids, torch.ones_like(input_ids), [], [grid], [1.0],
                                                       [mm.audio_feature_length(80)], True)
    assert torch.equal(positions.permute(2, 0, 1), expected) and torch.equal(deltas, expected_deltas)
    t, types = positions[0, :, 0], mm.token_types(input_ids)[0]
    assert t[:4].tolist() == [0, 1, 2, 2]  # text, then the two start tokens at one position
    origin = 3
    video_t, audio_t = t[types == 2].view(3, 4)[:, 0] - origin, t[types == 3] - origin
    assert video_t.tolist() == [0, 25, 50] and audio_t.tolist() == list(range(80))
    runs = [(int(kind), len(list(run))) for kind, run in itertools.groupby(types[4:-3].tolist())]
    assert runs == [(2, 8), (3, 50), (2, 4), (3, 30)]  # frames 0-1 with 2 s of sound, then frame 2 with the rest
    assert t[-3] == t[-2] == origin + 79 + 1 and t[-1] == t[-2] + 1  # the end pair after the last chunk, then text


def test_time_chunks_are_transformers_get_chunked_index():
    chunked = mm.rope_index("omni").args[0].get_chunked_index
    rng = random.Random(7)
    for _ in range(200):
        origin, size = rng.randrange(0, 100), rng.randrange(1, 60)
        times = sorted(origin + rng.randrange(0, 300) for _ in range(rng.randrange(1, 40)))
        times[0] = origin
        assert time_chunks(times, size, origin) == chunked(torch.tensor(times), size, origin)


def test_text_only_batches_and_padding_follow_transformers_including_its_deltas():
    # without image and video grids transformers counts padding's position 1 in the delta: a one-token row
    # padded on the left has delta 1, not 0
    input_ids, mask = mm.pad_left([[5], [5, 6, mm.AS, mm.AUD, mm.AUD, mm.AE, 7]])
    positions, deltas = ropekit_positions(input_ids, mask, [], [], [], False)
    expected, expected_deltas = transformers_positions(input_ids, mask, [], [], [], [mm.audio_feature_length(2)],
                                                       False)
    assert torch.equal(positions.permute(2, 0, 1), expected) and torch.equal(deltas, expected_deltas)
    assert deltas.tolist() == [[1], [0]] and positions[0, :6].unique().tolist() == [1]


def test_the_processors_video_with_audio_layout_is_what_the_rule_checks():
    grid = (4, 4, 4)
    section = mm.video_with_audio_tokens(grid, 1.0, 120)
    swapped = section[:]
    first_audio = swapped.index(mm.AUD)
    swapped[first_audio - 1], swapped[first_audio] = swapped[first_audio], swapped[first_audio - 1]
    for tokens, ok in ((section, True), (swapped, False)):
        input_ids = torch.tensor([[5, mm.VS] + tokens + [mm.VE, 6]])
        call = lambda ids=input_ids: ropekit_positions(ids, torch.ones_like(ids), [], [grid], [1.0], True)  # noqa: E731
        if ok:
            call()
        else:
            with pytest.raises(ValueError, match="not interleaved by chunks of 50 positions of time"):
                call()


@pytest.mark.parametrize("change, words", [
    (dict(ids=[5, mm.VS, mm.AS] + [mm.VID] * 4 + [mm.AE, mm.VE]), ["needs its audio tokens"]),
    (dict(ids=[mm.AS] + [mm.VID] * 4 + [mm.AUD, mm.AE, mm.VE]), ["preceded by its two start tokens"]),
    (dict(ids=[5, mm.VS, mm.AS] + [mm.VID] * 4 + [mm.AUD]), ["followed by its two end tokens"]),
    (dict(seconds=None), ["second_per_grid_ts", "1 videos"]),
    (dict(seconds_per_chunk=0.01), ["at least 1 position"]),
    (dict(seconds_per_chunk=None), ["seconds_per_chunk must be a positive number"]),
    (dict(position_id_per_seconds=0), ["position_id_per_seconds"]),
    (dict(videos=[[1, 4, 4], [1, 2, 2]], seconds=[1.0, 1.0]), ["video_grid_thw has 1 grid(s) more"]),
    (dict(ids=[mm.VS, mm.AS] + [mm.VID] * 3 + [mm.AUD, mm.AE, mm.VE]), ["3 video tokens", "(1, 4, 4)"]),
])
def test_errors_say_what_is_wrong(change, words):
    ids = change.get("ids", [5, mm.VS, mm.AS] + [mm.VID] * 4 + [mm.AUD, mm.AE, mm.VE])
    input_ids = torch.tensor([ids])
    options = {**OMNI, "use_audio_in_video": True, "second_per_grid_ts": change.get("seconds", [1.0])}
    options.update({k: v for k, v in change.items() if k in ("seconds_per_chunk", "position_id_per_seconds")})
    with pytest.raises(ValueError) as info:
        omni_position_ids(mm.token_types(input_ids), None, change.get("videos", [[1, 4, 4]]), **options)
    for word in words:
        assert word in str(info.value)


# -- the patch on a tiny thinker ---------------------------------------------------------------------------
def omni_inputs(model, use_audio_in_video):
    """Text, one image and one 1.5 s clip of audio; or text and a 4-frame video with its soundtrack."""
    tp, audio_config = model.config.vision_config.temporal_patch_size, model.config.audio_config
    if use_audio_in_video:
        grid, seconds, audio_tokens = torch.tensor([[4, 4, 4]]), 1.0, 90
        ids = [1, 2, mm.VS] + mm.video_with_audio_tokens(grid[0].tolist(), seconds, audio_tokens) + [mm.VE, 3, 4]
        visual = dict(pixel_values_videos=mm.pixels(grid, tp), video_grid_thw=grid,
                      video_second_per_grid=torch.tensor([seconds]))
    else:
        grid, audio_tokens = torch.tensor([[1, 4, 6]]), 37
        ids = [1, 2, mm.VS] + [mm.IMG] * 6 + [mm.VE, 3, mm.AS] + [mm.AUD] * audio_tokens + [mm.AE, 4]
        visual = dict(pixel_values=mm.pixels(grid, tp), image_grid_thw=grid)
    input_ids, mel = torch.tensor([ids]), mm.audio_feature_length(audio_tokens)
    return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **visual,
                input_features=torch.randn(1, audio_config.num_mel_bins, mel),
                feature_attention_mask=torch.ones(1, mel, dtype=torch.long), use_audio_in_video=use_audio_in_video)


@pytest.mark.parametrize("use_audio_in_video", [False, True])
def test_patched_thinker_matches_transformers_and_leaves_the_encoders_alone(use_audio_in_video):
    model = mm.build("omni")
    kwargs = omni_inputs(model, use_audio_in_video)
    with torch.no_grad():
        expected = model(**kwargs).logits
        expected_out = model.generate(**kwargs, max_new_tokens=5, do_sample=False, output_scores=True,
                                      return_dict_in_generate=True)
    patch(model)
    assert not any("forward" in m.__dict__ for m in (*model.model.visual.modules(), *model.model.audio_tower.modules()))
    with torch.no_grad():
        logits = model(**kwargs).logits
        out = model.generate(**kwargs, max_new_tokens=5, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    assert torch.equal(out.sequences, expected_out.sequences)
    for step, expected_step in zip(out.scores, expected_out.scores, strict=True):
        torch.testing.assert_close(step, expected_step, rtol=0, atol=1e-5)
    unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(**kwargs).logits, expected)
