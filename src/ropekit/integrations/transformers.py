"""Make a loaded Hugging Face ``transformers`` model compute its rotary embedding with ropekit.

Works for the families whose modeling file has a model-level ``*RotaryEmbedding`` module returning
``(cos, sin)`` and attention layers that call the module-level ``apply_rotary_pos_emb(q, k, cos, sin)``
(Llama, Mistral, Qwen2, Qwen3, Gemma 3, OLMo 2/3, Phi-3, GPT-NeoX and their copies), and the language
models of Qwen2-VL, Qwen2.5-VL and Qwen3-VL (multi-axis M-RoPE). :func:`patch`:

* looks for those modules inside the language model only (``language_model`` when the model has
  one): a multimodal model's vision tower keeps its own rotary embedding and attention untouched;
* overrides each rotary module's ``forward`` (instance attribute) to return ropekit's **float32**
  half-width tables ``(batch, seq, rotary_dim // 2)`` computed by :func:`ropekit.cos_sin` from
  float64 angles, whatever the activation dtype, per layer type where the config gives rope
  parameters per layer type (Gemma 3: sliding and full attention); for M-RoPE from the
  ``(3, batch, seq)`` (t, h, w) position ids through the config's axis plan (``(batch, seq)`` ids,
  text only, put the same position on every axis, as transformers does);
* wraps each attention module's ``forward`` so that, while it runs, the modeling module's
  ``apply_rotary_pos_emb`` rotates q/k with :func:`ropekit.apply_rotary_qk` (in ``rope.layout``, float32
  arithmetic, result in q's dtype). Other (unpatched) models sharing the modeling module keep the
  original function: the replacement falls through to it when no patched attention is running;
* for the families with q/k norms (Qwen3, Qwen3-MoE, Gemma 3, OLMo 2, OLMo 3), defers the norms
  into the rotation (:mod:`.transformers_norms`): q and k are normalised and rotated in one pass
  by :func:`ropekit.rms_norm_rotary_qk` (``fuse=False`` keeps transformers' norms);
* with a cache from :func:`static_cache`, rotates the new keys straight into the cache's slots
  (:mod:`.transformers_cache`);
* for the families with layers without RoPE (SmolLM3, Llama 4: ``no_rope_layers``), keeps the
  model's schedule and refuses, at patch time and at run time, a NoPE layer that would rotate or
  a RoPE layer that would not (:mod:`.transformers_schedules`). Llama 4's text model, whose rotation
  is a complex product (``freqs_cis``, ``apply_rotary_emb``), is patched by :mod:`.transformers_llama4`;
* for DeepSeek-V3's MLA (and its copies), replaces the modeling module's
  ``apply_rotary_pos_emb_interleave`` too (:mod:`.transformers_mla`): the interleaved rope slices
  of ``rope_interleave: true`` configs are rotated by :func:`ropekit.mla.apply_rotary_mla`;
* while ``torch.compile`` traces the model, defers nothing and rotates q/k with plain torch
  expressions that inductor fuses with the norms and the cache write around them
  (:mod:`.transformers_compile`): an opaque kernel in the graph would cut that fusion.

:func:`unpatch` removes the overrides; the model is then exactly as before (same outputs, bit for bit).
:func:`load_converted` loads a directory written by ``ropekit convert`` whose q/k rows are in a
layout transformers does not rotate in (plain ``from_pretrained`` refuses it) and patches it with that layout.
Not thread-safe across concurrently running patched/unpatched models of the same family; where the
modeling code carries transformers' kernel hooks, :func:`kernelize` plugs ropekit in through them
instead, per model (see :mod:`.hub_kernels` and docs/models.md).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
from typing import Any

import torch

from ..config import RopeConfig
from ..config.families import modeling_layout
from ..functional import apply_rotary, apply_rotary_qk
from ..fused import rms_norm_rotary, rms_norm_rotary_qk
from ..rope.axes import AxisPlan
from ..rope.frequencies import cos_sin
from ..validation import check_layout
from . import transformers_compile as traced
from . import transformers_llama4 as llama4
from . import transformers_mla as mla
from . import transformers_norms as norms
from . import transformers_schedules as schedules
from .transformers_norms import Call, current

__all__ = [
    "kernel_hooks", "kernelize", "load_converted", "patch", "patchable_modules", "static_cache",
    "unkernelize", "unpatch",
]

_INSTALLED: dict[str, list[Any]] = {}  # modeling module name -> [original apply_rotary_pos_emb, users]
_STATE = "_ropekit_patch"


def _normalised(q, k, pending_q, pending_k, cos, sin, call: Call):
    """Normalise q and k (either may be None: skipped) as their deferred norms say, and rotate them."""
    spec = (pending_q or pending_k)[1]
    per_token = spec.weight.numel() != (q if q is not None else k).shape[-1]
    options = dict(eps=spec.eps, weight_offset=spec.weight_offset, layout=call.layout, backend=call.backend)
    weights = [None if p is None else p[1].weight for p in (pending_q, pending_k)]
    if per_token:  # (batch, heads, seq, dim) -> token-major (batch, seq, heads, dim), weight (heads, dim)
        q, k = (None if t is None else t.transpose(1, 2) for t in (q, k))
        weights = [None if w is None else w.view(t.shape[-2], -1) for w, t in zip(weights, (q, k), strict=True)]
        cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)
        options["norm"] = "per_token"
    if q is not None and k is not None:
        q, k = rms_norm_rotary_qk(q, k, *weights, cos, sin, **options)
    elif q is not None:
        q = rms_norm_rotary(q, weights[0], cos, sin, **options)
    else:
        k = rms_norm_rotary(k, weights[1], cos, sin, **options)
    if per_token:
        q, k = (None if t is None else t.transpose(1, 2) for t in (q, k))
    return q, k


def _claimed(call: Call, role: str, t: torch.Tensor):
    """The deferred norm of ``role`` if ``t`` is its input (raise if it was deferred and ``t`` is not)."""
    pending = call.pending.pop(role, None)
    if pending is not None and not norms.same_memory(t, pending[0]):
        raise RuntimeError(f"ropekit: apply_rotary_pos_emb got a {role} that is not the output of the deferred "
                           f"{role}_norm; this attention's data flow is not the one ropekit fuses")
    return pending


def _dispatcher(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, unsqueeze_dim=1, **kwargs):
        call = current()
        if call is None:
            return original(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)
        schedules.start_rotation(call, "apply_rotary_pos_emb")
        if args:
            unsqueeze_dim = args[0]
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)  # half-width tables of _rotary_forward
        compiling = torch.compiler.is_compiling()
        if compiling and traced.EXPRESSIONS:  # nothing was deferred: see transformers_compile
            return traced.rotated_qk(q, k, cos, sin, call.layout)
        pending_q, pending_k = _claimed(call, "q", q), _claimed(call, "k", k)
        defer_key = call.cache_layer is not None and not compiling
        if defer_key:  # the cache layer normalises and rotates the key on its way into the cache
            call.deferred_key = (k, k, None if pending_k is None else pending_k[1], cos, sin)
            if pending_q is not None:
                return _normalised(q, None, pending_q, None, cos, sin, call)[0], k
            return apply_rotary(q, cos, sin, layout=call.layout, backend=call.backend), k
        if pending_q is None and pending_k is None:
            return apply_rotary_qk(q, k, cos, sin, layout=call.layout, backend=call.backend)
        if pending_q is not None and pending_k is not None:
            return _normalised(q, k, pending_q, pending_k, cos, sin, call)
        # only one of them deferred (not a case of the fused families): rotate the other alone
        q_out = (_normalised(q, None, pending_q, None, cos, sin, call)[0] if pending_q is not None
                 else apply_rotary(q, cos, sin, layout=call.layout, backend=call.backend))
        k_out = (_normalised(None, k, None, pending_k, cos, sin, call)[1] if pending_k is not None
                 else apply_rotary(k, cos, sin, layout=call.layout, backend=call.backend))
        return q_out, k_out

    apply_rotary_pos_emb.__ropekit_original__ = original
    return apply_rotary_pos_emb


def _rotary_forward(frequencies: dict):
    def forward(self, x, position_ids=None, layer_type=None, *args, **kwargs):
        """``(cos, sin)`` float32 of shape ``position_ids.shape + (rotary_dim // 2,)``."""
        if position_ids is None:
            position_ids = torch.arange(x.shape[-2], device=x.device)[None]
        inv_freq, attention_scale = frequencies[layer_type if layer_type in frequencies else None]
        return cos_sin(position_ids, inv_freq.to(position_ids.device), attention_scale=attention_scale)

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


def _attention_forward(original, layout: str, backend: str, fuse: bool, rotating_layer, entry=None):
    def forward(self, *args, **kwargs):
        cache = kwargs.get("past_key_values")
        layers = getattr(cache, "layers", None)
        index = getattr(self, "layer_idx", None)
        layer = layers[index] if rotating_layer is not None and layers and index is not None and index < len(
            layers) else None
        call = Call(layout, backend, fuse, layer if isinstance(layer, rotating_layer or ()) else None,
                    layer_rotates=entry)
        norms.ACTIVE.append(call)
        try:
            result = original(*args, **kwargs)
        except BaseException:
            norms.ACTIVE.pop()
            raise
        norms.ACTIVE.pop()
        norms.check_consumed(call, self)
        schedules.check_rotated(call, self)
        return result

    return forward


def _modeling_module(module: torch.nn.Module):
    mod = sys.modules.get(type(module).__module__)
    return mod if mod is not None and callable(getattr(mod, "apply_rotary_pos_emb", None)) else None


def _takes_q_and_k(function) -> bool:
    """``apply_rotary_pos_emb(q, k, cos, sin, ...)`` (not Gemma 3n's one-tensor form).

    With transformers' kernel hooks on, the function is a module (``kernels`` turns the decorated
    function into one): its ``forward`` has the function's signature.
    """
    if isinstance(function, torch.nn.Module):
        function = function.forward
    try:
        names = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return False
    return names[:4] == ["q", "k", "cos", "sin"]


def _is_rotary(module: torch.nn.Module) -> bool:
    if not type(module).__name__.endswith("RotaryEmbedding"):
        return False
    if hasattr(module, "inv_freq"):
        return True
    types_ = getattr(module, "layer_types", None) or ()
    return bool(types_) and all(hasattr(module, f"{t}_inv_freq") for t in types_)


def _frequencies(model: torch.nn.Module, rope: RopeConfig | None, rotary: list,
                 layout: str | None = None) -> tuple[dict, RopeConfig]:
    """``{layer_type or None: (inv_freq, attention_scale)}`` and the config checked against the model."""
    layer_types = sorted({t for m in rotary for t in (getattr(m, "layer_types", None) or ())})
    if not layer_types:
        layer_types = [None]
    own = {t: RopeConfig.from_hf(model.config, layer_type=t) for t in layer_types}
    first = own[layer_types[0]]
    own_axes = first.axes.n_axes if first.axes else 1
    if rope is None:
        for cfg in own.values() if layout is None and not mla.rotates_interleaved_itself(model) else ():
            if cfg.layout != modeling_layout(getattr(model.config, "model_type", None)):
                # e.g. rope_interleave configs: their modeling code may rotate in its own way; be explicit
                raise ValueError(f"{type(model).__name__}'s config implies layout {cfg.layout!r}; pass layout= (or "
                                 "rope=) with the layout its q/k weights are stored in")
        chosen = own
    else:
        if not isinstance(rope, RopeConfig):
            raise TypeError(f"rope must be a ropekit.RopeConfig or None, got {type(rope).__name__}")
        if (rope.head_dim, rope.rotary_dim) != (first.head_dim, first.rotary_dim):
            raise ValueError(f"rope has head_dim {rope.head_dim}, rotary_dim {rope.rotary_dim}; the model has "
                             f"head_dim {first.head_dim}, rotary_dim {first.rotary_dim}")
        rope_axes = rope.axes.n_axes if rope.axes else 1
        if own_axes != rope_axes:
            raise ValueError(f"rope has {rope_axes} position axes but {type(model).__name__} has {own_axes} "
                             f"({first.axes!r}); pass a RopeConfig with a matching axis plan")
        rope = schedules.with_model_schedule(rope, first, type(model).__name__)  # a NoPE layer stays NoPE
        chosen = {t: rope for t in layer_types}
    if layout is not None:
        layout = check_layout(layout)
        chosen = {t: dataclasses.replace(cfg, layout=layout) for t, cfg in chosen.items()}
    for cfg in chosen.values():
        if getattr(cfg.scaling, "dynamic", False) and getattr(cfg.scaling, "fixed_seq_len", None) is None:
            raise ValueError("length-dependent scaling (dynamic NTK, LongRoPE) needs fixed_seq_len for a KV cache; "
                             "use RopeConfig.from_hf(config, fixed_seq_len=...)")
    frequencies = {t: cfg.inv_frequencies() for t, cfg in chosen.items()}
    frequencies[None] = frequencies[layer_types[0]]
    return frequencies, chosen[layer_types[0]]


def patchable_modules(model: torch.nn.Module) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """``(rotary embedding modules, attention modules)`` that :func:`patch` would override.

    Works on a model built on the ``meta`` device too (nothing is computed). Raises ``ValueError``
    naming the model class when either list is empty or the modeling code's ``apply_rotary_pos_emb``
    is not the ``(q, k, cos, sin)`` form: a family :func:`patch` does not support.
    """
    if llama4.handles(model):  # complex freqs_cis and apply_rotary_emb
        return llama4.patchable_modules(model)
    text = _language_model(model)  # a multimodal model's vision tower is left alone
    rotary = [m for m in text.modules() if _is_rotary(m)]
    attention = [m for m in text.modules() if type(m).__name__.endswith("Attention") and _modeling_module(m)]
    rotations = [_modeling_module(m).apply_rotary_pos_emb for m in attention]
    if not rotary or not attention or not all(_takes_q_and_k(getattr(f, "__ropekit_original__", f)) for f in rotations):
        raise ValueError(f"{type(model).__name__}: found {len(rotary)} rotary embedding and {len(attention)} "
                         "attention modules; ropekit.integrations.transformers supports models with a "
                         "*RotaryEmbedding module and apply_rotary_pos_emb(q, k, cos, sin) (Llama, Mistral, Qwen2/3, "
                         "Gemma 3, OLMo 2/3, Phi-3, GPT-NeoX, SmolLM3, Qwen2-VL, Qwen2.5-VL, Qwen3-VL; Llama 4 "
                         "text models through their apply_rotary_emb)")
    return rotary, attention


def patch(model: torch.nn.Module, *, rope: RopeConfig | None = None, layout: str | None = None,
          backend: str = "auto", fuse: bool = True) -> torch.nn.Module:
    """Compute ``model``'s RoPE with ropekit; returns ``model`` (patched in place).

    Args:
        model: a loaded ``transformers`` model (e.g. ``LlamaForCausalLM``) of a supported family.
        rope: the rotary embedding to use instead of the model's own (e.g. a YaRN context
            extension), for every layer type; default ``RopeConfig.from_hf(model.config)`` (per
            layer type where the config has them). Its ``head_dim``/``rotary_dim`` must match the
            model's. Its ``layout`` is the pairing q/k are rotated with: ``"half"`` for Hugging Face
            weights; ``"interleaved"`` for a checkpoint whose q/k rows are in Meta / llama.cpp order
            (e.g. converted with ``ropekit convert --to interleaved``).
        layout: the pairing q/k are rotated with, replacing ``rope``'s (or the model's own):
            ``"interleaved"`` for q/k rows in Meta / llama.cpp order, e.g. the output of ``ropekit
            convert --to interleaved`` (:func:`load_converted` loads such a directory and passes it);
            default ``None``: ``rope``'s layout, or ``"half"`` for the model's own config
            (``"interleaved"`` for Llama 4, whose modeling code rotates the pairs ``(2i, 2i + 1)``).
        backend: ropekit backend for the rotation (``"auto"`` or a name from ``ropekit.ops.available()``).
        fuse: normalise q and k inside the rotation for the families with q/k norms (see the module
            docstring), and rotate keys into the slots of a :func:`static_cache`. With ``fuse=False``
            the modeling code's own q/k norms run and ``apply_rotary_pos_emb`` receives its q/k as
            transformers computes them.

    A model with layers without RoPE (SmolLM3, Llama 4) keeps its config's schedule, ``rope=`` or not.

    Raises:
        ValueError: already patched, no rotary/attention module found, ``rope`` that does not fit
            (its ``layer_schedule`` another than the model's included), or an attention module whose
            ``use_rope`` disagrees with the config's ``no_rope_layers``.
    """
    if getattr(model, _STATE, None) is not None:
        raise ValueError("model is already patched by ropekit; call unpatch(model) first")
    if not isinstance(fuse, bool):
        raise TypeError(f"fuse must be a bool, got {type(fuse).__name__}")
    if llama4.handles(model):
        setattr(model, _STATE, llama4.patch(model, rope=rope, layout=layout, backend=backend))
        return model
    rotary, attention = patchable_modules(model)
    frequencies, rope = _frequencies(model, rope, rotary, layout)
    entries = schedules.layer_entries(attention, rope.layer_schedule)  # raises where use_rope disagrees
    for m in rotary:
        if rope.axes is not None:
            m.forward = types.MethodType(_multi_axis_rotary_forward(rope.axis_plan()), m)
            continue
        device = next(m.buffers(), torch.empty(0)).device
        m.forward = types.MethodType(_rotary_forward({t: (inv.to(device), scale)
                                                      for t, (inv, scale) in frequencies.items()}), m)
    rotating_layer = None
    if fuse:
        from .transformers_cache import RotatingStaticLayer

        rotating_layer = RotatingStaticLayer
    deferred = [n for m in attention for n in (norms.install(m) if fuse else [])]
    modules = []
    for m, entry in zip(attention, entries, strict=True):
        into_cache = rotating_layer if type(m).__name__ in norms.KEY_INTO_CACHE_ATTENTION else None
        m.forward = types.MethodType(_attention_forward(m.forward, rope.layout, backend, fuse, into_cache, entry), m)
        mod = _modeling_module(m)
        if mod.__name__ not in modules:
            modules.append(mod.__name__)
    for name in modules:
        mod = sys.modules[name]
        if name not in _INSTALLED:
            _INSTALLED[name] = [mod.apply_rotary_pos_emb, 0]
            mod.apply_rotary_pos_emb = _dispatcher(mod.apply_rotary_pos_emb)
        _INSTALLED[name][1] += 1
        mla.install(name)  # DeepSeek MLA's apply_rotary_pos_emb_interleave, where the modeling module has one
    setattr(model, _STATE, {"rotary": rotary, "attention": attention, "norms": deferred, "modules": modules,
                            "rope": rope})
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: remove the forward overrides and, when no patched model uses it, the dispatcher."""
    state = getattr(model, _STATE, None)
    if state is None:
        raise ValueError("model is not patched by ropekit")
    for m in state["rotary"] + state["attention"] + state["norms"]:
        m.__dict__.pop("forward", None)
    for name in state["modules"]:
        mla.uninstall(name)
        entry = _INSTALLED[name]
        entry[1] -= 1
        if entry[1] == 0:
            sys.modules[name].apply_rotary_pos_emb = entry[0]
            del _INSTALLED[name]
    for undo in state.get("undo", ()):  # the Llama 4 text model's apply_rotary_emb
        undo()
    delattr(model, _STATE)
    return model


def load_converted(path: Any, *, model_class: Any = None, backend: str = "auto", **kwargs: Any) -> torch.nn.Module:
    """Load a model directory written by ``ropekit convert`` so that it computes right; returns the model.

    A directory whose ``config.json`` records a layout (q/k rows in a layout transformers does not
    rotate that model in, e.g. ``ropekit convert --to interleaved`` of a Llama; plain
    ``from_pretrained`` refuses it) is built from the original config it keeps
    (:func:`.transformers_load.converted_config`), its weights loaded as they are, and the model
    patched with the recorded layout (:func:`patch` with ``layout=``; :func:`unpatch` would make it
    compute wrong again). Any other directory is loaded by ``model_class.from_pretrained`` as it
    is, unpatched.

    Args:
        path: the local output directory of ``ropekit convert``.
        model_class: a transformers class with ``from_pretrained``; default ``AutoModelForCausalLM``.
        backend: ropekit backend for the rotation (see :func:`patch`).
        **kwargs: passed to ``from_pretrained`` (``dtype``, ``attn_implementation``, ...), not ``config``.

    Raises:
        ValueError: see :func:`.transformers_load.converted_config`, and :func:`patch`'s.
        TypeError: ``config`` among ``kwargs``.
    """
    import transformers

    from .transformers_load import converted_config

    if "config" in kwargs:
        raise TypeError("load_converted builds the config from path/config.json; do not pass config=")
    model_class = transformers.AutoModelForCausalLM if model_class is None else model_class
    config, layout = converted_config(path)
    if layout is None:
        return model_class.from_pretrained(path, **kwargs)
    model = model_class.from_pretrained(path, config=config, **kwargs)
    return patch(model, layout=layout, backend=backend)


def static_cache(model: torch.nn.Module, max_cache_len: int, **kwargs: Any):
    """A transformers ``StaticCache`` whose full-attention layers take keys rotated into their slots.

    See :func:`ropekit.integrations.transformers_cache.static_cache`; useful on a model patched
    with ``fuse=True`` (the default), where it saves the key's second pass.
    """
    from .transformers_cache import static_cache as build

    return build(model, max_cache_len, **kwargs)


_KERNELS_STATE = "_ropekit_kernels"


def _kernels_gate() -> str:
    """Which ``kernels`` versions this transformers marks its layers for, and which is installed."""
    try:
        from transformers import __version__ as tf_version
        from transformers.utils import import_utils
    except ImportError:
        return "transformers is not installed"
    low, high = getattr(import_utils, "KERNELS_MIN_VERSION", "?"), getattr(import_utils, "KERNELS_MAX_VERSION", "?")
    try:
        from importlib.metadata import version

        found = f"kernels {version('kernels')} is installed"
    except Exception:
        found = "kernels is not installed"
    return f"transformers {tf_version} marks its layers only with kernels >= {low}, < {high} installed; {found}"


def kernel_hooks(model: torch.nn.Module) -> dict[str, list[torch.nn.Module]]:
    """The modules of ``model`` carrying transformers' kernel hooks that ropekit maps.

    Returns ``{"RMSNorm": [norm modules marked "RMSNorm"], "rotary_pos_emb": [attention modules
    whose attached ``apply_rotary_pos_emb`` is marked "rotary_pos_emb"]}``; both lists are empty
    when the modeling code carries no hooks (an older transformers, or a ``kernels`` version
    outside the range transformers accepts: its decorators then do nothing).
    """
    found: dict[str, list[torch.nn.Module]] = {"RMSNorm": [], "rotary_pos_emb": []}
    for module in model.modules():
        if getattr(type(module), "kernel_layer_name", None) == "RMSNorm":
            found["RMSNorm"].append(module)
        funcs = module.__dict__.get("_kernel_funcs") or {}
        if any(getattr(f, "kernel_layer_name", None) == "rotary_pos_emb" for f in funcs.values()):
            found["rotary_pos_emb"].append(module)
    return found


def kernelize(model: torch.nn.Module, *, device: str | None = None, mode: Any = None) -> torch.nn.Module:
    """Plug ropekit into ``model`` through transformers' own kernel hooks; returns ``model``.

    Through ``kernels.kernelize`` under :func:`ropekit.integrations.hub_kernels.kernel_mapping`
    (ropekit's mapping only, not transformers' hub defaults): the norms marked ``"RMSNorm"``
    compute with ropekit's RMSNorm where their formula is ropekit's, and the attention modules
    rotate q/k with :func:`ropekit.apply_rotary_qk` through the ``"rotary_pos_emb"`` hook. No
    modeling module is patched: the norms are replaced on this model's instances, and the
    rotation, which transformers shares between all models of a family, runs ropekit's code only
    inside this model's attention modules (per thread), so other models of the family, kernelized
    or not, can run at the same time in other threads. The tables stay transformers' own (its
    rotary embedding module, cos/sin in the activation dtype); q/k norms are not fused into the
    rotation and keys are not rotated into a cache: :func:`patch` does those.

    Args:
        model: a loaded ``transformers`` model whose modeling code carries the hooks
            (:func:`kernel_hooks`).
        device: the device type to map (``"cpu"``, ``"cuda"``); default: the model's parameters'.
        mode: a ``kernels.Mode``; default ``Mode.TRAINING`` if ``model.training`` else ``Mode.INFERENCE``.

    Raises:
        ImportError: the ``kernels`` package is not installed.
        ValueError: ``model`` carries no hook ropekit maps, is patched by :func:`patch`, or is
            already kernelized by ropekit.
    """
    import kernels

    from .hub_kernels import enter_attention, exit_attention, kernel_mapping

    if getattr(model, _STATE, None) is not None:
        raise ValueError("model is patched by ropekit; call unpatch(model) before kernelize(model)")
    if getattr(model, _KERNELS_STATE, None) is not None:
        raise ValueError("model is already kernelized by ropekit; call unkernelize(model) first")
    hooks = kernel_hooks(model)
    if not hooks["RMSNorm"] and not hooks["rotary_pos_emb"]:
        raise ValueError(f"{type(model).__name__} carries none of transformers' kernel hooks (RMSNorm, "
                         f"rotary_pos_emb): {_kernels_gate()}. Use ropekit.integrations.transformers.patch(model)")
    if device is None:
        device = next(model.parameters()).device.type
    if mode is None:
        mode = kernels.Mode.TRAINING if model.training else kernels.Mode.INFERENCE
    with kernels.use_kernel_mapping(kernel_mapping((device,)), inherit_mapping=False):
        kernels.kernelize(model, mode=mode, device=device, use_fallback=True)
    handles = []
    for attention in hooks["rotary_pos_emb"]:
        handles.append(attention.register_forward_pre_hook(enter_attention))
        handles.append(attention.register_forward_hook(exit_attention, always_call=True))
    setattr(model, _KERNELS_STATE, {"norms": hooks["RMSNorm"], "handles": handles})
    return model


def unkernelize(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`kernelize`: the norms run their class's ``forward``, the attention modules transformers' rotation.

    The family's shared rotation module keeps ropekit's ``forward``, which runs transformers'
    function outside kernelized models.
    """
    from .hub_kernels import layers

    state = getattr(model, _KERNELS_STATE, None)
    if state is None:
        raise ValueError("model is not kernelized by ropekit")
    for handle in state["handles"]:
        handle.remove()
    for norm in state["norms"]:
        if getattr(norm.__dict__.get("forward"), "__func__", None) is layers.RMSNorm.forward:
            del norm.__dict__["forward"]
    delattr(model, _KERNELS_STATE)
    return model
