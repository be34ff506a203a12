"""The public namespace of multi-axis RoPE: ``from ropekit.multiaxis import mrope, axial, patch_grid``.

Plans (:class:`AxisPlan`: per pair one frequency and one axis) and their builders live in
:mod:`ropekit.rope.axes` and :mod:`ropekit.rope.plans`, positions in :mod:`ropekit.rope.grids` and
:mod:`ropekit.rope.mrope_positions`; tables come from :func:`ropekit.cos_sin` (or
:meth:`AxisPlan.cos_sin`) and go to the same :func:`ropekit.apply_rotary` / ``apply_rotary_qk`` /
``rotate_qk`` as 1-D RoPE. See docs/multiaxis.md.
"""

from .rope.axes import (
    DEFAULT_AXIS_NAMES,
    AxisPlan,
    axial,
    axial_pixel,
    default_axis_names,
    matrix_angles,
    mrope,
    pixel_ladder,
    single_axis,
)
from .rope.grids import patch_grid, patch_grid_thw, vision_block_positions, vision_patch_positions
from .rope.mrope_positions import mrope_next_positions, mrope_position_ids
from .rope.plans import (
    LAYOUTS,
    NAMED_PLANS,
    cogvideox,
    cogvideox_axes_dims,
    dinov3,
    eva02,
    flux,
    flux2,
    hunyuan_video,
    named_plan,
    qwen2_vl,
    qwen3_vl,
    qwen_vl_vision,
    rope_vit_axial,
    wan,
    wan_axes_dims,
)

__all__ = [
    "DEFAULT_AXIS_NAMES",
    "LAYOUTS",
    "NAMED_PLANS",
    "AxisPlan",
    "axial",
    "axial_pixel",
    "cogvideox",
    "cogvideox_axes_dims",
    "default_axis_names",
    "dinov3",
    "eva02",
    "flux",
    "flux2",
    "hunyuan_video",
    "matrix_angles",
    "mrope",
    "mrope_next_positions",
    "mrope_position_ids",
    "named_plan",
    "patch_grid",
    "patch_grid_thw",
    "pixel_ladder",
    "qwen2_vl",
    "qwen3_vl",
    "qwen_vl_vision",
    "rope_vit_axial",
    "single_axis",
    "vision_block_positions",
    "vision_patch_positions",
    "wan",
    "wan_axes_dims",
]
