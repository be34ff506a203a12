"""Patch grids and vision positions: worked examples, transformers' own helpers, and the explicit resize choice.

timm's ``_build_grid`` is checked as an oracle in tests/test_peer_timm.py (through the tables).
"""

import pytest
import torch

from ropekit.multiaxis import patch_grid, patch_grid_thw, vision_block_positions, vision_patch_positions


def test_index_grid_is_row_major_and_integral():
    grid = patch_grid((2, 3))
    assert grid.dtype == torch.int64
    assert grid.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    video = patch_grid((2, 2, 2), step=(3, 1, 1))
    assert video.dtype == torch.int64 and video[:, 0].tolist() == [0, 0, 0, 0, 3, 3, 3, 3]
    assert video[:, 2].tolist() == [0, 1] * 4


def test_xy_indexing_swaps_the_coordinates_not_the_tokens():
    assert patch_grid((2, 3), indexing="xy").tolist() == [[0, 0], [1, 0], [2, 0], [0, 1], [1, 1], [2, 1]]
    assert torch.equal(patch_grid((2, 3, 4), indexing="xy")[:, [1, 0, 2]], patch_grid((2, 3, 4)))


def test_prefix_tokens_get_position_zero_first():
    grid = patch_grid((2, 2), prefix_tokens=3)
    assert grid.shape == (7, 2) and grid[:3].abs().sum() == 0 and torch.equal(grid[3:], patch_grid((2, 2)))


def test_pixel_and_centered_grids_span_minus_one_to_one():
    pixel = patch_grid((3, 5), kind="pixel")
    assert pixel.dtype == torch.float64
    assert pixel[:5, 1].tolist() == [-1.0, -0.5, 0.0, 0.5, 1.0] and pixel[::5, 0].tolist() == [-1.0, 0.0, 1.0]
    centered = patch_grid((2, 4), kind="centered")  # DINOv3: ((i + 0.5) / s) * 2 - 1
    assert centered[:4, 1].tolist() == [-0.75, -0.25, 0.25, 0.75] and centered[::4, 0].tolist() == [-0.5, 0.5]


def test_resolution_change_is_an_explicit_choice():
    # trained on 4 x 4, run on 8 x 2: interpolation maps the new grid onto the trained range (timm's
    # ref_feat_shape), extrapolation keeps the indices
    inter = patch_grid((8, 2), trained_shape=(4, 4), resize="interpolate")
    extra = patch_grid((8, 2), trained_shape=(4, 4), resize="extrapolate")
    assert inter.dtype == torch.float64 and inter[::2, 0].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    assert inter[:2, 1].tolist() == [0.0, 2.0]
    assert torch.equal(extra, patch_grid((8, 2)))
    assert torch.equal(patch_grid((4, 4), trained_shape=(4, 4)), patch_grid((4, 4)))
    offset = patch_grid((2, 2), offset=0.5, trained_shape=(4, 4), resize="interpolate")
    assert offset.tolist() == [[1.0, 1.0], [1.0, 3.0], [3.0, 1.0], [3.0, 3.0]]
    with pytest.raises(ValueError, match="pass resize='interpolate'.*or resize='extrapolate'"):
        patch_grid((8, 2), trained_shape=(4, 4))


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(shape=(2, 0)), ["shape[1]", "positive", "0"]),
        (dict(shape=3), ["shape", "sequence", "3"]),
        (dict(shape=(2, 2), kind="polar"), ["kind", "'polar'"]),
        (dict(shape=(4,), indexing="xy"), ["'xy' needs two axes"]),
        (dict(shape=(2, 2), prefix_tokens=-1), ["prefix_tokens", "-1"]),
        (dict(shape=(2, 2), offset=(0.5,)), ["offset", "one per axis"]),
        (dict(shape=(2, 2), step=0), ["step", "> 0"]),
        (dict(shape=(2, 2), kind="pixel", offset=1.0), ["pixel", "offset"]),
        (dict(shape=(2, 2), kind="pixel", trained_shape=(4, 4), resize="interpolate"), ["trained_shape", "[-1, 1]"]),
        (dict(shape=(2, 2), trained_shape=(4,), resize="interpolate"), ["trained_shape", "one size per axis"]),
        (dict(shape=(2, 2), resize="interpolate"), ["resize='interpolate' needs trained_shape"]),
        (dict(shape=(2, 2), trained_shape=(4, 4), resize="stretch"), ["resize='stretch'"]),
    ],
)
def test_patch_grid_errors_name_the_argument(kwargs, words):
    with pytest.raises(ValueError) as info:
        patch_grid(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_vision_patch_positions_follow_merge_blocks_as_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.vision_utils import get_vision_position_ids

    grids = torch.tensor([[2, 4, 6], [1, 2, 2], [3, 6, 4]])
    assert torch.equal(vision_patch_positions(grids, 2), get_vision_position_ids(grids, 2))
    assert torch.equal(vision_patch_positions(grids, 1), get_vision_position_ids(grids, 1))
    assert transformers is not None
    # worked example: a 2 x 4 frame in 2 x 2 blocks
    assert vision_patch_positions([1, 2, 4], 2).tolist() == [[0, 0], [0, 1], [1, 0], [1, 1],
                                                             [0, 2], [0, 3], [1, 2], [1, 3]]
    with pytest.raises(ValueError, match=r"grid_thw\[0\] = \(1, 3, 4\): h and w must be multiples"):
        vision_patch_positions([[1, 3, 4]], 2)


def test_vision_block_positions_time_steps_truncate_in_float32():
    block = vision_block_positions([4, 2, 2], spatial_merge_size=2, time_step=2 * (2 / 3), start=5)
    # frame i at int(i * 1.3333334f): 0, 1, 2, 4 -- the float32 product of frame 3 is 4.0000005
    assert block[:, 0].tolist() == [5, 6, 7, 9] and block[:, 1:].unique().tolist() == [5]
    assert vision_block_positions([1, 4, 6], spatial_merge_size=2).tolist() == [
        [0, r, c] for r in range(2) for c in range(3)]
    with pytest.raises(ValueError, match=r"three positive ints \(t, h, w\)"):
        vision_block_positions([1, 4], spatial_merge_size=2)


def test_patch_grid_thw_and_the_seconds_per_grid_time_step():
    # a 4-frame 2 fps clip of 56 x 84 pixels, patch 14, temporal patch 2: 2 x 4 x 6 patches
    assert patch_grid_thw(4, 56, 84, patch_size=14, temporal_patch_size=2) == (2, 4, 6)
    assert patch_grid_thw(1, 28, 28, patch_size=14, temporal_patch_size=2) == (1, 2, 2)  # an image
    seconds_per_grid = 2 / 2.0  # temporal_patch_size / fps
    block = vision_block_positions((2, 4, 6), spatial_merge_size=2, time_step=2 * seconds_per_grid)
    assert block.shape == (2 * 2 * 3, 3) and block[:, 0].unique().tolist() == [0, 2]
    with pytest.raises(ValueError, match="multiples of patch_size=14"):
        patch_grid_thw(4, 50, 84, patch_size=14, temporal_patch_size=2)
    with pytest.raises(ValueError, match="multiple of temporal_patch_size=2"):
        patch_grid_thw(3, 56, 84, patch_size=14, temporal_patch_size=2)
