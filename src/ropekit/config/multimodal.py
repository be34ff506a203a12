"""Multi-axis RoPE in Hugging Face language-model configs: the M-RoPE of the multimodal families.

A config is multi-axis when its rope dict carries ``mrope_section`` / ``mrope_interleaved``, says
``"type": "mrope"``, or its model type is one of the families below (whose modeling code applies
M-RoPE with a default section even when the config is silent). How the pairs map onto t, h, w is
decided by the **model type**, as transformers' modeling code decides it (rows of :mod:`.families`):

- ``qwen2_vl``, ``qwen2_5_vl`` (and ``*_text``): contiguous sections, default ``[16, 24, 24]``;
- ``qwen2_5_omni`` (thinker, talker, ``*_text``): contiguous, default ``[16, 24, 24]``;
- ``glm4v``, ``glm4v_moe`` (and ``*_text``): contiguous over the partial rotary dimension, default
  ``[8, 12, 12]``;
- ``qwen3_vl``, ``qwen3_vl_moe`` (and ``*_text``): interleaved, default ``[24, 20, 20]``;
- ``ernie4_5_vl_moe`` (and ``*_text``): h and w alternating, then t; ``mrope_section`` is
  ``[h, w, t]``, default ``[22, 22, 20]``.

transformers ignores ``mrope_interleaved`` (Qwen3-VL interleaves whatever it says), while serving
engines that take the flag from the config follow it; a flag that contradicts the model type would
give two runtimes two different models, so it is refused rather than guessed. Any other model
type with M-RoPE keys (Qwen3.5, HunYuan-VL, ...) raises: never a silent fall-back to 1-D RoPE.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..rope.axes import AxisPlan, mrope
from ..rope.plans import hw_alternating_mrope
from .families import mrope_sections

#: Model types with contiguous M-RoPE sections, and their default ``mrope_section``.
CONTIGUOUS_MROPE = mrope_sections("contiguous")  # rows of :mod:`.families`
#: Model types with interleaved M-RoPE, and their default ``mrope_section``.
INTERLEAVED_MROPE = mrope_sections("interleaved")
#: Model types whose M-RoPE alternates h and w (ERNIE-4.5-VL), and their default ``mrope_section`` (h, w, t).
ALTERNATING_MROPE = mrope_sections("alternating")
#: Every M-RoPE model type: ``model_type -> (kind, default mrope_section)``.
MROPE_KINDS = {t: (kind, section) for kind, table in (("contiguous", CONTIGUOUS_MROPE),
                                                       ("interleaved", INTERLEAVED_MROPE),
                                                       ("alternating", ALTERNATING_MROPE))
               for t, section in table.items()}
#: Keys of a rope dict that describe the axes (not the frequencies).
MULTI_AXIS_KEYS = ("mrope_section", "mrope_interleaved")
#: Keys of Baidu's remote-code ERNIE-4.5-VL configs that make them multi-axis.
REMOTE_CODE_KEYS = ("rope_3d", "freq_allocation")
#: Why some known multi-axis families are refused.
UNSUPPORTED = {
    "hunyuan_vl": "its M-RoPE splits the two channels of a rotary pair across different axes (sections doubled "
                  "over the full head), which is not a rotation when the axes' positions differ",
    "ernie4_5_moe_vl": "this is Baidu's remote-code form of ERNIE-4.5-VL (rope_3d, freq_allocation); ropekit reads "
                       "transformers' form of the model (model_type 'ernie4_5_vl_moe', mrope_section [h, w, t])",
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
    for key in REMOTE_CODE_KEYS:
        if cfg.get(key) not in (None, False):
            found[key] = cfg[key]
    for key in ("type", "rope_type"):
        if params.get(key) == "mrope":
            del params[key]
            found["mrope"] = True
    if found or cfg.get("model_type") in MROPE_KINDS:
        return found
    return None


def mrope_layout(model_type: Any, keys: Mapping[str, Any]) -> tuple[tuple[int, ...], str]:
    """``(mrope_section, kind)`` for a multi-axis config of ``model_type``; raises if unsupported.

    ``kind`` is ``"contiguous"``, ``"interleaved"`` or ``"alternating"`` (see :func:`mrope_plan`).
    """
    shown = ", ".join(f"{k}={v!r}" for k, v in keys.items() if k != "mrope") or "type 'mrope'"
    if model_type not in MROPE_KINDS:
        base = str(model_type).removesuffix("_text")
        why = UNSUPPORTED.get(base, "ropekit does not know how this model type maps rotary pairs onto axes")
        raise ValueError(
            f"model_type {model_type!r} has multi-axis RoPE ({shown}) that ropekit cannot represent: {why}. "
            f"Supported: {sorted(MROPE_KINDS)} (docs/multiaxis.md)"
        )
    kind, default = MROPE_KINDS[model_type]
    interleaved = kind == "interleaved"
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
        order = "(h, w, t)" if kind == "alternating" else "(t, h, w)"
        raise ValueError(f"mrope_section must be a list of 3 ints >= 0 {order}, got {list(section)}")
    return section, kind


def mrope_plan(inv_freq: Any, section: tuple[int, ...], kind: str, attention_scale: float = 1.0) -> AxisPlan:
    """The axis plan of an M-RoPE ``kind`` (from :func:`mrope_layout`) over one frequency ladder."""
    if kind == "alternating":
        return hw_alternating_mrope(inv_freq, section, attention_scale=attention_scale)
    return mrope(inv_freq, section, interleaved=kind == "interleaved", attention_scale=attention_scale)
