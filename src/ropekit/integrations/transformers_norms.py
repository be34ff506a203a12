"""The q/k norms of transformers models, deferred into ropekit's fused RMSNorm + rotation.

In the attention classes whose data flow was checked (:data:`FUSABLE_ATTENTION`:
``q_norm``/``k_norm`` → view/transpose → ``apply_rotary_pos_emb`` → ``past_key_values.update``),
the patched norm modules do not normalise: they return their input and record it with the
norm's parameters in the running attention call (:class:`Call`). ropekit's
``apply_rotary_pos_emb`` then finds q and k among the recorded inputs (same memory) and
normalises and rotates them in one pass. A recorded norm that never reaches the rotation
raises RuntimeError when the attention call ends: a changed data flow fails loudly instead of
running attention on unnormalised q or k.

Norm forms (:data:`NORM_FORMS`): the weight multiplies the normalised value (Qwen3, OLMo 2/3)
or ``1 + weight`` does (Gemma 3: ``weight_offset=1``); OLMo 2/3 normalise the whole projection,
all heads of a token together (``norm="per_token"``). Each module is also checked at patch time
on a float32 probe against the fused formula; one that differs is left alone (not deferred).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config.families import attention_classes, norm_offsets
from ..fused import rms_norm_rotary

# attention classes whose forward goes norm -> (view, transpose) -> apply_rotary_pos_emb -> cache update
FUSABLE_ATTENTION = attention_classes(fusable=True)  # rows of ropekit.config.families
# attention classes that pass the key apply_rotary_pos_emb returns straight to past_key_values.update
KEY_INTO_CACHE_ATTENTION = attention_classes(key_into_cache=True)
# norm class -> weight_offset (the gains are weight_offset + weight)
NORM_FORMS = norm_offsets()


@dataclass(frozen=True)
class NormSpec:
    """What a q or k norm module computes: ``(x / rms(x)) * (weight_offset + weight)`` over ``n`` channels."""

    module: torch.nn.Module
    eps: float
    weight_offset: float

    @property
    def weight(self) -> torch.Tensor:
        """The norm module's weight (read at each call: it may be trained or moved)."""
        return self.module.weight


@dataclass
class Call:
    """One running patched attention forward: its options and what its deferred steps left to do."""

    layout: str
    backend: str
    fuse: bool
    cache_layer: Any = None  # a ropekit cache layer the keys may be rotated into, or None
    pending: dict = field(default_factory=dict)  # "q"/"k" -> (deferred norm input, NormSpec)
    deferred_key: Any = None  # (returned key, k, spec or None, cos, sin) for the cache layer's update
    layer_rotates: tuple[int, bool] | None = None  # (layer index, whether its NoPE schedule rotates it), or None
    rotated: bool = False  # whether the rotation ran in this call


ACTIVE: list[Call] = []  # the patched attention calls now running, innermost last


def current() -> Call | None:
    """The innermost patched attention call running, or None."""
    return ACTIVE[-1] if ACTIVE else None


def norm_spec(norm: torch.nn.Module) -> NormSpec | None:
    """The fused form of a q/k norm module, or None when it is not one ropekit knows and can check."""
    offset = NORM_FORMS.get(type(norm).__name__)
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if offset is None or not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float):
        return None
    spec = NormSpec(norm, eps, offset)
    return spec if _agrees(spec) else None


def _agrees(spec: NormSpec) -> bool:
    """Whether the module computes the fused formula on a float32 probe (to float32 rounding)."""
    n = spec.weight.numel()
    probe = torch.randn(3, n, generator=torch.Generator().manual_seed(0), device="cpu") * 3
    probe = probe.to(spec.weight.device)
    with torch.no_grad():
        got = type(spec.module).forward(spec.module, probe).float()
        no_rotation = probe.new_zeros(0)  # rotary_dim 0: the norm alone
        want = rms_norm_rotary(probe, spec.weight.float(), no_rotation, no_rotation, eps=spec.eps,
                               weight_offset=spec.weight_offset)
    return got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-5, atol=1e-6))


def deferred_forward(role: str, spec: NormSpec):
    """The norm module's patched ``forward``: records its input in the running call instead of normalising."""
    original = type(spec.module).forward

    def forward(self, x, *args, **kwargs):
        call = current()
        if call is None or not call.fuse or args or kwargs or torch.compiler.is_compiling():
            return original(self, x, *args, **kwargs)
        if role in call.pending:
            raise RuntimeError(f"ropekit: {type(self).__name__} ({role}_norm) ran twice in one attention call before "
                               "apply_rotary_pos_emb; this attention's data flow is not the one ropekit fuses")
        call.pending[role] = (x, spec)
        return x

    return forward


def install(attention: torch.nn.Module) -> list[torch.nn.Module]:
    """Defer the q/k norms of one attention module; returns the norm modules patched (none if not fusable)."""
    if type(attention).__name__ not in FUSABLE_ATTENTION:
        return []
    if getattr(getattr(attention, "config", None), "clip_qkv", None) is not None:  # a clamp between norm and rotation
        return []
    specs = {role: norm_spec(getattr(attention, f"{role}_norm", None)) for role in ("q", "k")}
    if None in specs.values():
        return []
    for role, spec in specs.items():
        spec.module.forward = types.MethodType(deferred_forward(role, spec), spec.module)
    return [spec.module for spec in specs.values()]


def same_memory(t: torch.Tensor, x: torch.Tensor) -> bool:
    """``t`` is a view of all of ``x`` (the deferred norm's input reshaped or transposed on its way)."""
    return t.data_ptr() == x.data_ptr() and t.numel() == x.numel() and t.dtype == x.dtype


def check_consumed(call: Call, attention: torch.nn.Module) -> None:
    """Raise when a deferred step of ``call`` was never done (the normalised q/k would be missing)."""
    left = sorted(call.pending) + (["the key's cache write"] if call.deferred_key is not None else [])
    if left:
        raise RuntimeError(f"ropekit: the deferred {', '.join(left)} of {type(attention).__name__} never reached "
                           "apply_rotary_pos_emb / the cache update: this attention's data flow is not the one ropekit "
                           "fuses (call unpatch(model), or patch(model, fuse=False))")
