"""Tiny random-weight Qwen2-VL / Qwen2.5-VL / Qwen3-VL models built from configs (no downloads), and inputs.

Text: hidden 64, 4 heads of 16 channels (8 rotary pairs; mrope_section [2, 3, 3]), 2 layers, a
vocabulary of 256 with the special tokens inside it. Vision towers of one or two blocks.
``inputs`` builds text + one image + one video without a processor: ``pixel_values`` hold one row
per patch, and every vision block sits between vision-start and vision-end tokens.
"""

import functools
import types

import torch
import transformers

transformers.logging.set_verbosity_error()

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
IMG, VID, VS, VE = 250, 251, 252, 253
TOKENS = {"image_token_id": IMG, "video_token_id": VID, "vision_start_token_id": VS, "vision_end_token_id": VE}
SECTION = [2, 3, 3]


def text_config(kind, section=SECTION):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(section)}
    if kind == "qwen3_vl":
        rope["mrope_interleaved"] = True
    return dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rope_parameters=rope)


def config(kind, section=SECTION):
    text = text_config(kind, section)
    if kind == "qwen2_vl":
        vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        return transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **TOKENS)
    if kind == "qwen2_5_vl":
        vision = dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=2, window_size=112,
                      fullatt_block_indexes=[0])
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **TOKENS)
    vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64, deepstack_visual_indexes=[0])
    return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **TOKENS)


MODEL_CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                 "qwen3_vl": "Qwen3VLForConditionalGeneration"}


def build(kind, seed=0):
    torch.manual_seed(seed)
    return getattr(transformers, MODEL_CLASSES[kind])(config(kind)).eval()


def inputs(model, kind, *, image=(1, 4, 6), video=(2, 4, 4)):
    """Text + one image + one video (grids in patches), as a processor would give them."""
    vc = model.config.vision_config
    p, tp, m = vc.patch_size, vc.temporal_patch_size, vc.spatial_merge_size
    img, vid = torch.tensor([image]), torch.tensor([video])
    ids = [1, 2, 3, VS] + [IMG] * (int(img.prod()) // m**2) + [VE, 4, 5]
    per_frame = video[1] * video[2] // m**2
    if kind == "qwen3_vl":  # one run per frame, separated by (timestamp) text
        for _ in range(video[0]):
            ids += [7, VS] + [VID] * per_frame + [VE]
    else:
        ids += [VS] + [VID] * (video[0] * per_frame) + [VE]
    ids += [6, 7, 8]
    input_ids = torch.tensor([ids])
    kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                  mm_token_type_ids=token_types(input_ids),
                  pixel_values=torch.randn(int(img.prod()), 3 * tp * p * p), image_grid_thw=img,
                  pixel_values_videos=torch.randn(int(vid.prod()), 3 * tp * p * p), video_grid_thw=vid)
    if kind == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = torch.tensor([1.5])
    return kwargs


def token_types(input_ids):
    return ((input_ids == IMG) * 1 + (input_ids == VID) * 2).to(torch.int32)


def rope_index(kind, vision_config=None):
    """transformers' own ``get_rope_index`` of ``kind``, called without building a model."""
    module = {"qwen2_vl": "qwen2_vl.modeling_qwen2_vl", "qwen2_5_vl": "qwen2_5_vl.modeling_qwen2_5_vl",
              "qwen3_vl": "qwen3_vl.modeling_qwen3_vl"}[kind]
    name = {"qwen2_vl": "Qwen2VLModel", "qwen2_5_vl": "Qwen2_5_VLModel", "qwen3_vl": "Qwen3VLModel"}[kind]
    model_class = getattr(__import__(f"transformers.models.{module}", fromlist=[name]), name)
    cfg = config(kind)
    for key, value in (vision_config or {}).items():
        setattr(cfg.vision_config, key, value)
    fake = types.SimpleNamespace(config=cfg)
    fake.get_vision_position_ids = functools.partial(model_class.get_vision_position_ids, fake)
    return functools.partial(model_class.get_rope_index, fake)


def random_batch(rng, kind, *, merge=2, batch=3):
    """Left-padded rows of text, images and videos: ``(input_ids, mask, images, videos, seconds)``."""
    rows, images, videos, seconds = [], [], [], []
    for _ in range(batch):
        ids = [rng.randrange(10, 100) for _ in range(rng.randrange(0, 4))]
        for _ in range(rng.randrange(1, 4)):
            choice = rng.choice(["image", "video", "text"])
            if choice == "text":
                ids += [rng.randrange(10, 100) for _ in range(rng.randrange(1, 5))]
            elif choice == "image":
                grid = (1, merge * rng.randrange(1, 4), merge * rng.randrange(1, 4))
                images.append(grid)
                ids += [VS] + [IMG] * (grid[1] * grid[2] // merge**2) + [VE]
            else:
                grid = (rng.randrange(1, 6), merge * rng.randrange(1, 3), merge * rng.randrange(1, 3))
                videos.append(grid)
                seconds.append(rng.choice([0.5, 1.0, 1.5, 2 / 3, 7.0]))
                per_frame = grid[1] * grid[2] // merge**2
                if kind == "qwen3_vl":
                    for _ in range(grid[0]):
                        ids += [rng.randrange(10, 100), VS] + [VID] * per_frame + [VE]
                else:
                    ids += [VS] + [VID] * (grid[0] * per_frame) + [VE]
        rows.append(ids)
    width = max(map(len, rows))
    input_ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for b, row in enumerate(rows):
        input_ids[b, width - len(row):] = torch.tensor(row)
        mask[b, width - len(row):] = 1
    return input_ids, mask, images, videos, seconds
