"""Multi-axis RoPE in Hugging Face language-model configs: M-RoPE of Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

A config is multi-axis when its rope dict carries ``mrope_section`` / ``mrope_interleaved``, says
``"type": "mrope"``, or its model type is one of the families below (whose modeling code applies
M-RoPE with a default section even when the config is silent). How the pairs map onto t, h, w is
decided by the **model type**, as transformers' modeling code decides it:

- ``qwen2_vl``, ``qwen2_5_vl`` (and ``*_text``): contiguous sections, default ``[16, 24, 24]``;
- ``qwen3_vl``, ``qwen3_vl_moe`` (and ``*_text``): interleaved, default ``[24, 20, 20]``.

transformers ignores ``mrope_interleaved`` (Qwen3-VL interleaves whatever it says), while serving
engines that take the flag from the config follow it; a flag that contradicts the model type would
give two runtimes two different models, so it is refused rather than guessed. Any other model
type with M-RoPE keys (GLM-4V, ERNIE-4.5-VL, Qwen3.5, HunYuan-VL, ...) raises: never a silent
fall-back to 1-D RoPE.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .families import mrope_sections

#: Model types with contiguous M-RoPE sections, and their default ``mrope_section``.
CONTIGUOUS_MROPE = mrope_sections("contiguous")  # rows of :mod:`.families`
#: Model types with interleaved M-RoPE, and their default ``mrope_section``.
INTERLEAVED_MROPE = mrope_sections("interleaved")
#: Keys of a rope dict that describe the axes (not the frequencies).
MULTI_AXIS_KEYS = ("mrope_section", "mrope_interleaved")
#: Why some known multi-axis families are refused.
UNSUPPORTED = {
    "hunyuan_vl": "its M-RoPE splits the two channels of a rotary pair across different axes (sections doubled "
                  "over the full head), which is not a rotation when the axes' positions differ",
    "glm4v": "GLM-4V's M-RoPE (interleaved pairing, partial rotary) is not implemented yet",
    "glm4v_moe": "GLM-4V's M-RoPE (interleaved pairing, partial rotary) is not implemented yet",
    "ernie4_5_vl_moe": "ERNIE-4.5-VL's alternating h/w map is not implemented yet",
}


def multi_axis_keys(cfg: Mapping[str, Any], params: dict[str, Any]) -> dict[str, Any] | None:
    """Take the multi-axis keys out of ``params`` (in place); return them, or ``None`` for 1-D RoPE.

    ``"type": "mrope"`` / ``"rope_type": "mrope"`` (the Qwen2-VL 4.x form, also written next to
    ``"rope_type": "default"`` by transformers 5) marks M-RoPE and is removed, so that the rest of
    the dict is read as the frequency rule it also describes (``default``, ``yarn``, ...).
    """
    found: dict[str, Any] = {}
    for key in MULTI_AXIS_KEYS:
        value = params.pop(key, None)
        if value is None:
            value = cfg.get(key)  # a few configs put them at the top level
        if value is not None:
            found[key] = value
    for key in ("type", "rope_type"):
        if params.get(key) == "mrope":
            del params[key]
            found["mrope"] = True
    model_type = cfg.get("model_type")
    if found or model_type in CONTIGUOUS_MROPE or model_type in INTERLEAVED_MROPE:
        return found
    return None


def mrope_layout(model_type: Any, keys: Mapping[str, Any]) -> tuple[tuple[int, ...], bool]:
    """``(mrope_section, interleaved)`` for a multi-axis config of ``model_type``; raises if unsupported."""
    shown = ", ".join(f"{k}={v!r}" for k, v in keys.items() if k != "mrope") or "type 'mrope'"
    if model_type in CONTIGUOUS_MROPE:
        default, interleaved = CONTIGUOUS_MROPE[model_type], False
    elif model_type in INTERLEAVED_MROPE:
        default, interleaved = INTERLEAVED_MROPE[model_type], True
    else:
        base = str(model_type).removesuffix("_text")
        why = UNSUPPORTED.get(base, "ropekit does not know how this model type maps rotary pairs onto axes")
        raise ValueError(
            f"model_type {model_type!r} has multi-axis RoPE ({shown}) that ropekit cannot represent: {why}. "
            f"Supported: {sorted(set(CONTIGUOUS_MROPE) | set(INTERLEAVED_MROPE))} (docs/multiaxis.md)"
        )
    flag = keys.get("mrope_interleaved")
    if flag is not None and not isinstance(flag, bool):
        raise ValueError(f"mrope_interleaved must be true or false, got {flag!r}")
    if flag is not None and flag != interleaved:
        runs = "interleaves t/h/w pair by pair" if interleaved else "uses contiguous t/h/w sections"
        raise ValueError(
            f"mrope_interleaved={flag} contradicts model_type {model_type!r}, whose transformers modeling {runs} "
            "whatever the flag says (other runtimes follow the flag); fix the config so that both agree"
        )
    section = keys.get("mrope_section", default)
    if isinstance(section, (str, bytes)) or not hasattr(section, "__iter__"):
        raise ValueError(f"mrope_section must be a list of 3 ints, got {section!r}")
    section = tuple(section)
    if len(section) != 3 or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in section):
        raise ValueError(f"mrope_section must be a list of 3 ints >= 0 (t, h, w), got {list(section)}")
    return section, interleaved
