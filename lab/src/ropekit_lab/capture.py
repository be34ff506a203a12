"""q and k before and after the rotation, in every attention layer of a model patched by ropekit.

``ropekit.integrations.transformers.patch(model, fuse=False)`` makes each attention module of a
supported family rotate q and k through its modeling module's ``apply_rotary_pos_emb`` (ropekit's
rotation while a patched attention runs), with the modeling code's own q/k norms. :func:`capturing`
wraps, while it is entered, each attention module's ``forward`` (to know which layer runs) and that
function (to see what it receives and returns), and calls
``callback(module, q, k, q_rotated, k_rotated)`` for each rotation: ``module.layer_idx`` says which
layer; q/k are ``(batch, heads, seq, head_dim)`` and ``(batch, kv_heads, seq, head_dim)`` as the
modeling code passes them (after a q/k norm, before any grouped-query repeat). On exit every
module is as before. ``ropekit probe`` measures with it (:class:`ropekit_lab.probe.Capture`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from ropekit.integrations.transformers import patchable_modules

#: ``callback(module, q, k, q_rotated, k_rotated)``; it must not change the tensors.
Callback = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def _layer_forward(module: torch.nn.Module, inner: Callable, running: list[torch.nn.Module]) -> Callable:
    """``module``'s forward, marking ``module`` as the running layer while ``inner`` runs."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        running.append(module)
        try:
            return inner(*args, **kwargs)
        finally:
            running.pop()

    return forward


def _rotation(inner: Callable, running: list[torch.nn.Module], callback: Callback) -> Callable:
    """``apply_rotary_pos_emb`` calling ``inner`` and handing its inputs and outputs to ``callback``."""

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        q_out, k_out = inner(q, k, cos, sin, *args, **kwargs)
        if running:  # a rotation outside the model's attention modules (another model) is not this capture's
            callback(running[-1], q, k, q_out, k_out)
        return q_out, k_out

    return apply_rotary_pos_emb


@contextmanager
def capturing(model: torch.nn.Module, callback: Callback) -> Iterator[None]:
    """While entered, call ``callback(module, q, k, q_rotated, k_rotated)`` for each rotation of ``model``.

    Args:
        model: a transformers model patched with ``ropekit.integrations.transformers.patch(model,
            fuse=False)``: with ``fuse=True`` the q/k norms of some families are deferred into the
            rotation, and the tensors seen here would be their inputs. Enter after ``patch`` and leave
            before ``unpatch``.
        callback: called once per attention layer and forward.

    Raises:
        TypeError: ``callback`` is not callable.
        ValueError: ``model`` is not of a family ropekit patches (from ``patchable_modules``).
    """
    if not callable(callback):
        raise TypeError(f"callback must be callable, got {type(callback).__name__}")
    _, attention = patchable_modules(model)
    running: list[torch.nn.Module] = []
    with ExitStack() as restore:
        for module in attention:
            own = module.__dict__.get("forward")  # ropekit's patched forward (an instance attribute)
            module.forward = _layer_forward(module, module.forward, running)
            restore.callback(_put_back_forward, module, own)
        for name in dict.fromkeys(type(module).__module__ for module in attention):
            modeling = sys.modules[name]
            inner = modeling.apply_rotary_pos_emb
            wrapper = _rotation(inner, running, callback)
            modeling.apply_rotary_pos_emb = wrapper
            restore.callback(_put_back_rotation, modeling, wrapper, inner)
        yield


def _put_back_forward(module: torch.nn.Module, own: Callable | None) -> None:
    if own is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = own


def _put_back_rotation(modeling: Any, wrapper: Callable, inner: Callable) -> None:
    if modeling.apply_rotary_pos_emb is wrapper:
        modeling.apply_rotary_pos_emb = inner
