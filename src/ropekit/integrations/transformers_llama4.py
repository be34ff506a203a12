"""Llama 4's text model under the transformers patch: complex ``freqs_cis`` and ``apply_rotary_emb``.

Llama 4 does not build ``(cos, sin)`` tables: its ``Llama4TextRotaryEmbedding`` returns
``freqs_cis = polar(1, position * inv_freq) * attention_scaling`` (complex64, ``(batch, seq,
head_dim // 2)``), and the module-level ``apply_rotary_emb(xq, xk, freqs_cis)`` multiplies q and
k, viewed as complex numbers over the channel pairs ``(2i, 2i + 1)``, by it: RoPE in the
interleaved layout, on ``(batch, seq, heads, head_dim)`` q and k. :func:`patch`:

* overrides the rotary module's ``forward`` to return ``cos + i sin`` of ropekit's float32 tables
  (:func:`ropekit.cos_sin`, float64 angles, the attention scale on both), complex64 as before;
* wraps each ``Llama4TextAttention`` so that, while it runs, the modeling module's
  ``apply_rotary_emb`` rotates q and k with :func:`ropekit.apply_rotary_qk` (``rope.layout``,
  ``"interleaved"`` for Hugging Face's Llama 4 weights), the real and imaginary parts of
  ``freqs_cis`` as cos and sin (while ``torch.compile`` traces it, the plain torch expressions of
  :mod:`.transformers_compile`). Unpatched models fall through to the original function.

What stays transformers': the choice of layers (``use_rope``, from ``no_rope_layers``; checked
against the config, :mod:`.transformers_schedules`), the L2 norm of q and k on the RoPE layers
(``use_qk_norm``, after the rotation), chunked attention on the RoPE layers (the
``chunked_attention`` mask of ``attention_chunk_size`` tokens) and the attention temperature on
the NoPE layers (``attn_temperature_tuning``). None of them is RoPE; the patch does not touch them.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
from typing import Any

import torch

from ..config import RopeConfig
from ..config.families import attention_classes
from ..functional import apply_rotary_qk
from ..rope.frequencies import cos_sin
from ..validation import check_layout
from . import transformers_compile as traced
from . import transformers_norms as norms
from . import transformers_schedules as schedules
from .transformers_norms import Call, current

#: The attention class of the Llama 4 row of :mod:`ropekit.config.families`.
ATTENTION = attention_classes(name="Llama 4")
ROTARY = "Llama4TextRotaryEmbedding"
FUNCTION = "apply_rotary_emb"

_INSTALLED: dict[str, list[Any]] = {}  # modeling module name -> [original apply_rotary_emb, patched models]


def handles(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a Llama 4 text model (``Llama4ForCausalLM``, ``Llama4TextModel``, or one inside)."""
    return any(type(m).__name__ in ATTENTION for m in model.modules())


def patchable_modules(model: torch.nn.Module) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """``(rotary embedding modules, attention modules)`` of a Llama 4 text model that :func:`patch` overrides.

    Raises ``ValueError`` when either is missing or the modeling module has no
    ``apply_rotary_emb(xq, xk, freqs_cis)``.
    """
    rotary = [m for m in model.modules() if type(m).__name__ == ROTARY and hasattr(m, "inv_freq")]
    attention = [m for m in model.modules() if type(m).__name__ in ATTENTION]
    functions = {getattr(sys.modules.get(type(m).__module__), FUNCTION, None) for m in attention}
    if not rotary or not attention or not all(_takes_xq_xk_freqs(f) for f in functions):
        raise ValueError(f"{type(model).__name__}: found {len(rotary)} {ROTARY} and {len(attention)} "
                         f"Llama4TextAttention modules; ropekit patches a Llama 4 text model whose modeling module "
                         f"has {FUNCTION}(xq, xk, freqs_cis)")
    return rotary, attention


def _takes_xq_xk_freqs(function: Any) -> bool:
    function = getattr(function, "__ropekit_original__", function)
    if not callable(function):
        return False
    try:
        return list(inspect.signature(function).parameters)[:3] == ["xq", "xk", "freqs_cis"]
    except (TypeError, ValueError):
        return False


