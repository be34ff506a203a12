"""The library's documented limits: cheap checks that refuse a huge or non-finite input before any allocation.

Each check names the argument, the limit and what was given (``ValueError``). Where the old code
allocated first, the test makes the allocating step fail if it is reached at all (a function
replaced by one that raises), so that the order is what is tested, not only the message.
"""

import math
import os
import stat

import pytest
import torch

import ropekit
from ropekit import RopeConfig
from ropekit.checkpoints import storage
from ropekit.cli import common as cli_common
from ropekit.cli import inspect_json
from ropekit.rope import analysis, grids, mrope_positions
from ropekit.rope.axes import mrope
from ropekit.rope.frequencies import base_inv_freq
from ropekit.rope.scaling import YaRN
from ropekit.validation import MAX_FACTOR, MAX_POSITION, MAX_ROTARY_DIM
from ropekit_lab import probe_text


def test_the_cli_spells_the_library_limits_alike():
    assert (cli_common.MAX_POSITION, cli_common.MAX_ROTARY_DIM) == (MAX_POSITION, MAX_ROTARY_DIM)


@pytest.mark.parametrize("name", ["rotary_dim", "head_dim"])
def test_dimensions_above_the_limit_are_refused(name):
    with pytest.raises(ValueError, match=rf"{name} must be at most 65,536 .* got 8,589,934,592"):
        if name == "rotary_dim":
            base_inv_freq(2**33)
        else:
            RopeConfig(head_dim=2**33)
    assert base_inv_freq(MAX_ROTARY_DIM).shape == (MAX_ROTARY_DIM // 2,)


def test_scaling_factors_above_the_limit_are_refused():
    with pytest.raises(ValueError, match=r"YaRN: factor must be at most 1,048,576 \(2\*\*20\), got 1e\+20"):
        YaRN(factor=1e20, original_max_position_embeddings=4096)
    YaRN(factor=MAX_FACTOR, original_max_position_embeddings=4096)


@pytest.mark.parametrize("context", [10**23, MAX_POSITION + 1])
def test_describe_refuses_a_context_beyond_the_limit(context):
    with pytest.raises(ValueError, match=r"context must be at most 1,099,511,627,776 tokens"):
        inspect_json.describe(RopeConfig(head_dim=64), context=context, bound=False)
    with pytest.raises(ValueError, match=r"seq_len must be at most"):
        inspect_json.describe(RopeConfig(head_dim=64), context=4096, seq_len=context, bound=False)


@pytest.mark.parametrize("value", [1e308, -1e308, float(MAX_POSITION) * 2])
def test_multi_axis_positions_beyond_the_limit_are_refused_not_nan(value):
    plan = mrope(base_inv_freq(16), [2, 3, 3])
    positions = torch.tensor([[0.0, 1.0, value]], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"positions must lie within \+-1,099,511,627,776 .* magnitude"):
        plan.cos_sin(positions)
    cos, sin = plan.cos_sin(torch.tensor([[0.0, 1.0, float(MAX_POSITION)]], dtype=torch.float64))
    assert bool(torch.isfinite(cos).all() and torch.isfinite(sin).all())


def test_mrope_run_length_is_checked_before_the_block_is_built(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the vision block was built before its length was checked")

    monkeypatch.setattr(mrope_positions, "vision_block_positions", never)
    types = torch.tensor([[0, 1, 1, 1, 1, 0]])
    # 4096 x 4096 patches (within the grid limit): 4 million tokens at merge 2, for a run of 4
    with pytest.raises(ValueError, match=r"a run of 4 image tokens does not match its grid \(1, 4096, 4096\) "
                                         r"\(4194304 tokens"):
        mrope_positions.mrope_position_ids(types, [[1, 4096, 4096]], spatial_merge_size=2, family="qwen2_vl")


def test_grids_beyond_the_limit_are_refused():
    with pytest.raises(ValueError, match=r"image_grid_thw\[0\] = \(1, 40000, 40000\) has 1,600,000,000 patches"):
        ropekit.multiaxis.mrope_position_ids(torch.tensor([[0, 1, 1, 1, 1]]), [[1, 40000, 40000]],
                                             spatial_merge_size=2, family="qwen2_vl")
    with pytest.raises(ValueError, match=r"shape \(40000, 40000\) has 1,600,000,000 patches"):
        grids.patch_grid((40000, 40000))
    with pytest.raises(ValueError, match=r"prefix_tokens must be an int in \[0, 16,777,216\]"):
        grids.patch_grid((2, 2), prefix_tokens=10**12)


def test_decay_bound_chunks_by_entries_for_wide_heads(monkeypatch):
    seen = []
    outer = torch.outer

    def counting(a, b):
        seen.append(a.numel() * b.numel())
        return outer(a, b)

    monkeypatch.setattr(torch, "outer", counting)
    theta = base_inv_freq(MAX_ROTARY_DIM)
    bound = analysis.decay_bound(theta, torch.arange(300))
    assert bound.shape == (300,) and math.isclose(float(bound[0]), (theta.numel() + 1) / 2)
    assert max(seen) <= analysis._CHUNK_ENTRIES


def test_text_is_read_with_a_byte_bound(tmp_path):
    text = tmp_path / "long.txt"
    text.write_bytes("é".encode() * 10)  # 20 bytes, 2 per character
    assert probe_text.read_text(str(text), max_bytes=7) == "é" * 3  # the character cut at byte 7 is dropped
    assert probe_text.read_text(str(text)) == "é" * 10
    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"--text .*fifo.txt'?: not a regular file"):
        probe_text.read_text(str(fifo))  # refused without blocking on a FIFO no one writes


def test_checkpoint_files_must_be_regular_and_readable(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"not a regular file \(a device, FIFO or socket\)"):
        storage.load_checkpoint(fifo)
    device = tmp_path / "zero.safetensors"
    device.symlink_to("/dev/zero")
    with pytest.raises(ValueError, match=r"not a regular file"):
        storage.load_checkpoint(device)
    locked = tmp_path / "locked.safetensors"
    locked.write_bytes(b"x")
    locked.chmod(0)
    try:
        if os.geteuid() != 0:  # root reads whatever the mode says
            with pytest.raises(ValueError, match=r"locked.safetensors: cannot read it \(Permission denied\)"):
                storage.load_checkpoint(locked)
    finally:
        locked.chmod(stat.S_IRUSR | stat.S_IWUSR)
