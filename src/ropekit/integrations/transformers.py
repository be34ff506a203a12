"""Make a loaded Hugging Face ``transformers`` model compute its rotary embedding with ropekit.

Works for the families whose modeling file has a model-level ``*RotaryEmbedding`` module returning
``(cos, sin)`` and attention layers that call the module-level ``apply_rotary_pos_emb(q, k, cos, sin)``
(Llama, Mistral, Qwen2, Qwen3, Phi-3, GPT-NeoX and their copies), and the language models of
Qwen2-VL, Qwen2.5-VL and Qwen3-VL (multi-axis M-RoPE). :func:`patch`:

* looks for those modules inside the language model only (``language_model`` when the model has
  one): a multimodal model's vision tower keeps its own rotary embedding and attention untouched;
* overrides each rotary module's ``forward`` (instance attribute) to return ropekit's **float32**
  half-width tables ``(batch, seq, rotary_dim // 2)`` computed by :func:`ropekit.cos_sin` from
  float64 angles, whatever the activation dtype (they reach only the patched attention layers);
  for M-RoPE from the ``(3, batch, seq)`` (t, h, w) position ids through the config's axis plan
  (``(batch, seq)`` ids, text only, put the same position on every axis, as transformers does);
* wraps each attention module's ``forward`` so that, while it runs, the modeling module's
  ``apply_rotary_pos_emb`` rotates q/k with :func:`ropekit.apply_rotary_qk` (in ``rope.layout``, float32
  arithmetic, result in q's dtype). Other (unpatched) models sharing the modeling module keep the
  original function: the replacement falls through to it when no patched attention is running.

:func:`unpatch` removes the overrides; the model is then exactly as before (same outputs, bit for bit).
Not thread-safe across concurrently running patched/unpatched models of the same family.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from ..config import RopeConfig
from ..functional import apply_rotary_qk
from ..rope.axes import AxisPlan
from ..rope.frequencies import cos_sin

_ACTIVE: list[tuple[str, str, Any, Any]] = []  # (layout, backend, module, capture) of the patched attention running
_INSTALLED: dict[str, list[Any]] = {}  # modeling module name -> [original apply_rotary_pos_emb, users]
_STATE = "_ropekit_patch"


def _dispatcher(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, unsqueeze_dim=1, **kwargs):
        if not _ACTIVE:
            return original(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)
        if args:
            unsqueeze_dim = args[0]
        layout, backend, module, capture = _ACTIVE[-1]  # cos/sin: the half-width tables of _rotary_forward
        q_out, k_out = apply_rotary_qk(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim),
                                       layout=layout, backend=backend)
        if capture is not None:
            capture(module, q, k, q_out, k_out)
        return q_out, k_out

    apply_rotary_pos_emb.__ropekit_original__ = original
    return apply_rotary_pos_emb


def _rotary_forward(inv_freq: torch.Tensor, attention_scale: float):
    def forward(self, x, position_ids=None, *args, **kwargs):
        """``(cos, sin)`` float32 of shape ``position_ids.shape + (rotary_dim // 2,)``."""
        if position_ids is None:
            position_ids = torch.arange(x.shape[-2], device=x.device)[None]
        return cos_sin(position_ids, inv_freq, attention_scale=attention_scale)

    return forward


def _multi_axis_rotary_forward(plan: AxisPlan):
    def forward(self, x, position_ids=None, *args, **kwargs):
        """``(cos, sin)`` float32 ``(batch, seq, rotary_dim // 2)`` from ``(n_axes, batch, seq)`` position ids."""
        if position_ids is None:
            position_ids = torch.arange(x.shape[-2], device=x.device)[None]
        if position_ids.dim() == 2:  # text only: every axis at the token's position
            position_ids = position_ids[None]
        if position_ids.dim() != 3 or position_ids.shape[0] not in (1, plan.n_axes):
            raise ValueError(f"position_ids must be (batch, seq) or ({plan.n_axes}, batch, seq) for this "
                             f"{plan.n_axes}-axis rotary embedding, got {tuple(position_ids.shape)}")
        positions = position_ids.expand(plan.n_axes, -1, -1).permute(1, 2, 0)
        return plan.cos_sin(positions)

    return forward


def _language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The language model of a multimodal model (the first module named ``language_model``), else ``model``."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "language_model":
            return module
    return model


def _attention_forward(original, layout: str, backend: str, capture):
    def forward(self, *args, **kwargs):
        _ACTIVE.append((layout, backend, self, capture))
        try:
            return original(*args, **kwargs)
        finally:
            _ACTIVE.pop()

    return forward


def _modeling_module(module: torch.nn.Module):
    mod = sys.modules.get(type(module).__module__)
    return mod if mod is not None and callable(getattr(mod, "apply_rotary_pos_emb", None)) else None


def patchable_modules(model: torch.nn.Module) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """``(rotary embedding modules, attention modules)`` that :func:`patch` would override.

    Works on a model built on the ``meta`` device too (nothing is computed). Raises ``ValueError``
    naming the model class when either list is empty: a family :func:`patch` does not support.
    """
    text = _language_model(model)  # a multimodal model's vision tower is left alone
    rotary = [m for m in text.modules() if type(m).__name__.endswith("RotaryEmbedding") and hasattr(m, "inv_freq")]
    attention = [m for m in text.modules() if type(m).__name__.endswith("Attention") and _modeling_module(m)]
    if not rotary or not attention:
        raise ValueError(f"{type(model).__name__}: found {len(rotary)} rotary embedding and {len(attention)} "
                         "attention modules; ropekit.integrations.transformers supports models with a "
                         "*RotaryEmbedding module and apply_rotary_pos_emb (Llama, Mistral, Qwen2/3, Phi-3, GPT-NeoX, "
                         "Qwen2-VL, Qwen2.5-VL, Qwen3-VL)")
    return rotary, attention


def patch(model: torch.nn.Module, *, rope: RopeConfig | None = None, backend: str = "auto",
          capture: Callable | None = None) -> torch.nn.Module:
    """Compute ``model``'s RoPE with ropekit; returns ``model`` (patched in place).

    Args:
        model: a loaded ``transformers`` model (e.g. ``LlamaForCausalLM``) of a supported family.
        rope: the rotary embedding to use instead of the model's own (e.g. a YaRN context
            extension); default ``RopeConfig.from_hf(model.config)``. Its ``head_dim``/``rotary_dim``
            must match the model's. Its ``layout`` is the pairing q/k are rotated with: ``"half"`` for
            Hugging Face weights; ``"interleaved"`` for a checkpoint whose q/k rows are in Meta /
            llama.cpp order (e.g. converted with ``ropekit convert --to interleaved``).
        backend: ropekit backend for the rotation (``"auto"`` or a name from ``ropekit.ops.available()``).
        capture: called as ``capture(module, q, k, q_rotated, k_rotated)`` each time an attention
            module rotates: the module (``module.layer_idx`` says which layer), and q/k before and
            after the rotation, ``(batch, heads, seq, head_dim)`` and ``(batch, kv_heads, seq,
            head_dim)`` (before any grouped-query repeat; what the modeling code passes, e.g. after a
            q/k norm). For measurements (``ropekit probe``); it must not change the tensors.

    Raises:
        ValueError: already patched, no rotary/attention module found, or ``rope`` that does not fit.
    """
    if getattr(model, _STATE, None) is not None:
        raise ValueError("model is already patched by ropekit; call unpatch(model) first")
    own = RopeConfig.from_hf(model.config)
    if rope is None and own.layout != "half":
        # e.g. rope_interleave configs: their modeling code may rotate in its own way; be explicit
        raise ValueError(f"{type(model).__name__}'s config implies layout {own.layout!r}; pass rope= with the "
                         "layout its q/k weights are stored in")
    rope = own if rope is None else rope
    if not isinstance(rope, RopeConfig):
        raise TypeError(f"rope must be a ropekit.RopeConfig or None, got {type(rope).__name__}")
    if capture is not None and not callable(capture):
        raise TypeError(f"capture must be callable or None, got {type(capture).__name__}")
    if (rope.head_dim, rope.rotary_dim) != (own.head_dim, own.rotary_dim):
        raise ValueError(f"rope has head_dim {rope.head_dim}, rotary_dim {rope.rotary_dim}; the model has "
                         f"head_dim {own.head_dim}, rotary_dim {own.rotary_dim}")
    own_axes, rope_axes = (own.axes.n_axes if own.axes else 1), (rope.axes.n_axes if rope.axes else 1)
    if own_axes != rope_axes:
        raise ValueError(f"rope has {rope_axes} position axes but {type(model).__name__} has {own_axes} "
                         f"({own.axes!r}); pass a RopeConfig with a matching axis plan")
    if getattr(rope.scaling, "dynamic", False) and getattr(rope.scaling, "fixed_seq_len", None) is None:
        raise ValueError("length-dependent scaling (dynamic NTK, LongRoPE) needs fixed_seq_len for a KV cache; "
                         "use RopeConfig.from_hf(config, fixed_seq_len=...)")
    inv_freq, scale = rope.inv_frequencies()
    rotary, attention = patchable_modules(model)
    for m in rotary:
        if rope.axes is not None:
            m.forward = types.MethodType(_multi_axis_rotary_forward(rope.axis_plan()), m)
        else:
            m.forward = types.MethodType(_rotary_forward(inv_freq.to(m.inv_freq.device), scale), m)
    modules = []
    for m in attention:
        m.forward = types.MethodType(_attention_forward(m.forward, rope.layout, backend, capture), m)
        mod = _modeling_module(m)
        if mod.__name__ not in modules:
            modules.append(mod.__name__)
    for name in modules:
        mod = sys.modules[name]
        if name not in _INSTALLED:
            _INSTALLED[name] = [mod.apply_rotary_pos_emb, 0]
            mod.apply_rotary_pos_emb = _dispatcher(mod.apply_rotary_pos_emb)
        _INSTALLED[name][1] += 1
    setattr(model, _STATE, {"rotary": rotary, "attention": attention, "modules": modules, "rope": rope})
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: remove the forward overrides and, when no patched model uses it, the dispatcher."""
    state = getattr(model, _STATE, None)
    if state is None:
        raise ValueError("model is not patched by ropekit")
    for m in state["rotary"] + state["attention"]:
        m.__dict__.pop("forward", None)
    for name in state["modules"]:
        entry = _INSTALLED[name]
        entry[1] -= 1
        if entry[1] == 0:
            sys.modules[name].apply_rotary_pos_emb = entry[0]
            del _INSTALLED[name]
    delattr(model, _STATE)
    return model
