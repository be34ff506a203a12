"""timm's vision rotary embeddings as oracles: EVA-02 ``RotaryEmbeddingCat``, pixel bands, DINOv3, MRope, Mixed.

timm computes float32 angles; ropekit float64 (so 1e-6 at index grids, 5e-5 for pixel bands whose
angles reach ~350 rad). Its layouts: ``rotate_half=False`` pairs (2i, 2i+1) ("interleaved"),
``True`` pairs (i, i + d/2) ("half"). RoPE-Mixed: outputs and the gradients reaching the learnable
frequencies must equal timm's.
"""

import math

import pytest
import torch

import ropekit
from ropekit.multiaxis import axial_pixel, mrope, named_plan, patch_grid
from ropekit.nn import MixedRotaryEmbedding
from timm_layers import pos_embed_sincos

timm_pe = pos_embed_sincos()
pytestmark = pytest.mark.skipif(timm_pe is None, reason="timm is not installed")
DIM, H, W = 64, 5, 7


def assert_tables(sin, cos, positions, plan, half, atol=1e-6):
    """timm's full-width (sin, cos) against ropekit's half-width tables."""
    pairs = plan.pairs
    sin_h, cos_h = (sin[..., :pairs], cos[..., :pairs]) if half else (sin[..., 0::2], cos[..., 0::2])
    ours_cos, ours_sin = plan.cos_sin(positions)
    torch.testing.assert_close(ours_cos, cos_h.float(), rtol=0, atol=atol)
    torch.testing.assert_close(ours_sin, sin_h.float(), rtol=0, atol=atol)


@pytest.mark.parametrize("rotate_half", [False, True])
def test_eva02_cat_embedding_and_apply(rotate_half):
    rope = timm_pe.RotaryEmbeddingCat(DIM, in_pixels=False, feat_shape=[H, W], temperature=10000,
                                      rotate_half=rotate_half)
    emb = rope.get_embed()  # (H*W, 2*DIM) = cat(sin, cos)
    sin, cos = emb.chunk(2, -1)
    plan, positions = named_plan("eva02", head_dim=DIM), patch_grid((H, W))
    assert_tables(sin, cos, positions, plan, rotate_half)
    x = torch.randn(2, 3, H * W, DIM)
    layout = "half" if rotate_half else "interleaved"
    ours_cos, ours_sin = plan.cos_sin(positions)
    torch.testing.assert_close(ropekit.apply_rotary(x, ours_cos, ours_sin, layout=layout),
                               timm_pe.apply_rot_embed_cat(x, emb, half=rotate_half), rtol=0, atol=5e-6)


def test_xy_indexing_and_prefix_tokens_as_eva_attention():
    rope = timm_pe.RotaryEmbeddingCat(DIM, in_pixels=False, feat_shape=[H, W], temperature=100.0, grid_indexing="xy")
    emb = rope.get_embed()
    plan, positions = named_plan("rope-vit-axial", head_dim=DIM, base=100.0), patch_grid((H, W), indexing="xy")
    assert_tables(*emb.chunk(2, -1), positions, plan, half=False)
    # Eva's attention rotates q[:, :, npt:] only; ropekit gives the prefix tokens position 0 (the identity)
    npt = 2
    q = torch.randn(1, 2, npt + H * W, DIM)
    expected = torch.cat([q[:, :, :npt], timm_pe.apply_rot_embed_cat(q[:, :, npt:], emb)], dim=2)
    cos, sin = plan.cos_sin(patch_grid((H, W), indexing="xy", prefix_tokens=npt))
    torch.testing.assert_close(ropekit.apply_rotary(q, cos, sin, layout="interleaved"), expected, rtol=0, atol=5e-6)


def test_ref_feat_shape_is_interpolation():
    ref = [4, 4]  # EVA-02 fine-tuned at another resolution: positions rescaled onto the trained grid
    rope = timm_pe.RotaryEmbeddingCat(DIM, in_pixels=False, feat_shape=[H, W], ref_feat_shape=ref, grid_offset=0.5)
    positions = patch_grid((H, W), offset=0.5, trained_shape=ref, resize="interpolate")
    assert_tables(*rope.get_embed().chunk(2, -1), positions, named_plan("eva02", head_dim=DIM), half=False)


