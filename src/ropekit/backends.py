"""Compatibility names: the backend registry lives in :mod:`ropekit.ops` (same functions).

``available()`` and ``register(name, backend)`` work as before; ``register`` also still takes
a bare ``rotate(x, cos, sin, *, layout, conjugate, inplace)`` function (deprecated: wrap it in
a :class:`ropekit.ops.Backend` to give it pair and by-position forms of its own).
"""

from __future__ import annotations

import warnings

import torch

from .ops import dispatch
from .ops.backend import Backend
from .ops.dispatch import available

__all__ = ["available", "register", "select"]


class _FunctionBackend(Backend):
    """A bare ``rotate`` function as a backend (the other forms by the defaults)."""

    def __init__(self, name: str, rotate) -> None:
        self.name = name
        self._rotate = rotate

    def rotate(self, x, cos, sin, *, layout, conjugate, inplace):  # noqa: D102
        return self._rotate(x, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)


def register(name: str, backend) -> None:
    """Make ``backend`` selectable as ``backend=name`` (see :func:`ropekit.ops.register`)."""
    if not isinstance(backend, Backend) and callable(backend):
        warnings.warn("register(name, function) is deprecated: pass a ropekit.ops.Backend", DeprecationWarning,
                      stacklevel=2)
        backend = _FunctionBackend(name, backend)
    dispatch.register(name, backend)


def select(backend: str, x: torch.Tensor) -> Backend:
    """The backend object ``backend`` names for ``x`` (``"auto"`` picks by device)."""
    return dispatch.get(dispatch.resolve(backend, x.device.type))