def _rope(model: torch.nn.Module, rope: RopeConfig | None, layout: str | None) -> RopeConfig:
    """The RoPE the patch computes: ``rope`` or the model's own, with the model's layer schedule, checked."""
    own = RopeConfig.from_hf(model.config)  # layout "interleaved": the pairs Llama 4's complex product rotates
    name = type(model).__name__
    if rope is None:
        rope = own
    elif not isinstance(rope, RopeConfig):
        raise TypeError(f"rope must be a ropekit.RopeConfig or None, got {type(rope).__name__}")
    elif (rope.head_dim, rope.rotary_dim) != (own.head_dim, own.rotary_dim):
        raise ValueError(f"rope has head_dim {rope.head_dim}, rotary_dim {rope.rotary_dim}; {name} has "
                         f"head_dim {own.head_dim}, rotary_dim {own.rotary_dim}")
    elif rope.axes is not None:
        raise ValueError(f"rope has a multi-axis plan ({rope.axes!r}); {name}'s text model has one position axis")
    rope = schedules.with_model_schedule(rope, own, name)
    if layout is not None:
        rope = dataclasses.replace(rope, layout=check_layout(layout))
    if getattr(rope.scaling, "dynamic", False) and getattr(rope.scaling, "fixed_seq_len", None) is None:
        raise ValueError("length-dependent scaling (dynamic NTK, LongRoPE) needs fixed_seq_len for a KV cache; "
                         "use RopeConfig.from_hf(config, fixed_seq_len=...)")
    return rope


def _rotary_forward(inv_freq: torch.Tensor, attention_scale: float):
    def forward(self, x, position_ids=None, *args, **kwargs):
        """``freqs_cis``: complex64 ``cos + i sin``, shape ``position_ids.shape + (rotary_dim // 2,)``."""
        if position_ids is None:
            position_ids = torch.arange(x.shape[-2], device=x.device)[None]
        cos, sin = cos_sin(position_ids, inv_freq.to(position_ids.device), attention_scale=attention_scale)
        return torch.complex(cos, sin)

    return forward


def _dispatcher(original):
    def apply_rotary_emb(xq, xk, freqs_cis):
        call = current()
        if call is None:
            return original(xq, xk, freqs_cis)
        schedules.start_rotation(call, FUNCTION)
        # (batch, seq, pairs) complex -> (batch, seq, 1, pairs) cos and sin against (batch, seq, heads, head_dim)
        cos, sin = freqs_cis.real.unsqueeze(2), freqs_cis.imag.unsqueeze(2)
        if traced.EXPRESSIONS and torch.compiler.is_compiling():  # an expression inductor fuses
            return traced.rotated_qk(xq, xk, cos, sin, call.layout)
        return apply_rotary_qk(xq, xk, cos, sin, layout=call.layout, backend=call.backend)

    apply_rotary_emb.__ropekit_original__ = original
    return apply_rotary_emb


def _attention_forward(original, layout: str, backend: str, entry: tuple[int, bool] | None):
    def forward(self, *args, **kwargs):
        call = Call(layout, backend, False, layer_rotates=entry)
        norms.ACTIVE.append(call)
        try:
            result = original(*args, **kwargs)
        finally:
            norms.ACTIVE.pop()
        schedules.check_rotated(call, self)
        return result

    return forward


def patch(model: torch.nn.Module, *, rope: RopeConfig | None, layout: str | None, backend: str) -> dict[str, Any]:
    """Patch a Llama 4 text model in place (see the module); returns the patch's state for ``unpatch``.

    Called by :func:`ropekit.integrations.transformers.patch`, whose arguments these are (``fuse``
    has nothing to fuse here: Llama 4's q/k L2 norm follows the rotation and stays transformers').

    Raises:
        ValueError: see :func:`patchable_modules`; a ``rope`` that does not fit; attention modules whose
            ``use_rope`` disagrees with the config's ``no_rope_layers``.
    """
    rotary, attention = patchable_modules(model)
    rope = _rope(model, rope, layout)
    entries = schedules.layer_entries(attention, rope.layer_schedule)
    inv_freq, attention_scale = rope.inv_frequencies()
    for m in rotary:
        device = next(m.buffers(), torch.empty(0)).device
        m.forward = types.MethodType(_rotary_forward(inv_freq.to(device), attention_scale), m)
    for m, entry in zip(attention, entries, strict=True):
        m.forward = types.MethodType(_attention_forward(m.forward, rope.layout, backend, entry), m)
    names = sorted({type(m).__module__ for m in attention})
    for name in names:
        module = sys.modules[name]
        if name not in _INSTALLED:
            _INSTALLED[name] = [getattr(module, FUNCTION), 0]
            setattr(module, FUNCTION, _dispatcher(getattr(module, FUNCTION)))
        _INSTALLED[name][1] += 1
    return {"rotary": rotary, "attention": attention, "norms": [], "modules": [], "rope": rope,
            "undo": [lambda: _uninstall(names)]}


def _uninstall(names: list[str]) -> None:
    """Give the modeling modules their ``apply_rotary_emb`` back once no patched model uses them."""
    for name in names:
        entry = _INSTALLED[name]
        entry[1] -= 1
        if entry[1] == 0:
            setattr(sys.modules[name], FUNCTION, entry[0])
            del _INSTALLED[name]
