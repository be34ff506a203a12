"""The (t, h, w) positions of Qwen2.5-Omni sequences: text, images, videos and audio, aligned in time.

The rule (transformers 5.23's ``Qwen2_5OmniPreTrainedModelForConditionalGeneration.get_rope_index``,
which :func:`omni_position_ids` equals). Every item of a row sits between a start token and an end
token (text to the model); a running position ``cur`` starts at 0 and always continues from the
**largest position of the previous piece + 1** (not from a spatial extent, as Qwen2.5-VL in
transformers 5 does):

- text and audio get ``cur, cur + 1, ...`` on all three axes (an audio clip is a run of tokens
  one position apart: 25 positions per second of sound, the audio encoder's rate);
- an image or a video is a block over its ``(t, h / m, w / m)`` grid: ``t = cur + t_index[i]``,
  ``h = cur + row``, ``w = cur + col``, t-major, with ``t_index = int(i * position_id_per_seconds)``
  for an image (``i = 0`` for the usual one-frame image) and ``int(i * second_per_grid_ts[v] *
  position_id_per_seconds)`` for a video (float32, truncated): **one position per 1/25 s**, the
  audio's clock, so that frame ``i`` and the sound heard at that time share ``t``;
- ``use_audio_in_video``: a video and its soundtrack are one item, ``<vision start> <audio start>
  [video chunk 0] [audio chunk 0] [video chunk 1] [audio chunk 1] ... <audio end> <vision end>``. The
  two start tokens share one position, the video block and the audio run both start at the next one
  (the same time origin), and both are cut into chunks of ``int(position_id_per_seconds *
  seconds_per_chunk)`` positions of time (transformers' ``get_chunked_index``: a chunk ends at the
  first token whose t reaches the next multiple); the chunks alternate video, audio. The two end
  tokens share the position after the last chunk's largest;
- padding (``attention_mask == 0``) is at position 1 (transformers fills it so), and
  ``delta = max(position) + 1 - tokens`` per row (over the valid tokens; with neither image nor video
  grids, transformers takes every position of the row, padding's 1 included, and so does this).

Token types are transformers' (``ProcessorMixin.create_mm_token_type_ids``): 0 text (start and end
tokens included), 1 image, 2 video, 3 audio.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from .grids import axis_grids, check_merge_size
from .mrope_positions import check_token_types

TEXT, IMAGE, VIDEO, AUDIO = 0, 1, 2, 3
NAMES = ("text", "image", "video", "audio")
#: Where transformers puts the padding tokens of a Qwen2.5-Omni batch.
PADDING_POSITION = 1


def _positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number (the thinker config's), got {value!r}")
    return value


def _block(t_index: torch.Tensor, grid: tuple[int, int, int], m: int, start: int) -> torch.Tensor:
    """``(3, t * h/m * w/m)`` int64: t-major ``(start + t_index[i], start + row, start + col)``."""
    rows, cols = grid[1] // m, grid[2] // m
    t, h, w = torch.meshgrid(t_index, torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack([t.reshape(-1), h.reshape(-1), w.reshape(-1)]) + start


def _run(start: int, length: int) -> torch.Tensor:
    """``(3, length)``: ``start + arange(length)`` on every axis."""
    return (torch.arange(length) + start).expand(3, length)


def time_chunks(times: list[int], per_chunk: int, origin: int) -> list[tuple[int, int]]:
    """``[(begin, end), ...]`` of ``times`` cut where ``time - origin`` reaches each next multiple of ``per_chunk``.

    transformers' ``get_chunked_index``, step for step: the ``k``-th cut (``k = 1, 2, ...``) falls
    at the first index after the previous cut whose time reaches ``k * per_chunk``; one cut per
    index at most, so a jump over several multiples gives one cut (and later chunks that are short).
    """
    chunks, begin, k = [], 0, 1
    for i, time in enumerate(times):
        if time - origin >= k * per_chunk:
            chunks.append((begin, i))
            begin, k = i, k + 1
    chunks.append((begin, len(times)))
    return chunks


class _Row:
    """The pieces of one row's positions, in token order (``(3, n)`` each), and the next position."""

    def __init__(self) -> None:
        self.pieces: list[torch.Tensor] = []

    @property
    def cur(self) -> int:
        return int(self.pieces[-1].max()) + 1 if self.pieces else 0

    def add(self, piece: torch.Tensor) -> None:
        self.pieces.append(piece)

    def text(self, length: int) -> None:
        if length:
            self.add(_run(self.cur, length))

    def shared(self) -> None:
        """Two tokens at one position (the start or the end pair of a video with its audio)."""
        self.add(_run(self.cur, 1).repeat(1, 2))


