"""Kernels that rotate a tensor given cos/sin tables; :func:`select` picks one.

Every backend exposes ``rotate(x, cos, sin, *, layout, conjugate, inplace)`` with
the semantics of :func:`ropekit.backends.torch_eager.rotate`:

- ``"torch"``: plain PyTorch ops, any device and dtype (chunked, float32 arithmetic);
- ``"cpu"``: a native C kernel compiled at first use (one pass over memory, GIL released,
  rows split over ``torch.get_num_threads()`` threads); see :mod:`.cpu_native`;
- ``"triton"``: the fused Triton kernel for CUDA tensors (registered as ``torch.library``
  ops, so ``torch.compile(fullgraph=True)`` traces it); see :mod:`.triton_api`.

``"auto"`` picks triton for CUDA tensors when triton is installed, the native kernel for
CPU tensors when a C compiler is available, and the torch backend otherwise. The reference
backend (:mod:`ropekit.backends.reference`) is the float64 oracle and is not selectable here.

:func:`pair_of` gives a backend's q-and-k form (one native call on the CPU, one Triton launch
on CUDA, else two ``rotate`` calls); :func:`runner` and :func:`pair_runner` give the prepared
calls behind ``apply_rotary``'s decode fast path.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from . import cpu_native, torch_eager

RotateFn = Callable[..., torch.Tensor]
PairFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

_BACKENDS: dict[str, RotateFn] = {"torch": torch_eager.rotate}
_PAIRS: dict[RotateFn, PairFn] = {}


def _triton_rotate() -> RotateFn | None:
    """The Triton backend, imported on first use (importing triton costs ~0.2 s)."""
    if "triton" not in _BACKENDS:
        if importlib.util.find_spec("triton") is None:
            return None
        from . import triton_api, triton_pair, triton_rotary  # noqa: F401 - triton_pair registers its ops

        if not triton_rotary.is_available():
            return None
        _BACKENDS["triton"] = triton_api.rotate
    return _BACKENDS["triton"]


def _cpu_rotate() -> RotateFn | None:
    """The native CPU backend when it compiled (the first call compiles, about a second)."""
    if "cpu" not in _BACKENDS:
        if not cpu_native.is_available():
            return None
        _BACKENDS["cpu"] = cpu_native.rotate
    return _BACKENDS["cpu"]


def available() -> list[str]:
    """Names accepted by ``apply_rotary(..., backend=...)`` besides ``"auto"``."""
    _cpu_rotate()
    _triton_rotate()
    return sorted(_BACKENDS)


def register(name: str, rotate: RotateFn) -> None:
    """Make ``rotate`` selectable as ``backend=name``."""
    _BACKENDS[name] = rotate


def pair_of(rotate: RotateFn) -> PairFn:
    """The q-and-k form of a backend's ``rotate``: its fused one when it has one, else two calls.

    A pair function is called as ``pair(q, k, cos_q, sin_q, cos_k, sin_k, *, layout,
    conjugate, inplace)`` and returns ``(q_out, k_out)`` (see :func:`.cpu_native.rotate_pair`).
    """
    if rotate is cpu_native.rotate:
        return cpu_native.rotate_pair
    if rotate is _BACKENDS.get("triton"):
        from . import triton_pair

        return triton_pair.rotate_pair
    cached = _PAIRS.get(rotate)
    if cached is not None:
        return cached

    def pair(q, k, cos_q, sin_q, cos_k, sin_k, *, layout, conjugate=False, inplace=False):
        return (rotate(q, cos_q, sin_q, layout=layout, conjugate=conjugate, inplace=inplace),
                rotate(k, cos_k, sin_k, layout=layout, conjugate=conjugate, inplace=inplace))

    _PAIRS[rotate] = pair
    return pair


def runner(rotate: RotateFn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, layout: str,
           inplace: bool) -> Callable[..., torch.Tensor] | None:
    """A prepared ``run(x, cos, sin)`` of ``rotate`` for this signature, when the backend has one.

    Only the native CPU kernel has (small tensors; see :func:`.cpu_native.runner`).
    """
    if rotate is cpu_native.rotate:
        return cpu_native.runner(x, cos, sin, layout=layout, inplace=inplace)
    return None


def pair_runner(rotate: RotateFn, q, k, cos_q, sin_q, cos_k, sin_k, *, layout: str,
                inplace: bool) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """:func:`runner` for q and k (see :func:`.cpu_native.pair_runner`)."""
    if rotate is cpu_native.rotate:
        return cpu_native.pair_runner(q, k, cos_q, sin_q, cos_k, sin_k, layout=layout, inplace=inplace)
    return None


def select(backend: str, x: torch.Tensor) -> RotateFn:
    """Return the kernel named ``backend``, or the best one for ``x`` when ``"auto"``."""
    if backend == "auto":
        if x.is_cuda:
            return _triton_rotate() or _BACKENDS["torch"]
        if x.device.type == "cpu" and not torch.compiler.is_compiling():
            # Dynamo cannot trace the ctypes call: under torch.compile the eager ops are compiled
            return _cpu_rotate() or _BACKENDS["torch"]
        return _BACKENDS["torch"]
    if backend == "cpu":
        fn = _cpu_rotate()
        if fn is None:
            raise ValueError("backend 'cpu' is unavailable: the native kernel could not be compiled")
        return fn
    if backend == "triton":
        fn = _triton_rotate()
        if fn is None:
            raise ValueError("backend 'triton' is unavailable: install triton (pip install 'ropekit[triton]')")
        return fn
    try:
        return _BACKENDS[backend]
    except KeyError:
        raise ValueError(f"backend must be 'auto' or one of {available()}, got {backend!r}") from None
