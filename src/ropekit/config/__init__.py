"""The config layer: :class:`RopeConfig` and every ``config.json`` form; the only place dicts are parsed.

- :mod:`.rope_config`: :class:`RopeConfig` and ``RopeConfig.from_hf`` (Hugging Face v4/v5 configs,
  ``text_config`` and per-layer-type nesting, Meta ``params.json``-style keys);
- :mod:`.schedules`: :class:`LayerSchedule`, the layers without RoPE (SmolLM3, Llama 4);
- :mod:`.rules`: a ``rope_scaling``/``rope_parameters`` dict onto a :mod:`ropekit.scaling` rule, and
  ``ropekit.inv_frequencies`` (which also takes such a dict);
- :mod:`.presets`: the RoPE part of published configs, by name (torch-free: the command line lists
  them in ``--help``).

Names are imported on first use, so that ``ropekit.config.presets`` stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"RopeConfig": "rope_config", "INTERLEAVED_MODEL_TYPES": "rope_config", "inv_frequencies": "rules",
            "rule_from_dict": "rules", "LayerSchedule": "schedules"}
__all__ = ["INTERLEAVED_MODEL_TYPES", "LayerSchedule", "RopeConfig", "inv_frequencies",
           "rule_from_dict"]  # the keys of _EXPORTS

if TYPE_CHECKING:
    from .rope_config import INTERLEAVED_MODEL_TYPES, RopeConfig
    from .rules import inv_frequencies, rule_from_dict
    from .schedules import LayerSchedule


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
