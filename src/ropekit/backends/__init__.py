"""Kernels that rotate a tensor given cos/sin tables; :func:`select` picks one.

Every backend exposes ``rotate(x, cos, sin, *, layout, conjugate, inplace)`` with
the semantics of :func:`ropekit.backends.torch_eager.rotate`. The reference backend
(:mod:`ropekit.backends.reference`) is the float64 oracle and is not selectable here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import torch_eager

RotateFn = Callable[..., torch.Tensor]

_BACKENDS: dict[str, RotateFn] = {"torch": torch_eager.rotate}


def available() -> list[str]:
    """Names accepted by ``apply_rotary(..., backend=...)`` besides ``"auto"``."""
    return sorted(_BACKENDS)


def register(name: str, rotate: RotateFn) -> None:
    """Make ``rotate`` selectable as ``backend=name``."""
    _BACKENDS[name] = rotate


def select(backend: str, x: torch.Tensor) -> RotateFn:
    """Return the kernel named ``backend``, or the best one for ``x`` when ``"auto"``."""
    if backend == "auto":
        return _BACKENDS["torch"]
    try:
        return _BACKENDS[backend]
    except KeyError:
        raise ValueError(f"backend must be 'auto' or one of {available()}, got {backend!r}") from None
