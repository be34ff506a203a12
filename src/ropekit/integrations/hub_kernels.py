"""ropekit as kernel layers for transformers' own extension point (the ``kernels`` package).

transformers marks its modeling code for the ``kernels`` package: the RMSNorm classes with
``@use_kernel_forward_from_hub("RMSNorm")`` and ``apply_rotary_pos_emb`` with
``@use_kernel_forward_from_hub("rotary_pos_emb")`` (the function becomes one ``nn.Module``
instance per modeling module, attached to every attention module by ``@use_kernelized_func``).
``kernels.kernelize(model, ...)``, under a kernel mapping, replaces the ``forward`` of the marked
modules it finds in ``model`` with the ``forward`` of the mapped layer classes. This module holds
those layer classes and the mapping that points at them:

* :class:`layers.RMSNorm`: the norm through :func:`ropekit.rms_norm_rotary` (no rotation), for a
  norm class whose formula ``x / rms(x) * (offset + weight)`` (offset 0: Llama, Qwen3, OLMo 2;
  1: Gemma) ropekit checks on a float32 probe; any other class keeps its own ``forward``.
* :class:`layers.RotaryPosEmb`: transformers' ``apply_rotary_pos_emb(q, k, cos, sin,
  unsqueeze_dim=1)`` through :func:`ropekit.apply_rotary_qk`. transformers passes **full-width**
  tables (``head_dim`` channels, the half layout's ``cat((c, c), -1)``); ropekit takes the
  first half. Checked per modeling function and shape on a float32 probe; a function whose
  result differs (another pairing, partial rotary done its own way) keeps its own ``forward``.
* :class:`RopekitRepository` and :func:`kernel_mapping`: the mapping for
  ``kernels.use_kernel_mapping`` (or ``register_kernel_mapping``), for the ``"cpu"`` and
  ``"cuda"`` devices. It loads the layers from this module: no hub, no files.

Per model and per thread. ``kernels`` replaces a norm's ``forward`` on the module instance (the
norms of other models keep transformers' own), but ``apply_rotary_pos_emb`` is one module
instance shared by every model of the family, so replacing its ``forward`` reaches them all. The
rotary layer therefore rotates with ropekit only while an attention module that
:func:`ropekit.integrations.transformers.kernelize` hooked is running in the calling thread (a
context variable, set and reset by forward hooks on those attention modules); in any other call
it runs transformers' function. Two models of one family, one kernelized and one not, can run
in two threads at once.

Precision: float32 arithmetic whatever the activation dtype, one rounding to the input dtype
(transformers rounds the normalised value before the weight, and each product of the rotation,
in bfloat16/float16); in float32 the results agree with transformers' to float32 rounding.
"""

from __future__ import annotations

import contextvars
import copy
import threading

import torch
from torch import nn

from .. import functional, fused
from ..functional import apply_rotary_qk
from ..fused import rms_norm_rotary

LAYER_NAMES = ("RMSNorm", "rotary_pos_emb")  # the names transformers marks its modules with
_LAYER_CLASSES = {"RMSNorm": "RMSNorm", "rotary_pos_emb": "RotaryPosEmb"}

# how many attention modules hooked by ropekit are running in this thread (context)
_ACTIVE: contextvars.ContextVar[int] = contextvars.ContextVar("ropekit_hub_kernels_active", default=0)

_lock = threading.Lock()
_norm_forms: dict[type, float | None] = {}  # norm class -> weight offset, or None: not ropekit's formula
_rotary_forms: dict[tuple, bool] = {}  # (function-module class, head_dim, table width) -> ropekit agrees

def _eps(module: nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (float, int)) and not isinstance(eps, bool) else None


