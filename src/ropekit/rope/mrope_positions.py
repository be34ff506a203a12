"""The (t, h, w) positions of Qwen-VL, GLM-4V and ERNIE-4.5-VL sequences mixing text, images and videos.

The rule (transformers 5.23's ``get_rope_index``, which :func:`mrope_position_ids` equals): walk the
valid tokens of a row, grouped into runs of one modality, with a running position ``cur = 0``:

- a text run of length ``L`` gets ``cur + arange(L)`` on all three axes, then ``cur += L``;
- a vision run takes the next grid ``(t, h, w)`` of its modality (images and videos each consumed in
  order across the batch) and gets :func:`~ropekit.rope.grids.vision_block_positions` starting at
  ``cur``; then ``cur += max(h, w) // spatial_merge_size``. The temporal extent does not advance
  ``cur``: text after a video of many frames continues from the block's spatial extent, and
  can share positions with the video's later frames (transformers 4.x continued from the largest
  position + 1; see docs/multiaxis.md);
- padding (``attention_mask == 0``) stays at position 0, and ``delta = max(position) + 1 - valid tokens``
  is what decoding adds to the cache length for the tokens that follow (:func:`mrope_next_positions`).

Per family: Qwen2-VL advances time by 1 per frame; Qwen2.5-VL by ``tokens_per_second *
second_per_grid_ts[i]`` (float32, truncated); Qwen3-VL splits every video into ``t`` one-frame
grids, so each frame is its own run (real prompts put timestamps between frames), and GLM-4.1V /
GLM-4.5V do exactly the same (their ``get_rope_index`` is Qwen3-VL's); ERNIE-4.5-VL merges
``temporal_merge_size`` frames into one temporal token (a video grid ``(t, h, w)`` is the block
``(t // temporal_merge_size, h, w)``, time advancing by 1).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from .grids import axis_grids, check_merge_size, vision_block_positions

#: Model types whose position rule :func:`mrope_position_ids` implements (and aliases of them).
FAMILIES = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl",
            "glm4v": "qwen3_vl", "glm4v_moe": "qwen3_vl", "ernie4_5_vl_moe": "ernie4_5_vl_moe"}
TEXT, IMAGE, VIDEO = 0, 1, 2


def check_token_types(mm_token_type_ids: Any, attention_mask: Any, *,
                      names: tuple[str, ...] = ("text", "image", "video")) -> tuple[torch.Tensor, torch.Tensor]:
    """``(types, mask)`` on the CPU (mask bool), checked: integer ``(batch, seq)`` types in ``[0, len(names))``."""
    types = mm_token_type_ids
    spelled = ", ".join(f"{i} {name}" for i, name in enumerate(names))
    if not isinstance(types, torch.Tensor) or types.dim() != 2 or types.dtype.is_floating_point or types.is_complex():
        raise ValueError(f"mm_token_type_ids must be an integer (batch, seq) tensor ({spelled}), got "
                         f"{getattr(types, 'dtype', type(types).__name__)} {tuple(getattr(types, 'shape', ()))}")
    if types.numel() and not bool(((types >= 0) & (types < len(names))).all()):
        raise ValueError(f"mm_token_type_ids must hold {spelled}, got {types.unique().tolist()}")
    if attention_mask is None:
        return types.cpu(), torch.ones(types.shape, dtype=torch.bool)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != types.shape:
        raise ValueError(f"attention_mask must be a tensor of mm_token_type_ids' shape {tuple(types.shape)}, got "
                         f"{tuple(getattr(attention_mask, 'shape', ()))}")
    mask = attention_mask.cpu()
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (token) only")
    return types.cpu(), mask.bool()


def _video_queue(family: str, video_grid_thw: Any, tokens_per_second: Any, second_per_grid_ts: Any,
                 temporal_merge_size: Any) -> list:
    videos = axis_grids(video_grid_thw, "video_grid_thw") if video_grid_thw is not None else []
    if family == "qwen3_vl":
        return [((1, h, w), 1) for (t, h, w) in videos for _ in range(t)]
    if family == "ernie4_5_vl_moe" and videos:
        if isinstance(temporal_merge_size, bool) or not isinstance(temporal_merge_size, int) or temporal_merge_size < 1:
            raise ValueError("ernie4_5_vl_moe videos need temporal_merge_size, a positive int (the vision_config's, "
                             f"2 in the released models), got {temporal_merge_size!r}")
        for i, (t, _, _) in enumerate(videos):
            if t < temporal_merge_size:
                raise ValueError(f"video_grid_thw[{i}] has t={t} frames, fewer than temporal_merge_size="
                                 f"{temporal_merge_size} (no temporal token)")
        return [((t // temporal_merge_size, h, w), 1) for (t, h, w) in videos]
    if family == "qwen2_vl" or not videos:
        return [(grid, 1) for grid in videos]
    if tokens_per_second is None:
        raise ValueError("qwen2_5_vl videos need tokens_per_second (the vision_config's, 2 in the released models)")
    seconds = [1] * len(videos) if second_per_grid_ts is None else list(second_per_grid_ts)
    if len(seconds) != len(videos):
        raise ValueError(f"second_per_grid_ts has {len(seconds)} entries for {len(videos)} videos")
    return [(grid, tokens_per_second * s) for grid, s in zip(videos, seconds, strict=True)]


def mrope_position_ids(
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: Any = None,
    video_grid_thw: Any = None,
    *,
    spatial_merge_size: int,
    family: str,
    attention_mask: torch.Tensor | None = None,
    tokens_per_second: float | None = None,
    second_per_grid_ts: Any = None,
    temporal_merge_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``(batch, seq, 3)`` (t, h, w) and decoding deltas ``(batch, 1)`` of a multimodal batch.

    Args:
        mm_token_type_ids: integer ``(batch, seq)``: 0 text, 1 image, 2 video (the processor's output).
        image_grid_thw, video_grid_thw: ``(n, 3)`` patches per image / video, in order of appearance
            across the batch (the processor's outputs).
        spatial_merge_size: the vision config's ``spatial_merge_size`` (2 in the released models).
        family: ``"qwen2_vl"``, ``"qwen2_5_vl"``, ``"qwen3_vl"`` (``"qwen3_vl_moe"``), ``"glm4v"``
            (``"glm4v_moe"``) or ``"ernie4_5_vl_moe"``.
        attention_mask: ``(batch, seq)`` 1 for tokens, 0 for padding (left or right).
        tokens_per_second: Qwen2.5-VL's ``vision_config.tokens_per_second``.
        second_per_grid_ts: Qwen2.5-VL, seconds per temporal grid of each video (default 1).
        temporal_merge_size: ERNIE-4.5-VL's ``vision_config.temporal_merge_size`` (frames per temporal
            token, 2 in the released models); required for its videos.

    Returns:
        ``(positions, deltas)``: int64 ``(batch, seq, 3)`` (transformers' ``(3, batch, seq)`` is
        ``positions.permute(2, 0, 1)``) and int64 ``(batch, 1)``, on ``mm_token_type_ids``' device.

    Raises:
        ValueError: a vision run whose length does not match its grid, more runs than grids or grids
            left over, a row without tokens, unknown family, bad shapes or values.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    family, m = FAMILIES[family], check_merge_size(spatial_merge_size)
    types, mask = check_token_types(mm_token_type_ids, attention_mask)
    image_grids = axis_grids(image_grid_thw, "image_grid_thw") if image_grid_thw is not None else []
    images = [(grid, 1) for grid in image_grids]
    videos = _video_queue(family, video_grid_thw, tokens_per_second, second_per_grid_ts, temporal_merge_size)
    queues = {IMAGE: iter(images), VIDEO: iter(videos)}
    used = {IMAGE: 0, VIDEO: 0}
    positions = torch.zeros(*types.shape, 3, dtype=torch.int64)
    deltas = []
    for b in range(types.shape[0]):
        keep = mask[b]
        if not bool(keep.any()):
            raise ValueError(f"row {b} of the batch has no token (attention_mask is all 0)")
        cur, blocks = 0, []
        for kind, run in itertools.groupby(types[b][keep].tolist()):
            length = len(list(run))
            if kind == TEXT:
                blocks.append((torch.arange(length) + cur)[:, None].expand(length, 3))
                cur += length
                continue
            name = "image" if kind == IMAGE else "video"
            try:
                grid, step = next(queues[kind])
            except StopIteration:
                raise ValueError(
                    f"row {b} has more {name} runs than {name}_grid_thw has grids ({used[kind]})") from None
            used[kind] += 1
            tokens = grid[0] * (grid[1] // m) * (grid[2] // m)  # checked before the block is built
            if tokens != length:
                raise ValueError(f"row {b}: a run of {length} {name} tokens does not match its grid {grid} "
                                 f"({tokens} tokens at spatial_merge_size={m})")
            blocks.append(vision_block_positions(grid, spatial_merge_size=m, time_step=step, start=cur))
            cur += max(grid[1], grid[2]) // m
        row = torch.cat(blocks)
        positions[b, keep] = row
        deltas.append(int(row.max()) + 1 - int(keep.sum()))
    for kind, queue in queues.items():
        left = sum(1 for _ in queue)
        if left:
            name = "image" if kind == IMAGE else "video"
            raise ValueError(f"{name}_grid_thw has {left} grid(s) more than the batch has {name} runs")
    device = mm_token_type_ids.device
    return positions.to(device), torch.tensor(deltas, dtype=torch.int64, device=device)[:, None]


def mrope_next_positions(deltas: torch.Tensor, past_length: int, length: int = 1) -> torch.Tensor:
    """Positions ``(batch, length, 3)`` of text tokens generated after a multimodal prompt.

    ``past_length + deltas + arange(length)`` on all three axes (the decoding rule of the Qwen-VL
    models), where ``deltas`` comes from :func:`mrope_position_ids` and ``past_length`` is the
    number of tokens already in the cache.
    """
    if not isinstance(deltas, torch.Tensor) or deltas.dim() != 2 or deltas.shape[1] != 1:
        shown = getattr(deltas, "shape", deltas)
        raise ValueError(f"deltas must be a (batch, 1) tensor from mrope_position_ids, got {shown}")
    for name, value in (("past_length", past_length), ("length", length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    steps = past_length + deltas.to(torch.int64) + torch.arange(length)
    return steps[..., None].expand(*steps.shape, 3)
