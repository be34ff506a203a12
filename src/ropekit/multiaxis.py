"""The public namespace of multi-axis RoPE: ``from ropekit.multiaxis import named_plan, mrope, axial, patch_grid``.

- plans (:class:`AxisPlan`: per pair one frequency and one axis): the generic builders
  :func:`mrope`, :func:`axial`, :func:`axial_pixel`, :func:`single_axis`, and the plans of named
  models by name, :func:`named_plan` (``named_plan("flux")``, ``named_plan("wan", head_dim=128)``;
  :data:`NAMED_PLANS` lists them, :data:`LAYOUTS` gives the pairing each is used with);
- positions: :func:`patch_grid`, :func:`patch_grid_thw`, :func:`vision_patch_positions`,
  :func:`vision_block_positions`, :func:`mrope_position_ids` (Qwen-VL, GLM-4V, ERNIE-4.5-VL),
  :func:`omni_position_ids` (Qwen2.5-Omni: audio and video aligned in time), :func:`mrope_next_positions`;
- angles of any frequency matrix (RoPE-Mixed): :func:`matrix_angles`.

They live in :mod:`ropekit.rope.axes`, :mod:`ropekit.rope.plans`, :mod:`ropekit.rope.grids`,
:mod:`ropekit.rope.mrope_positions` and :mod:`ropekit.rope.omni_positions`. Tables come from
:meth:`AxisPlan.cos_sin` and go to the same :func:`ropekit.apply_rotary` / ``apply_rotary_qk`` /
``rotate_qk`` as 1-D RoPE. See docs/multiaxis.md.
"""

from ._deprecation import module_getattr
from .rope.axes import AxisPlan, axial, axial_pixel, matrix_angles, mrope, single_axis
from .rope.grids import patch_grid, patch_grid_thw, vision_block_positions, vision_patch_positions
from .rope.mrope_positions import mrope_next_positions, mrope_position_ids
from .rope.omni_positions import omni_position_ids
from .rope.plans import LAYOUTS, NAMED_PLANS, named_plan

__all__ = [
    "LAYOUTS",
    "NAMED_PLANS",
    "AxisPlan",
    "axial",
    "axial_pixel",
    "matrix_angles",
    "mrope",
    "mrope_next_positions",
    "mrope_position_ids",
    "named_plan",
    "omni_position_ids",
    "patch_grid",
    "patch_grid_thw",
    "single_axis",
    "vision_block_positions",
    "vision_patch_positions",
]

# the model plans by name (0.x had one function each): old name -> key of NAMED_PLANS
_PLAN_FUNCTIONS = {
    "qwen2_vl": "qwen2-vl",
    "qwen3_vl": "qwen3-vl",
    "qwen_vl_vision": "qwen-vl-vision",
    "eva02": "eva02",
    "rope_vit_axial": "rope-vit-axial",
    "dinov3": "dinov3",
    "flux": "flux",
    "flux2": "flux2",
    "hunyuan_video": "hunyuan-video",
    "wan": "wan",
    "cogvideox": "cogvideox",
}
# the other 0.x names, now imported from their own modules
_INTERNALS = {
    "DEFAULT_AXIS_NAMES": "ropekit.rope.axes",
    "default_axis_names": "ropekit.rope.axes",
    "pixel_ladder": "ropekit.rope.axes",
    "cogvideox_axes_dims": "ropekit.rope.plans",
    "wan_axes_dims": "ropekit.rope.plans",
}

# one release: each old name warns once and names its replacement
__getattr__ = module_getattr(__name__, {
    **{old: (f"ropekit.rope.plans:{old}", f"ropekit.multiaxis.named_plan({key!r}, ...)")
       for old, key in _PLAN_FUNCTIONS.items()},
    **{old: (f"{home}:{old}", f"{home}.{old}") for old, home in _INTERNALS.items()},
})