def _norm_offset(module: nn.Module) -> float | None:
    """The weight offset of ``module``'s RMSNorm formula (0 or 1), or None when ropekit does not compute it.

    Checked once per class on a copy of the module with a random weight: its own ``forward``
    on a float32 probe ``(3, n)`` against :func:`ropekit.rms_norm_rotary` without rotation.
    """
    cls = type(module)
    with _lock:
        if cls in _norm_forms:
            return _norm_forms[cls]
    offset = None
    weight, eps = getattr(module, "weight", None), _eps(module)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1 and eps is not None:
        probe_module = copy.deepcopy(module).to(device="cpu", dtype=torch.float32)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            probe_module.weight.copy_(torch.rand(weight.shape, generator=gen) * 2 - 0.5)
            x = torch.randn(3, weight.numel(), generator=gen) * 3
            got = cls.forward(probe_module, x)
            empty = x.new_zeros(0)
            for candidate in (0.0, 1.0):
                want = fused.rms_norm_rotary(x, probe_module.weight, empty, empty, eps=eps, weight_offset=candidate)
                if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(
                        got.float(), want, rtol=1e-5, atol=1e-6):
                    offset = candidate
                    break
    with _lock:
        _norm_forms[cls] = offset
    return offset


def _rotary_agrees(module: nn.Module, head_dim: int, width: int) -> bool:
    """Whether the modeling function wrapped by ``module`` computes ropekit's half-layout rotation.

    Checked once per (function, ``head_dim``, table width) on float32 probes: q ``(1, 2, 3,
    head_dim)``, k ``(1, 1, 3, head_dim)``, full-width tables ``(1, 3, width)`` in the half layout.
    """
    key = (type(module), head_dim, width)
    with _lock:
        if key in _rotary_forms:
            return _rotary_forms[key]
    agrees = False
    if width == head_dim and width % 2 == 0:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, 3, head_dim, generator=gen)
        k = torch.randn(1, 1, 3, head_dim, generator=gen)
        angles = torch.rand(1, 3, width // 2, generator=gen) * 6
        cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
        with torch.no_grad():
            try:
                got = type(module).forward(module, q, k, cos, sin)
            except Exception:  # another signature or shape convention: not the function ropekit replaces
                got = None
            half = width // 2
            want = functional.apply_rotary_qk(q, k, cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1))
        agrees = (isinstance(got, tuple) and len(got) == 2 and all(
            isinstance(g, torch.Tensor) and g.shape == w.shape and torch.allclose(g, w, rtol=1e-5, atol=1e-6)
            for g, w in zip(got, want, strict=True)))
    with _lock:
        _rotary_forms[key] = agrees
    return agrees


def active() -> bool:
    """Whether an attention module hooked by ropekit is running in the calling thread."""
    return _ACTIVE.get() > 0


def enter_attention(module, args, kwargs=None):
    """Forward pre-hook of a hooked attention module: ropekit rotates until the module returns."""
    _ACTIVE.set(_ACTIVE.get() + 1)


def exit_attention(module, args, *rest):
    """Forward hook (``always_call=True``) of a hooked attention module: undoes :func:`enter_attention`."""
    _ACTIVE.set(_ACTIVE.get() - 1)


