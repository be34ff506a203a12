"""Tiny random-weight GLM-4.1V/4.5V, ERNIE-4.5-VL and Qwen2.5-Omni thinker models built from configs, and inputs.

Text models: 2 layers, a vocabulary of 256 with the special tokens inside it. GLM-4.1V: hidden 128,
4 heads of 32 channels, half of them rotary (8 pairs, mrope_section [2, 3, 3]), and GLM-4.5V the
same with 4 experts; ERNIE-4.5-VL: hidden
64, 4 heads of 16 (8 pairs, mrope_section [3, 3, 2] as h, w, t), 4 experts; Qwen2.5-Omni: hidden
64, 4 heads of 16 (mrope_section [2, 3, 3]). Vision towers of one block, an audio encoder of one
layer. ``rope_index(family)`` is transformers' own ``get_rope_index`` called without building a model;
``random_batch`` and ``omni_batch`` make left-padded batches as the processors lay them out.
"""

import functools
import types

import torch
import transformers

transformers.logging.set_verbosity_error()

IMG, VID, AUD, VS, VE, AS, AE = 250, 251, 249, 252, 253, 247, 248  # image, video, audio, starts and ends
PATCH = 14


def glm4v_config(section=(2, 3, 3)):
    text = dict(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(section),
                                 "partial_rotary_factor": 0.5})
    vision = dict(depth=1, hidden_size=32, num_heads=2, patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=2,
                  out_hidden_size=128, intermediate_size=64, image_size=56)
    return transformers.Glm4vConfig(text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=VID,
                                    image_start_token_id=VS, image_end_token_id=VE, video_start_token_id=AS,
                                    video_end_token_id=AE)


def glm4v_moe_config():
    """GLM-4.5V: GLM-4.1V's sizes with 4 routed experts (top 2) after one dense layer."""
    small = glm4v_config()
    text = {k: v for k, v in small.text_config.to_dict().items() if k != "model_type"}
    text.update(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                first_k_dense_replace=1, n_group=1, topk_group=1)
    return transformers.Glm4vMoeConfig(text_config=text, vision_config=small.vision_config.to_dict(),
                                       image_token_id=IMG, video_token_id=VID, image_start_token_id=VS,
                                       image_end_token_id=VE, video_start_token_id=AS, video_end_token_id=AE)


def ernie_config(section=(3, 3, 2)):
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, moe_num_experts=4, moe_k=2,
                moe_intermediate_size=[32, 32], moe_num_shared_experts=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(section)})
    vision = dict(depth=1, hidden_size=32, num_heads=2, patch_size=PATCH, spatial_merge_size=2, temporal_merge_size=2,
                  intermediate_size=64)
    return transformers.Ernie4_5_VLMoeConfig(text_config=text, vision_config=vision, image_token_id=IMG,
                                             video_token_id=VID, image_start_token_id=VS, image_end_token_id=VE,
                                             video_start_token_id=AS, video_end_token_id=AE)


def omni_config():
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=PATCH,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[0])
    audio = dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=32,
                 output_dim=64, max_source_positions=400, n_window=50)
    return transformers.Qwen2_5OmniThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio, audio_token_index=AUD, image_token_index=IMG,
        video_token_index=VID, vision_start_token_id=VS, audio_start_token_id=AS, audio_end_token_id=AE,
        position_id_per_seconds=25, seconds_per_chunk=2)


CONFIGS = {"glm4v": glm4v_config, "glm4v_moe": glm4v_moe_config, "ernie": ernie_config, "omni": omni_config}
MODEL_CLASSES = {"glm4v": "Glm4vForConditionalGeneration", "glm4v_moe": "Glm4vMoeForConditionalGeneration",
                 "ernie": "Ernie4_5_VLMoeForConditionalGeneration",
                 "omni": "Qwen2_5OmniThinkerForConditionalGeneration"}


def build(family, seed=0):
    torch.manual_seed(seed)
    return getattr(transformers, MODEL_CLASSES[family])(CONFIGS[family]()).eval()


def token_types(input_ids):
    """transformers' mm_token_type_ids: 0 text, 1 image, 2 video, 3 audio."""
    return ((input_ids == IMG) * 1 + (input_ids == VID) * 2 + (input_ids == AUD) * 3).to(torch.int32)


def pixels(grid, temporal_patch_size):
    """Random patch rows for a ``(1, 3)`` grid tensor: one row of ``3 * temporal * patch * patch`` per patch."""
    return torch.randn(int(grid.prod()), 3 * temporal_patch_size * PATCH * PATCH)


# -- transformers' own get_rope_index, without a model ------------------------------------------------
RULES = {
    "glm4v": ("glm4v.modeling_glm4v", "Glm4vModel", glm4v_config),
    "ernie": ("ernie4_5_vl_moe.modeling_ernie4_5_vl_moe", "Ernie4_5_VLMoeModel", ernie_config),
    "omni": ("qwen2_5_omni.modeling_qwen2_5_omni", "Qwen2_5OmniPreTrainedModelForConditionalGeneration",
             omni_config),
}


