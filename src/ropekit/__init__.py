"""ropekit: Rotary Position Embedding (RoPE) for PyTorch.

Layers, bottom to top: frequencies (inv_freq, cos/sin tables, scaling rules) ·
ops (operators, the C++/Triton/eager kernels, the backend registry, the float64 reference) ·
functional (apply_rotary, rotate by position) · nn (modules) · integrations · tools and cli.
"""

from . import backends, ops, scaling
from .config import RopeConfig
from .frequencies import base_inv_freq, cos_sin, inv_frequencies, rotation_angles
from .functional import apply_rotary, apply_rotary_qk, rotate, rotate_qk
from .layouts import channel_permutation, convert_layout, permute_qk_weight
from .nn.rotary import RotaryEmbedding
from .ops.reference import apply_reference, rotation_matrix

__version__ = "0.1.0"

__all__ = [
    "RopeConfig",
    "RotaryEmbedding",
    "apply_reference",
    "apply_rotary",
    "apply_rotary_qk",
    "backends",
    "base_inv_freq",
    "channel_permutation",
    "convert_layout",
    "cos_sin",
    "inv_frequencies",
    "ops",
    "permute_qk_weight",
    "rotate",
    "rotate_qk",
    "rotation_angles",
    "rotation_matrix",
    "scaling",
]