def _video_with_audio(row: _Row, kinds: list[int], video: torch.Tensor, per_chunk: int, where: str) -> None:
    """Interleave a video block and its audio run by chunks of time, checking the tokens follow that order."""
    n_audio = kinds.count(AUDIO)
    if n_audio == 0:
        raise ValueError(f"{where}: with use_audio_in_video every video needs its audio tokens next to it, found none")
    origin = row.cur
    video = video + origin
    audio = _run(origin, n_audio)
    video_chunks = time_chunks(video[0].tolist(), per_chunk, origin)
    audio_chunks = time_chunks(audio[0].tolist(), per_chunk, origin)
    expected = []
    for j in range(max(len(video_chunks), len(audio_chunks))):
        for chunks, source, kind in ((video_chunks, video, VIDEO), (audio_chunks, audio, AUDIO)):
            if j < len(chunks):
                begin, end = chunks[j]
                row.add(source[:, begin:end])
                expected += [kind] * (end - begin)
    if expected != kinds:
        raise ValueError(f"{where}: the video and audio tokens are not interleaved by chunks of {per_chunk} positions "
                         "of time (position_id_per_seconds * seconds_per_chunk) as the video's grid and its audio "
                         "length say")


def _next_grid(queues: dict, kind: int, b: int) -> tuple:
    try:
        return next(queues[kind])
    except StopIteration:
        raise ValueError(f"row {b} has more {NAMES[kind]} items than {NAMES[kind]}_grid_thw has grids") from None


def _t_index(kind: int, grid: tuple[int, int, int], seconds: Any, rate: float) -> torch.Tensor:
    """The temporal indices as transformers computes them: integers for images, float32 then truncated for videos."""
    if kind == IMAGE:
        return (torch.arange(grid[0]) * 1 * rate).long()
    return (torch.arange(grid[0]) * torch.tensor(seconds, dtype=torch.float32) * rate).long()


