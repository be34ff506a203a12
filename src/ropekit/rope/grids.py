"""Positions of patches: image and video grids, ViT prefix tokens, resolution change, Qwen's merge blocks.

Every function returns a ``(tokens, n_axes)`` tensor, tokens in row-major order over the grid
(t-major for videos), ready for :meth:`ropekit.AxisPlan.cos_sin`. Integral grids are int64,
fractional ones float64.

Resolution change. A vision model trained on one grid and run on another either *extrapolates*
(the new grid's patches keep their integer indices, so positions run past the trained range) or
*interpolates* (indices are rescaled by ``trained / new`` so they span the trained range, as timm's
``ref_feat_shape`` does for EVA-02). :func:`patch_grid` makes the caller choose: ``trained_shape``
without ``resize`` is an error. The ``"pixel"`` and ``"centered"`` grids are in ``[-1, 1]`` at
every resolution (they interpolate by construction).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..validation import check_positive_float

GRID_KINDS = ("index", "pixel", "centered")
RESIZE_MODES = ("interpolate", "extrapolate")
#: The most patches one grid may have (an hour of video in Qwen2.5-VL is about 2 million): the
#: position tensors are ``patches x axes`` int64 or float64, so a typo must fail before it allocates.
MAX_GRID_PATCHES = 1 << 24


def _shape(shape: Any, name: str = "shape") -> tuple[int, ...]:
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence) or not shape:
        raise ValueError(f"{name} must be a non-empty sequence of positive ints, e.g. (h, w), got {shape!r}")
    for i, s in enumerate(shape):
        if isinstance(s, bool) or not isinstance(s, int) or s <= 0:
            raise ValueError(f"{name}[{i}] must be a positive int, got {s!r} (in {tuple(shape)})")
    if math.prod(shape) > MAX_GRID_PATCHES:
        raise ValueError(f"{name} {tuple(shape)} has {math.prod(shape):,} patches; at most {MAX_GRID_PATCHES:,} "
                         "(2**24) per grid")
    return tuple(shape)


def _per_axis(value: Any, n: int, name: str, *, positive: bool) -> tuple[float, ...]:
    values = tuple(value) if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) else (value,) * n
    if len(values) != n:
        raise ValueError(f"{name} must be one number or one per axis ({n}), got {value!r}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} must be finite numbers, got {value!r}")
        out.append(check_positive_float(v, name) if positive else float(v))
    return tuple(out)


def _axis_coordinates(size: int, kind: str, offset: float, step: float, scale: float) -> torch.Tensor:
    index = torch.arange(size, dtype=torch.float64)
    if kind == "pixel":
        return torch.linspace(-1.0, 1.0, size, dtype=torch.float64)
    if kind == "centered":
        return (index + 0.5 + offset) / size * 2 - 1
    return (index + offset) * step * scale


def patch_grid(
    shape: Sequence[int],
    *,
    kind: str = "index",
    offset: float | Sequence[float] = 0.0,
    step: float | Sequence[float] = 1.0,
    trained_shape: Sequence[int] | None = None,
    resize: str | None = None,
    indexing: str = "ij",
    prefix_tokens: int = 0,
) -> torch.Tensor:
    """Positions of the patches of an image ``(h, w)`` or a video ``(t, h, w)`` (any number of axes).

    Args:
        shape: patches per axis, e.g. ``(h, w)`` or ``(t, h, w)``; tokens are row-major over it.
        kind: ``"index"``: ``(i + offset) * step``; ``"pixel"``: ``linspace(-1, 1, size)`` per axis
            (rotary-embedding-torch and timm pixel grids); ``"centered"``: ``((i + 0.5 + offset) / size)
            * 2 - 1`` (DINOv3).
        offset: added to each index (one number or one per axis; ``"index"`` and ``"centered"``).
        step: spacing of each axis (``"index"``), e.g. ``(2.0, 1, 1)`` for two time units per frame.
        trained_shape: the grid the model was trained on (``"index"`` only); with it, ``resize`` is required.
        resize: ``"interpolate"`` rescales axis ``a`` by ``trained_shape[a] / shape[a]`` (timm's
            ``ref_feat_shape``); ``"extrapolate"`` keeps the indices.
        indexing: ``"ij"``: coordinates in ``shape`` order; ``"xy"``: the first two swapped (x = column
            first, as timm's and rope-vit's ``grid_indexing='xy'``). Tokens stay row-major.
        prefix_tokens: class / register tokens put first with position vector 0 (angle 0: the
            identity, i.e. not rotated, as timm and rope-vit leave them).

    Returns:
        ``(prefix_tokens + prod(shape), len(shape))``: int64 when every coordinate is an integer
        by construction, else float64.
    """
    dims = _shape(shape)
    if kind not in GRID_KINDS:
        raise ValueError(f"kind must be one of {GRID_KINDS}, got {kind!r}")
    if indexing not in ("ij", "xy") or (indexing == "xy" and len(dims) < 2):
        raise ValueError(f"indexing must be 'ij' or 'xy' ('xy' needs two axes or more), got {indexing!r}")
    if (isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, int) or not
            0 <= prefix_tokens <= MAX_GRID_PATCHES):
        raise ValueError(f"prefix_tokens must be an int in [0, {MAX_GRID_PATCHES:,}], got {prefix_tokens!r}")
    offsets = _per_axis(offset, len(dims), "offset", positive=False)
    steps = _per_axis(step, len(dims), "step", positive=True)
    scales = _resize_scales(dims, kind, trained_shape, resize)
    if kind == "pixel" and (any(offsets) or any(s != 1.0 for s in steps)):
        raise ValueError("kind='pixel' grids are linspace(-1, 1); offset and step do not apply")
    if kind == "centered" and any(s != 1.0 for s in steps):
        raise ValueError("kind='centered' grids are normalised to [-1, 1]; step does not apply")
    axes = [_axis_coordinates(n, kind, o, s, c) for n, o, s, c in zip(dims, offsets, steps, scales, strict=True)]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, len(dims))
    if indexing == "xy":
        grid = grid[:, [1, 0, *range(2, len(dims))]]
    integral = kind == "index" and all(float(v).is_integer() for v in (*offsets, *steps, *scales))
    if integral:
        grid = grid.round().to(torch.int64)
    if prefix_tokens:
        grid = torch.cat([torch.zeros(prefix_tokens, len(dims), dtype=grid.dtype), grid])
    return grid


def _resize_scales(dims: tuple[int, ...], kind: str, trained_shape: Any, resize: Any) -> tuple[float, ...]:
    if trained_shape is None:
        if resize is not None:
            raise ValueError(f"resize={resize!r} needs trained_shape (the grid the model was trained on)")
        return (1.0,) * len(dims)
    trained = _shape(trained_shape, "trained_shape")
    if len(trained) != len(dims):
        raise ValueError(f"trained_shape {trained} must have one size per axis of shape {dims}")
    if kind != "index":
        raise ValueError(f"trained_shape applies to kind='index' grids; kind={kind!r} spans [-1, 1] at any size")
    if resize is None and trained == dims:
        return (1.0,) * len(dims)  # the trained grid itself: both choices agree
    if resize not in RESIZE_MODES:
        raise ValueError(
            f"shape={dims} differs from trained_shape={trained}: pass resize='interpolate' (rescale positions "
            f"onto the trained range, timm's ref_feat_shape) or resize='extrapolate' (keep the indices), got "
            f"resize={resize!r}"
        )
    if resize == "extrapolate":
        return (1.0,) * len(dims)
    return tuple(t / n for t, n in zip(trained, dims, strict=True))


def axis_grids(grid_thw: Any, name: str = "grid_thw") -> list[tuple[int, int, int]]:
    """``grid_thw`` (a tensor or a sequence of ``(t, h, w)`` rows) as checked tuples of positive ints."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise TypeError(f"{name} must be a (n, 3) integer tensor or a list of (t, h, w), got {type(grid_thw).__name__}")
    if rows and not isinstance(rows[0], Sequence):
        rows = [rows]  # one grid
    out = []
    for i, row in enumerate(rows):
        if len(row) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in row):
            raise ValueError(f"{name}[{i}] must be three positive ints (t, h, w), got {row!r}")
        if math.prod(row) > MAX_GRID_PATCHES:
            raise ValueError(f"{name}[{i}] = {tuple(row)} has {math.prod(row):,} patches; at most "
                             f"{MAX_GRID_PATCHES:,} (2**24) per grid")
        out.append(tuple(row))
    return out