def rope_index(family, **changes):
    """``get_rope_index`` of ``family`` bound to a stand-in holding its config (vision config fields overridable)."""
    module, name, config = RULES[family]
    model_class = getattr(__import__(f"transformers.models.{module}", fromlist=[name]), name)
    cfg = config()
    for key, value in changes.items():
        setattr(cfg.vision_config if family != "omni" else cfg, key, value)
    fake = types.SimpleNamespace(config=cfg, spatial_merge_size=2)
    for method in ("get_vision_position_ids", "get_llm_pos_ids_for_vision", "get_chunked_index"):
        if hasattr(model_class, method):
            setattr(fake, method, functools.partial(getattr(model_class, method), fake))
    return functools.partial(model_class.get_rope_index, fake)


def pad_left(rows):
    width = max(map(len, rows))
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        input_ids[b, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[b, width - len(row):] = 1
    return input_ids, mask


def random_batch(rng, family, *, batch=3, temporal_merge=2):
    """GLM-4V / ERNIE-4.5-VL rows of text, images and videos: ``(input_ids, mask, images, videos)``.

    GLM-4V's videos are laid out frame by frame with a timestamp between frames (as its processor
    does); ERNIE's as one run of ``t // temporal_merge * h/2 * w/2`` tokens.
    """
    rows, images, videos = [], [], []
    for _ in range(batch):
        ids = [rng.randrange(10, 100) for _ in range(rng.randrange(0, 4))]
        for _ in range(rng.randrange(1, 4)):
            choice = rng.choice(["image", "video", "text"])
            if choice == "text":
                ids += [rng.randrange(10, 100) for _ in range(rng.randrange(1, 5))]
            elif choice == "image":
                grid = (1, 2 * rng.randrange(1, 4), 2 * rng.randrange(1, 4))
                images.append(grid)
                ids += [VS] + [IMG] * (grid[1] * grid[2] // 4) + [VE]
            else:
                grid = (rng.randrange(temporal_merge, 8), 2 * rng.randrange(1, 3), 2 * rng.randrange(1, 3))
                videos.append(grid)
                per_frame = grid[1] * grid[2] // 4
                if family == "glm4v":
                    for _ in range(grid[0]):
                        ids += [rng.randrange(10, 100), AS] + [VID] * per_frame + [AE]
                else:
                    ids += [AS] + [VID] * (grid[0] // temporal_merge * per_frame) + [AE]
        rows.append(ids)
    return (*pad_left(rows), images, videos)


# -- Qwen2.5-Omni: a video with its audio, laid out by the processor's own code -----------------------
def video_with_audio_tokens(grid, seconds, audio_tokens, *, position_id_per_seconds=25, seconds_per_chunk=2):
    """The processor's token layout of a video with its soundtrack: ``<audio start> chunks <audio end>``."""
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor

    processor = types.SimpleNamespace(audio_bos_token="A", audio_eos_token="E", video_token="V", audio_token="a",
                                      video_processor=types.SimpleNamespace(merge_size=2))
    processor.get_chunked_index = functools.partial(Qwen2_5OmniProcessor.get_chunked_index, processor)
    text = Qwen2_5OmniProcessor.replace_video_with_audio_token(
        processor, {"video_grid_thw": [list(grid)], "video_second_per_grid": [seconds]}, 0,
        {"num_audio_tokens": [audio_tokens]}, 0, position_id_per_seconds=position_id_per_seconds,
        seconds_per_chunk=seconds_per_chunk)
    return [{"A": AS, "E": AE, "V": VID, "a": AUD}[c] for c in text]


def audio_feature_length(tokens):
    """A mel length whose audio encoder output is ``tokens`` long: ``((L - 1) // 2 + 1 - 2) // 2 + 1``."""
    return 4 * tokens


SECONDS = (0.5, 1.0, 1.5, 2.0, 0.64)


def omni_batch(rng, *, use_audio_in_video, batch=3):
    """Rows of text, images, videos and audio: ``(input_ids, mask, images, videos, seconds, audio_lengths)``."""
    rows, images, videos, seconds, audio = [], [], [], [], []
    for _ in range(batch):
        ids = [rng.randrange(10, 100) for _ in range(rng.randrange(0, 4))]
        for _ in range(rng.randrange(0, 4)):
            choice = rng.choice(["image", "video", "audio", "text"])
            if choice == "text":
                ids += [rng.randrange(10, 100) for _ in range(rng.randrange(1, 4))]
            elif choice == "image":
                grid = (1, 2 * rng.randrange(1, 4), 2 * rng.randrange(1, 4))
                images.append(grid)
                ids += [VS] + [IMG] * (grid[1] * grid[2] // 4) + [VE]
            elif choice == "audio":
                tokens = rng.randrange(1, 30)
                audio.append(audio_feature_length(tokens))
                ids += [AS] + [AUD] * tokens + [AE]
            else:
                grid = (rng.randrange(1, 6), 2 * rng.randrange(1, 3), 2 * rng.randrange(1, 3))
                videos.append(grid)
                seconds.append(rng.choice(SECONDS))
                if use_audio_in_video:
                    tokens = rng.randrange(1, 200)
                    audio.append(audio_feature_length(tokens))
                    ids += [VS] + video_with_audio_tokens(grid, seconds[-1], tokens) + [VE]
                else:
                    ids += [VS] + [VID] * (grid[0] * grid[1] * grid[2] // 4) + [VE]
        rows.append(ids or [rng.randrange(10, 100)])
    return (*pad_left(rows), images, videos, seconds, audio)