def _row_positions(kinds: list[int], queues: dict, options: dict, b: int) -> torch.Tensor:
    """``(3, len(kinds))`` positions of one row's valid tokens."""
    m, rate, per_chunk, with_audio = options["m"], options["rate"], options["per_chunk"], options["with_audio"]
    runs = [(kind, len(list(run))) for kind, run in itertools.groupby(kinds)]
    row, token, r, after_section = _Row(), 0, 0, False
    while r < len(runs):
        kind, length = runs[r]
        where = f"row {b}, token {token}"
        if kind in (TEXT, AUDIO):  # one position per token
            if after_section:  # the end pair of a video with its audio shares one position
                if kind != TEXT or length < 2:
                    raise ValueError(f"{where}: a video with its audio must be followed by its two end tokens")
                row.shared()
                length -= 2
            if with_audio and r + 1 < len(runs) and runs[r + 1][0] == VIDEO:  # so does the start pair of one
                if kind != TEXT or length < 2:
                    raise ValueError(f"{where}: a video with its audio must be preceded by its two start tokens")
                row.text(length - 2)
                row.shared()
            else:
                row.text(length)
            after_section, token, r = False, token + runs[r][1], r + 1
            continue
        if after_section:
            raise ValueError(f"{where}: a video with its audio must be followed by its two end tokens")
        grid, seconds = _next_grid(queues, kind, b)
        t_index = _t_index(kind, grid, seconds, rate)
        tokens = grid[0] * (grid[1] // m) * (grid[2] // m)
        if kind == VIDEO and with_audio:  # the maximal stretch of video and audio tokens is one item
            end = next((k for k in range(r, len(runs)) if runs[k][0] not in (VIDEO, AUDIO)), len(runs))
            length = sum(n for _, n in runs[r:end])
            section = kinds[token:token + length]
            if section.count(VIDEO) != tokens:
                raise ValueError(f"{where}: {section.count(VIDEO)} video tokens do not match the grid {grid} "
                                 f"({tokens} tokens at spatial_merge_size={m})")
            _video_with_audio(row, section, _block(t_index, grid, m, 0), per_chunk, where)
            after_section, r = True, end
        else:
            if length != tokens:
                raise ValueError(f"{where}: a run of {length} {NAMES[kind]} tokens does not match its grid {grid} "
                                 f"({tokens} tokens at spatial_merge_size={m})")
            row.add(_block(t_index, grid, m, row.cur))
            r += 1
        token += length
    if after_section:
        raise ValueError(f"row {b}: a video with its audio must be followed by its two end tokens")
    return torch.cat(row.pieces, dim=1)


def omni_position_ids(
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: Any = None,
    video_grid_thw: Any = None,
    *,
    spatial_merge_size: int,
    position_id_per_seconds: float,
    seconds_per_chunk: float | None = None,
    second_per_grid_ts: Any = None,
    use_audio_in_video: bool = False,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``(batch, seq, 3)`` (t, h, w) and decoding deltas ``(batch, 1)`` of a Qwen2.5-Omni batch.

    Args:
        mm_token_type_ids: integer ``(batch, seq)``: 0 text (start and end tokens included), 1 image,
            2 video, 3 audio (transformers' ``create_mm_token_type_ids``; from ``input_ids``:
            ``(ids == image_token_id) + 2 * (ids == video_token_id) + 3 * (ids == audio_token_id)``).
        image_grid_thw, video_grid_thw: ``(n, 3)`` patches per image / video, in order of appearance
            across the batch (the processor's outputs).
        spatial_merge_size: the vision config's ``spatial_merge_size`` (2).
        position_id_per_seconds: the thinker config's (25): positions of time per second.
        seconds_per_chunk: the thinker config's (2): the chunks of a video with its audio; required
            with ``use_audio_in_video``.
        second_per_grid_ts: seconds per temporal grid of each video (the processor's
            ``video_second_per_grid``); required when there are videos.
        use_audio_in_video: videos come with their soundtrack interleaved (see the module docstring).
        attention_mask: ``(batch, seq)`` 1 for tokens, 0 for padding (left or right).

    Returns:
        ``(positions, deltas)``: int64 ``(batch, seq, 3)`` (transformers' ``(3, batch, seq)`` is
        ``positions.permute(2, 0, 1)``) and int64 ``(batch, 1)``, on ``mm_token_type_ids``' device.
        :func:`~ropekit.rope.mrope_positions.mrope_next_positions` gives the positions of generated text.

    Raises:
        ValueError: runs that do not match their grids, a video with its audio out of chunk order or
            without its start/end tokens, grids left over, a row without tokens, bad shapes or values.
    """
    m = check_merge_size(spatial_merge_size)
    rate = _positive(position_id_per_seconds, "position_id_per_seconds")
    if not isinstance(use_audio_in_video, bool):
        raise TypeError(f"use_audio_in_video must be a bool, got {type(use_audio_in_video).__name__}")
    per_chunk = 0
    if use_audio_in_video:
        per_chunk = int(rate * _positive(seconds_per_chunk, "seconds_per_chunk"))
        if per_chunk < 1:
            raise ValueError(f"position_id_per_seconds * seconds_per_chunk must be at least 1 position, got "
                             f"{rate!r} * {seconds_per_chunk!r}")
    types, mask = check_token_types(mm_token_type_ids, attention_mask, names=NAMES)
    images = axis_grids(image_grid_thw, "image_grid_thw") if image_grid_thw is not None else []
    videos = axis_grids(video_grid_thw, "video_grid_thw") if video_grid_thw is not None else []
    seconds = [] if second_per_grid_ts is None else [float(s) for s in second_per_grid_ts]
    if videos and len(seconds) != len(videos):
        raise ValueError(f"second_per_grid_ts must give the seconds per temporal grid of each of the {len(videos)} "
                         f"videos, got {second_per_grid_ts!r}")
    queues = {IMAGE: iter([(grid, None) for grid in images]), VIDEO: iter(zip(videos, seconds, strict=False))}
    options = dict(m=m, rate=rate, per_chunk=per_chunk, with_audio=use_audio_in_video)
    positions = torch.full((*types.shape, 3), PADDING_POSITION, dtype=torch.int64)
    deltas = []
    for b in range(types.shape[0]):
        keep = mask[b]
        if not bool(keep.any()):
            raise ValueError(f"row {b} of the batch has no token (attention_mask is all 0)")
        row = _row_positions(types[b][keep].tolist(), queues, options, b).T
        positions[b, keep] = row
        largest = int(positions[b].max()) if image_grid_thw is None and video_grid_thw is None else int(row.max())
        deltas.append(largest + 1 - int(keep.sum()))
    for kind, queue in queues.items():
        left = sum(1 for _ in queue)
        if left:
            raise ValueError(f"{NAMES[kind]}_grid_thw has {left} grid(s) more than the batch has {NAMES[kind]} items")
    device = mm_token_type_ids.device
    return positions.to(device), torch.tensor(deltas, dtype=torch.int64, device=device)[:, None]
