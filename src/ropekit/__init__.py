"""ropekit: Rotary Position Embedding (RoPE) for PyTorch.

Layers, bottom to top (docs/architecture.md): rope (the maths: frequencies, scaling rules,
layouts, shard positions) · ops (torch operators and their kernels) · functional (apply_rotary and
friends) · fused (q/k RMSNorm + rotation, rotation into a KV cache) ·
distributed (context parallelism) · config (RopeConfig, config.json) · checkpoints ·
nn (modules) · integrations · cli. The lab (experiments, report, bench, probe) is the separate
ropekit-lab distribution in the repository's ``lab/``, on these public names only.

The public names below are imported on first use (PEP 562 module ``__getattr__``), so that
``import ropekit`` alone does not import torch: the ``ropekit`` command line parses its
arguments, and answers ``--help`` and ``--version``, before any verb pays for torch.
``from ropekit import apply_rotary`` and ``ropekit.apply_rotary`` work as with eager imports.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

# public name -> the submodule that defines it
_EXPORTS = {
    "AxisPlan": "rope.axes",
    "RopeConfig": "config.rope_config",
    "LayerSchedule": "config.schedules",
    "RotaryEmbedding": "nn.rotary",
    "apply_reference": "ops.reference",
    "rotation_matrix": "ops.reference",
    "base_inv_freq": "rope.frequencies",
    "cos_sin": "rope.frequencies",
    "inv_frequencies": "config.rules",
    "rotation_angles": "rope.frequencies",
    "apply_rotary": "functional",
    "apply_rotary_qk": "functional",
    "rotate": "functional",
    "rotate_qk": "functional",
    "rms_norm_rotary": "fused.norm",
    "rms_norm_rotary_qk": "fused.norm",
    "rotate_into_cache": "fused.cache",
    "slot_mapping": "fused.cache",
    "dequantize_cache": "fused.cache_scales",
    "rerotate_cache": "fused.rerotate",
    "context_shift": "fused.rerotate",
    "channel_permutation": "rope.layouts",
    "convert_layout": "rope.layouts",
    "permute_qk_weight": "rope.layouts",
    "LayoutEvidence": "rope.pairing",
    "detect_layout": "rope.pairing",
}
_SUBMODULES = ("checkpoints", "distributed", "integrations", "mla", "multiaxis", "nn", "ops", "scaling")
# deprecated public names (one release): old name -> (where the value lives now, what to write instead)
_MOVED = {"backends": ("ropekit.ops", "ropekit.ops (available, register, get, resolve)")}

__all__ = [  # the keys of _EXPORTS and _SUBMODULES (a test keeps them equal)
    "AxisPlan",
    "LayerSchedule",
    "LayoutEvidence",
    "RopeConfig",
    "RotaryEmbedding",
    "apply_reference",
    "apply_rotary",
    "apply_rotary_qk",
    "base_inv_freq",
    "channel_permutation",
    "checkpoints",
    "context_shift",
    "convert_layout",
    "cos_sin",
    "dequantize_cache",
    "detect_layout",
    "distributed",
    "integrations",
    "inv_frequencies",
    "mla",
    "multiaxis",
    "nn",
    "ops",
    "permute_qk_weight",
    "rerotate_cache",
    "rms_norm_rotary",
    "rms_norm_rotary_qk",
    "rotate",
    "rotate_into_cache",
    "rotate_qk",
    "rotation_angles",
    "rotation_matrix",
    "scaling",
    "slot_mapping",
]

if TYPE_CHECKING:  # what static analysers and IDEs see; at run time the names are imported on first use
    from . import checkpoints, distributed, integrations, mla, multiaxis, nn, ops, scaling
    from .config import RopeConfig
    from .config.rules import inv_frequencies
    from .config.schedules import LayerSchedule
    from .functional import apply_rotary, apply_rotary_qk, rotate, rotate_qk
    from .fused import rms_norm_rotary, rms_norm_rotary_qk, rotate_into_cache, slot_mapping
    from .fused.cache_scales import dequantize_cache
    from .fused.rerotate import context_shift, rerotate_cache
    from .nn.rotary import RotaryEmbedding
    from .ops.reference import apply_reference, rotation_matrix
    from .rope.axes import AxisPlan
    from .rope.frequencies import base_inv_freq, cos_sin, rotation_angles
    from .rope.layouts import channel_permutation, convert_layout, permute_qk_weight
    from .rope.pairing import LayoutEvidence, detect_layout


def _version() -> str:
    """The installed distribution's version (``version`` in pyproject.toml is the one source)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ropekit")
    except PackageNotFoundError:  # a source tree on sys.path that was never installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    elif name == "__version__":
        value = _version()
    elif name in _MOVED:
        from ._deprecation import warn_once

        home, new = _MOVED[name]
        warn_once(f"ropekit.{name}", new)
        return importlib.import_module(home)  # not cached: every use of the old name goes through here
    elif name in _SUBMODULES or importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")  # ropekit.nn, ropekit.functional, ... as before
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__"})