class layers:  # noqa: N801 - the ``kernels`` package looks layers up as attributes of ``<kernel>.layers``
    """The layer classes ``kernels`` swaps in: stateless, ``forward`` only (``kernels`` checks both)."""

    class RMSNorm(nn.Module):
        """``forward`` for a transformers RMSNorm module (``weight`` ``(n,)``, ``variance_epsilon``/``eps``).

        ``hidden_states`` ``(..., n)`` any float dtype → same shape and dtype:
        ``x / sqrt(mean(x**2) + eps) * (offset + weight)`` in float32, rounded once. A norm class
        whose formula ropekit does not compute (checked once on a probe), a call while
        ``torch.compile`` traces, or a tensor subclass run the class's own ``forward``.
        """

        has_backward = True
        can_torch_compile = False

        def forward(self, hidden_states):  # noqa: D102
            offset = None
            if type(hidden_states) is torch.Tensor and not torch.compiler.is_compiling():
                offset = _norm_offset(self)
            if offset is None:
                return type(self).forward(self, hidden_states)
            empty = hidden_states.new_zeros(0, dtype=torch.float32)
            return rms_norm_rotary(hidden_states, self.weight, empty, empty, eps=_eps(self), weight_offset=offset)

    class RotaryPosEmb(nn.Module):
        """``forward`` for transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` module.

        ``q`` ``(batch, heads, seq, head_dim)``, ``k`` ``(batch, kv_heads, seq, head_dim)`` (any
        float dtype), ``cos``/``sin`` ``(batch, seq, head_dim)`` full-width half-layout tables
        (``unsqueeze_dim=1`` makes them broadcast; ``2`` for ``(batch, seq, heads, head_dim)``
        q/k) → ``(q_rotated, k_rotated)`` with the shapes and dtypes of q and k, through
        :func:`ropekit.apply_rotary_qk` on the tables' first half. Outside a hooked attention
        module (:func:`active`), for a function ropekit does not match (checked once per
        function and shape), while ``torch.compile`` traces, or for tensor subclasses, the
        modeling code's own function runs.
        """

        has_backward = True
        can_torch_compile = False

        def forward(self, q, k, cos, sin, unsqueeze_dim=1):  # noqa: D102
            if (active() and not torch.compiler.is_compiling()
                    and all(type(t) is torch.Tensor for t in (q, k, cos, sin))
                    and q.dim() >= 2 and k.shape[-1] == q.shape[-1] == cos.shape[-1]
                    and _rotary_agrees(self, q.shape[-1], cos.shape[-1])):
                half = cos.shape[-1] // 2
                return apply_rotary_qk(q, k, cos[..., :half].unsqueeze(unsqueeze_dim),
                                       sin[..., :half].unsqueeze(unsqueeze_dim))
            return type(self).forward(self, q, k, cos, sin, unsqueeze_dim)


class RopekitRepository:
    """A ``kernels`` repository (``load()`` → layer class) serving :class:`layers` from this module.

    Args:
        layer_name: ``"RMSNorm"`` or ``"RotaryPosEmb"`` (an attribute of :class:`layers`).
    """

    def __init__(self, layer_name: str):
        if not isinstance(getattr(layers, layer_name, None), type):
            raise ValueError(f"ropekit has no kernel layer {layer_name!r}; it has RMSNorm and RotaryPosEmb")
        self.layer_name = layer_name

    def load(self) -> type[nn.Module]:
        """The layer class (``kernels`` validates it against the class it replaces)."""
        return getattr(layers, self.layer_name)

    def __eq__(self, other):
        return isinstance(other, RopekitRepository) and other.layer_name == self.layer_name

    def __hash__(self):
        return hash(("ropekit", self.layer_name))

    def __str__(self) -> str:
        return f"ropekit (layer `{self.layer_name}`)"

    __repr__ = __str__


def kernel_mapping(devices: tuple[str, ...] = ("cpu", "cuda"), layer_names: tuple[str, ...] = LAYER_NAMES) -> dict:
    """The kernel mapping that routes transformers' marked layers to ropekit.

    ``{"RMSNorm": {device: RopekitRepository("RMSNorm")}, "rotary_pos_emb": {device:
    RopekitRepository("RotaryPosEmb")}}`` for each device type, registered for every mode
    (``kernels``' fallback mode: inference and training; ``torch.compile`` modes fall back to
    transformers' own forward). Pass it to ``kernels.use_kernel_mapping`` /
    ``kernels.register_kernel_mapping``, or use :func:`ropekit.integrations.transformers.kernelize`,
    which also turns the rotation on for the kernelized model only (see the module docstring).
    ``"cuda"`` runs the same code (ropekit's Triton kernels); only ``"cpu"`` is tested here.
    """
    unknown = set(layer_names) - set(LAYER_NAMES)
    if unknown:
        raise ValueError(f"unknown layer names {sorted(unknown)}; ropekit maps {list(LAYER_NAMES)}")
    return {name: {device: RopekitRepository(_LAYER_CLASSES[name]) for device in devices} for name in layer_names}