def check_merge_size(value: Any) -> int:
    """``spatial_merge_size``: a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"spatial_merge_size must be a positive int, got {value!r}")
    return value


def vision_patch_positions(grid_thw: Any, spatial_merge_size: int = 1) -> torch.Tensor:
    """(row, col) of every patch in the order Qwen's vision towers see them: merge block by merge block.

    Args:
        grid_thw: ``(n, 3)`` patches per image or video (t, h, w), or one ``(t, h, w)``; ``h`` and
            ``w`` multiples of ``spatial_merge_size``.
        spatial_merge_size: ``m``; the ``m x m`` patches a merger folds into one language-model token
            are consecutive (blocks in raster order, raster order inside a block), every frame alike.

    Returns:
        int64 ``(sum t*h*w, 2)`` (equal to ``transformers.vision_utils.get_vision_position_ids``).
    """
    m = check_merge_size(spatial_merge_size)
    out = []
    for i, (t, h, w) in enumerate(axis_grids(grid_thw)):
        if h % m or w % m:
            raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: h and w must be multiples of spatial_merge_size={m}")
        block_row, block_col, row, col = torch.meshgrid(
            torch.arange(h // m), torch.arange(w // m), torch.arange(m), torch.arange(m), indexing="ij")
        frame = torch.stack([(block_row * m + row).reshape(-1), (block_col * m + col).reshape(-1)], dim=-1)
        out.append(frame.repeat(t, 1))
    return torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.int64)


def vision_block_positions(
    grid_thw: Sequence[int] | torch.Tensor,
    *,
    spatial_merge_size: int = 1,
    time_step: Any = 1,
    start: int = 0,
) -> torch.Tensor:
    """(t, h, w) positions of one image or video inside a Qwen-VL language-model sequence.

    Args:
        grid_thw: ``(t, h, w)`` in patches (the processor's ``image_grid_thw`` / ``video_grid_thw`` row).
        spatial_merge_size: ``m``: the language model sees ``(h / m) x (w / m)`` tokens per frame.
        time_step: time units per frame: 1 (Qwen2-VL, images), or Qwen2.5-VL's ``tokens_per_second *
            second_per_grid_t``; frame ``i`` gets ``int(i * time_step)`` computed in float32 (a float
            or 0-d float32 tensor) and truncated, exactly as transformers does.
        start: the position the block starts at (the text before it).

    Returns:
        int64 ``(t * h/m * w/m, 3)``, t-major: ``(start + int(i * time_step), start + r, start + c)``.
    """
    ((t, h, w),) = axis_grids([list(grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw)])
    m = check_merge_size(spatial_merge_size)
    if isinstance(start, bool) or not isinstance(start, int):
        raise ValueError(f"start must be an int, got {start!r}")
    frames = (torch.arange(t) * time_step).long() + start  # float32 arithmetic for a float step, truncated
    rows, cols = torch.arange(h // m) + start, torch.arange(w // m) + start
    grid = torch.meshgrid(frames, rows, cols, indexing="ij")
    return torch.stack([g.reshape(-1) for g in grid], dim=-1)


def patch_grid_thw(
    frames: int, height: int, width: int, *, patch_size: int, temporal_patch_size: int = 1
) -> tuple[int, int, int]:
    """``(t, h, w)`` in patches of a video (or an image: ``frames=1``) cut as Qwen-VL's processors cut it.

    ``t = frames // temporal_patch_size`` (each patch spans ``temporal_patch_size`` frames; an image
    counts as one temporal patch), ``h = height // patch_size``, ``w = width // patch_size``. The
    language model then sees ``t * (h / m) * (w / m)`` tokens (``m`` = spatial_merge_size), and
    Qwen2.5-VL's time step per temporal patch is ``tokens_per_second * temporal_patch_size / fps``
    (``second_per_grid_ts = temporal_patch_size / fps``; see :func:`vision_block_positions`).

    Raises:
        ValueError: sizes that are not positive multiples (the processors resize and pad first).
    """
    for name, value in (("frames", frames), ("height", height), ("width", width), ("patch_size", patch_size),
                        ("temporal_patch_size", temporal_patch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if height % patch_size or width % patch_size:
        raise ValueError(f"height and width must be multiples of patch_size={patch_size}, got {height} x {width} "
                         "(resize first, as the processor does)")
    if frames > 1 and frames % temporal_patch_size:
        raise ValueError(f"frames must be a multiple of temporal_patch_size={temporal_patch_size}, got {frames} "
                         "(the processor repeats the last frame to pad)")
    return max(frames // temporal_patch_size, 1), height // patch_size, width // patch_size
