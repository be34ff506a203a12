"""Shared cases for the multi-axis kernel tests: plans, vector positions, the float64 oracle and its bound."""

import torch

from ropekit import apply_reference
from ropekit.multiaxis import axial, axial_pixel, mrope, named_plan, patch_grid

PLANS = {
    "qwen2-vl": lambda: named_plan("qwen2-vl", head_dim=16, base=1e4, section=(2, 3, 3)),
    "qwen3-vl": lambda: named_plan("qwen3-vl", head_dim=16, base=1e4, section=(2, 3, 3)),
    "eva02": lambda: named_plan("eva02", head_dim=16),
    "flux": lambda: axial((4, 6, 6), 10000.0, axis_names=("index", "h", "w")),
    "pixel": lambda: axial_pixel((8, 8), 64.0),
    "yarn-scaled": lambda: mrope(torch.linspace(1.0, 0.001, 8, dtype=torch.float64), (2, 3, 3), attention_scale=1.25),
}


def positions_for(plan, tokens, gen):
    """``(tokens, n_axes)`` positions: a patch grid (t, h, w or h, w) with fractional, negative offsets."""
    if plan.n_axes == 2:
        grid = patch_grid((2, tokens // 2), offset=(-0.5, 3.25))
    else:
        grid = patch_grid((1, 2, tokens // 2)).double() + torch.tensor([7.0, -2.0, 0.5], dtype=torch.float64)
    return grid + torch.randint(-40, 40, (1, plan.n_axes), generator=gen)


def assert_close_to_reference(out, x, positions, plan, layout):
    """``out`` equals the float64 rotation of ``x`` within one ulp of its dtype plus float32 arithmetic."""
    ref = apply_reference(x, positions, plan, layout=layout)
    err = (out.detach().double() - ref).abs()
    scale = x.detach().abs().max().double()
    bound = torch.finfo(out.dtype).eps * ref.abs() + 8 * torch.finfo(torch.float32).eps * scale
    assert out.shape == x.shape and out.dtype == x.dtype
    assert (err <= bound + 1e-30).all(), f"max error {err.max():.3g}"
