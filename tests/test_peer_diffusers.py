"""diffusers' axial rotary embeddings as oracles: FLUX.1/FLUX.2, HunyuanVideo, Wan, CogVideoX.

Each plan is read from the model's published ``transformer/config.json`` (tests/fixtures/multiaxis)
with ``RopeConfig.from_hf``, or built by name; diffusers' module gets the same numbers and positions.
diffusers returns full-width interleaved tables (``[c0, c0, c1, c1, ...]``); ropekit's half-width
tables must equal their even columns (float64 angles on both sides for Flux and Wan: 1e-6; float32
angles in HunyuanVideo and CogVideoX: a few ulp of the angle), and ``ropekit.apply_rotary(layout=
"interleaved")`` must equal diffusers' ``apply_rotary_emb``.
"""

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers.models.embeddings import apply_rotary_emb, get_3d_rotary_pos_embed  # noqa: E402
from diffusers.models.transformers.transformer_flux import FluxPosEmbed  # noqa: E402
from diffusers.models.transformers.transformer_flux2 import Flux2PosEmbed  # noqa: E402
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoRotaryPosEmbed  # noqa: E402
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed  # noqa: E402

import ropekit  # noqa: E402
from ropekit import RopeConfig  # noqa: E402
from ropekit.multiaxis import named_plan, patch_grid  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "multiaxis"


def config(name):
    return json.loads((FIXTURES / f"{name}.json").read_text())


def assert_tables(cos, sin, positions, plan, atol):
    """diffusers' full-width interleaved (cos, sin) against ropekit's half-width tables of the same positions."""
    assert torch.equal(cos[..., 0::2], cos[..., 1::2]) and torch.equal(sin[..., 0::2], sin[..., 1::2])
    ours_cos, ours_sin = plan.cos_sin(positions)
    torch.testing.assert_close(ours_cos, cos[..., 0::2].float(), rtol=0, atol=atol)
    torch.testing.assert_close(ours_sin, sin[..., 0::2].float(), rtol=0, atol=atol)


def test_flux_pos_embed_and_apply():
    raw = config("flux.1-dev")
    rope = RopeConfig.from_hf(raw)
    rows, cols = 3, 5
    image = patch_grid((rows, cols))
    ids = torch.cat([torch.zeros(4, 3, dtype=torch.int64),  # text tokens: all zeros
                     torch.cat([torch.zeros(rows * cols, 1, dtype=torch.int64), image], dim=1)])
    cos, sin = FluxPosEmbed(theta=10000, axes_dim=raw["axes_dims_rope"])(ids.float())
    assert_tables(cos, sin, ids, rope.axis_plan(), atol=1e-6)
    # applied as FluxAttnProcessor does: (batch, seq, heads, head_dim), sequence_dim=1
    x = torch.randn(2, ids.shape[0], 3, 128)
    expected = apply_rotary_emb(x, (cos, sin), sequence_dim=1)
    ours_cos, ours_sin = rope.axis_plan().cos_sin(ids)
    got = ropekit.apply_rotary(x, ours_cos[:, None], ours_sin[:, None], layout=rope.layout)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)


def test_flux2_pos_embed_with_four_axes():
    plan = named_plan("flux2")
    ids = torch.cartesian_prod(torch.arange(2), torch.arange(3), torch.arange(4), torch.arange(2))  # (t, h, w, l)
    cos, sin = Flux2PosEmbed(theta=2000, axes_dim=[32, 32, 32, 32])(ids)
    assert_tables(cos, sin, ids, plan, atol=1e-6)


def test_hunyuan_video_rotary():
    raw = config("hunyuanvideo")
    rope = RopeConfig.from_hf(raw)
    module = HunyuanVideoRotaryPosEmbed(raw["patch_size"], raw["patch_size_t"], raw["rope_axes_dim"], raw["rope_theta"])
    cos, sin = module(torch.zeros(1, 16, 3, 6, 8))  # latent (B, C, F, H, W) -> grid (3, 3, 4)
    assert_tables(cos, sin, patch_grid((3, 3, 4)), rope.axis_plan(), atol=2e-6)


def test_wan_rotary():
    raw = config("wan2.1-t2v-1.3b")
    rope = RopeConfig.from_hf(raw)
    module = WanRotaryPosEmbed(raw["attention_head_dim"], tuple(raw["patch_size"]), raw["rope_max_seq_len"])
    cos, sin = module(torch.zeros(1, 16, 3, 6, 8))  # (1, F*H*W, 1, head_dim)
    assert_tables(cos[0, :, 0], sin[0, :, 0], patch_grid((3, 3, 4)), rope.axis_plan(), atol=1e-6)
    assert rope.axis_plan().counts == (22, 21, 21)


@pytest.mark.parametrize("grid_type", ["slice", "linspace"])
def test_cogvideox_3d_rotary(grid_type):
    raw = config("cogvideox-5b")
    rope = RopeConfig.from_hf(raw)
    frames, rows, cols = 2, 3, 4
    if grid_type == "slice":  # CogVideoX 1.5: integer grids
        cos, sin = get_3d_rotary_pos_embed(64, None, (rows, cols), frames, grid_type="slice", max_size=(6, 8))
        positions = patch_grid((frames, rows, cols))
    else:  # CogVideoX 1.0: linspace(start, stop * (n - 1) / n, n), fractional positions from the crop region
        crops = ((0, 1), (3, 7))
        cos, sin = get_3d_rotary_pos_embed(64, crops, (rows, cols), frames)
        axes = [torch.linspace(0, frames * (frames - 1) / frames, frames, dtype=torch.float64),
                torch.linspace(0, 3 * (rows - 1) / rows, rows, dtype=torch.float64),
                torch.linspace(1, 7 * (cols - 1) / cols, cols, dtype=torch.float64)]
        positions = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
        assert not torch.equal(positions, positions.round())  # really fractional
    assert_tables(cos, sin, positions, rope.axis_plan(), atol=2e-6)


def test_apply_rotary_emb_pairings_are_ropekit_layouts():
    # use_real_unbind_dim=-1 (Flux, CogVideoX, HunyuanVideo) is "interleaved"; -2 with cat([c, c]) tables is "half"
    plan = named_plan("cogvideox", head_dim=64)
    positions = patch_grid((2, 3, 4))
    cos, sin = plan.cos_sin(positions)
    x = torch.randn(1, 2, 24, 64)
    interleaved = apply_rotary_emb(x, (cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)))
    torch.testing.assert_close(ropekit.apply_rotary(x, cos, sin, layout="interleaved"), interleaved, rtol=0, atol=2e-6)
    half = apply_rotary_emb(x, (torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)), use_real_unbind_dim=-2)
    torch.testing.assert_close(ropekit.apply_rotary(x, cos, sin, layout="half"), half, rtol=0, atol=2e-6)
