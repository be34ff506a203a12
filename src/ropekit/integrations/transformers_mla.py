"""transformers' MLA families (DeepSeek-V3 and its copies) under :func:`ropekit.integrations.transformers.patch`.

Their attention splits each query head into ``[q_pass | q_rot]`` and the compressed key
projection into ``[kv_nope | k_rot]`` (one key head), and rotates ``q_rot`` and ``k_rot`` with the
modeling module's ``apply_rotary_pos_emb`` (half pairing, ``rope_interleave: false``) or, for
DeepSeek's interleaved checkpoints (``rope_interleave: true``, the default),
``apply_rotary_pos_emb_interleave``, whose outputs are de-interleaved. :func:`install` puts a
dispatcher in place of the latter, as ``patch`` does for the former: inside a patched attention
call it rotates with :func:`ropekit.mla.apply_rotary_mla` (``layout`` the patch's, interleaved
by default; ``output_layout="half"``, transformers' order), elsewhere it runs transformers' own.
The YaRN factors stay transformers': the tables from ``RopeConfig.from_hf`` (its attention
factor), the softmax scale the attention module's own ``scaling``. While ``torch.compile`` traces
the model, the same rotation and reordering are plain torch expressions
(:func:`.transformers_compile.rotated_mla`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..fused.mla import apply_rotary_mla
from . import transformers_compile as traced
from .transformers_norms import current

INTERLEAVE = "apply_rotary_pos_emb_interleave"
_INSTALLED: dict[str, list[Any]] = {}  # modeling module name -> [original function, patched users]


def rotates_interleaved_itself(model: Any) -> bool:
    """Whether ``model``'s modeling code rotates an interleaved rope slice itself (``rope_interleave: true``).

    Then ``RopeConfig.from_hf``'s ``"interleaved"`` is the pairing the model is patched with, not
    a layout its caller must confirm: the modeling module's ``apply_rotary_pos_emb_interleave``
    (which :func:`install` replaces) is what reads it.
    """
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) if config is not None else None
    interleave = getattr(config, "rope_interleave", None) or getattr(text, "rope_interleave", None)
    module = sys.modules.get(type(model).__module__)
    return bool(interleave) and callable(getattr(module, INTERLEAVE, None))


def _dispatcher(original):
    def apply_rotary_pos_emb_interleave(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        call = current()
        if call is None:
            return original(q, k, cos, sin, position_ids, unsqueeze_dim)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)  # ropekit's half-width tables
        if traced.EXPRESSIONS and torch.compiler.is_compiling():  # an expression inductor fuses
            return traced.rotated_mla(q, k, cos, sin, call.layout)
        return apply_rotary_mla(q, k, cos, sin, layout=call.layout, output_layout="half", backend=call.backend)

    apply_rotary_pos_emb_interleave.__ropekit_original__ = original
    return apply_rotary_pos_emb_interleave


def install(module_name: str) -> None:
    """Replace the modeling module's ``apply_rotary_pos_emb_interleave`` (if it has one) for one more patched model."""
    module = sys.modules[module_name]
    if not callable(getattr(module, INTERLEAVE, None)):
        return
    if module_name not in _INSTALLED:
        original = getattr(module, INTERLEAVE)
        _INSTALLED[module_name] = [original, 0]
        setattr(module, INTERLEAVE, _dispatcher(original))
    _INSTALLED[module_name][1] += 1


def uninstall(module_name: str) -> None:
    """Undo one :func:`install`; the last one puts transformers' function back."""
    entry = _INSTALLED.get(module_name)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        setattr(sys.modules[module_name], INTERLEAVE, entry[0])
        del _INSTALLED[module_name]