@pytest.mark.parametrize("linear", [True, False])
def test_pixel_bands(linear):
    rope = timm_pe.RotaryEmbedding(DIM, in_pixels=True, max_res=224, linear_bands=linear)
    sin, cos = rope.get_embed([H, W])
    plan = axial_pixel((DIM // 2, DIM // 2), 224.0, spacing="linear" if linear else "log")
    assert_tables(sin, cos, patch_grid((H, W), kind="pixel"), plan, half=False, atol=5e-5)


def test_dinov3_centered_coordinates_half_layout():
    rope = timm_pe.RotaryEmbeddingDinoV3(DIM, temperature=100.0, feat_shape=[H, W])
    sin, cos = rope.get_embed().chunk(2, -1)
    assert_tables(sin, cos, patch_grid((H, W), kind="centered"), named_plan("dinov3", head_dim=DIM, base=100.0),
                 half=True)


def test_mrope_for_vision_is_the_qwen3_interleave():
    rope = timm_pe.RotaryEmbeddingMRope(DIM, mrope_section=(8, 12, 12), temperature=10000.0)
    sin, cos = rope.get_embed([H, W]).chunk(2, -1)
    plan = mrope(ropekit.base_inv_freq(DIM, 10000.0), (8, 12, 12), interleaved=True)
    assert plan.axis.tolist() == rope.axis.tolist()
    positions = torch.cat([torch.zeros(H * W, 1, dtype=torch.int64), patch_grid((H, W))], dim=1)  # t = 0
    assert_tables(sin, cos, positions, plan, half=True)


def test_rope_mixed_outputs_and_frequency_gradients_equal_timm():
    torch.manual_seed(0)
    heads, depth = 3, 2
    theirs = timm_pe.RotaryEmbeddingMixed(DIM * heads, depth=depth, num_heads=heads, temperature=10.0)
    ours = MixedRotaryEmbedding(DIM, heads)
    with torch.no_grad():
        ours.freqs.copy_(theirs.freqs[:, 0].permute(1, 0, 2))  # timm (2, depth, heads, pairs) -> (heads, 2, pairs)
    x = torch.randn(2, heads, H * W, DIM)
    weight = torch.randn(2, heads, H * W, DIM)  # a loss that a rotation does not leave invariant
    expected = timm_pe.apply_rot_embed_cat(x, theirs.get_embed([H, W])[0])
    (expected * weight).sum().backward()
    got, _ = ours(x, None, patch_grid((H, W), indexing="xy"))
    (got * weight).sum().backward()
    torch.testing.assert_close(got, expected, rtol=0, atol=5e-6)
    expected_grad = theirs.freqs.grad[:, 0].permute(1, 0, 2)
    assert theirs.freqs.grad[:, 1].abs().sum() == 0  # timm: only the block used gets a gradient
    torch.testing.assert_close(ours.freqs.grad, expected_grad, rtol=0, atol=1e-5 * expected_grad.abs().max().item())


def test_rope_mixed_initialisation_matches_the_paper():
    module = MixedRotaryEmbedding(DIM, 4, generator=torch.Generator().manual_seed(1))
    fx, fy = module.freqs[:, 0].double(), module.freqs[:, 1].double()
    magnitude = 10.0 ** (-torch.arange(0, DIM, 4, dtype=torch.float64) / DIM)
    torch.testing.assert_close(torch.sqrt(fx**2 + fy**2), magnitude.repeat(2).expand(4, -1), rtol=1e-6, atol=0)
    q = DIM // 4  # the two halves point in orthogonal directions, one direction per head
    torch.testing.assert_close((fx[:, :q] * fx[:, q:] + fy[:, :q] * fy[:, q:]), torch.zeros(4, q, dtype=torch.float64),
                               rtol=0, atol=1e-7)
    angles = torch.atan2(fy[:, 0], fx[:, 0])
    assert len(set((angles % (2 * math.pi)).round(decimals=4).tolist())) == 4
    timm_init = timm_pe.init_random_2d_freqs(DIM, 1, 4, temperature=10.0)
    timm_magnitude = torch.sqrt(timm_init[0] ** 2 + timm_init[1] ** 2)[0]
    torch.testing.assert_close(timm_magnitude, magnitude.float().repeat(2).expand(4, -1))
