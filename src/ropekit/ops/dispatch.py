"""The backend registry: names to :class:`~ropekit.ops.backend.Backend` objects, and ``"auto"``.

Built in: ``"torch"`` (eager, any device), ``"cpu"`` (the C++ kernel, built at first use) and
``"triton"`` (CUDA; any device under ``TRITON_INTERPRET=1``). ``"auto"`` picks by device: the
C++ kernel for CPU tensors when it is available, Triton for CUDA tensors when it is installed,
the eager kernels otherwise. An explicit name never runs another backend's kernel: tensors it cannot
run raise (:func:`check_runs`). :func:`register` adds a backend under a new name (or replaces
one); every public entry point then accepts ``backend=<name>``.
"""

from __future__ import annotations

import importlib.util

import torch

from .backend import Backend
from .eager import EagerBackend

_BACKENDS: dict[str, Backend] = {"torch": EagerBackend()}
_BUILTIN_LAZY = ("cpu", "triton")
_ON_REGISTER: list = []  # callbacks run after register() (callers forget what a name meant)


def on_register(callback) -> None:
    """Call ``callback()`` after every :func:`register` (``ropekit.functional`` drops its prepared calls)."""
    _ON_REGISTER.append(callback)


def _builtin(name: str) -> Backend | None:
    """The built-in ``"cpu"``/``"triton"`` backend object, created on first use (no import cost before)."""
    if name not in _BACKENDS:
        if name == "cpu":
            from .cpu import CppBackend

            _BACKENDS["cpu"] = CppBackend()
        elif name == "triton" and importlib.util.find_spec("triton") is not None:
            from .triton import TritonBackend

            _BACKENDS["triton"] = TritonBackend()
    return _BACKENDS.get(name)


def register(name: str, backend: Backend) -> None:
    """Make ``backend`` selectable as ``backend=name`` in every rotation entry point.

    Args:
        name: a new name, or a built-in one to replace (not ``"auto"``).
        backend: a :class:`ropekit.ops.Backend` (at least its ``apply_rotary`` form).
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"name must be a non-empty string other than 'auto', got {name!r}")
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a ropekit.ops.Backend, got {type(backend).__name__}")
    _BACKENDS[name] = backend
    for callback in _ON_REGISTER:
        callback()


def available() -> list[str]:
    """Names accepted by ``backend=`` besides ``"auto"`` whose kernels can run here (may build them)."""
    for name in _BUILTIN_LAZY:
        _builtin(name)
    return sorted(name for name, b in _BACKENDS.items() if b.is_available())


def get(name: str) -> Backend:
    """The backend registered as ``name`` (a concrete name, not ``"auto"``)."""
    backend = _BACKENDS.get(name) or _builtin(name)
    if backend is None:
        raise ValueError(f"backend must be 'auto' or one of {available()}, got {name!r}")
    if not backend.is_available():
        reason = getattr(backend, "error", None) or "install triton (pip install 'ropekit[triton]')"
        raise ValueError(f"backend {name!r} is unavailable: {reason}")
    return backend


@torch.compiler.assume_constant_result
def resolve(name: str, device_type: str) -> str:
    """The concrete backend name for ``name`` (``"auto"`` picks by device type) after checking it exists.

    ``torch.compile`` evaluates this once while tracing (the name is then a constant of the
    graph): loading or building a kernel is never traced.
    """
    if not isinstance(name, str):
        raise ValueError(f"backend must be 'auto' or one of {available()}, got {name!r}")
    if name != "auto":
        get(name)
        return name
    preferred = {"cpu": "cpu", "cuda": "triton"}.get(device_type)
    if preferred is not None:
        backend = _builtin(preferred)
        if backend is not None and backend.is_available():
            return preferred
    return "torch"


def check_runs(requested: str, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Raise ValueError when an explicitly requested backend cannot run ``tensors`` itself.

    ``"auto"`` chooses a backend that runs them (or the eager one), so only an explicit name is
    checked: ``backend="triton"`` on CPU tensors, or ``backend="cpu"`` on CUDA ones, is refused
    rather than served by another kernel.

    Args:
        requested: the ``backend`` argument as given.
        name: the resolved name (:func:`resolve`).
        tensors: the tensors the kernel reads and writes (not the tables), by argument name.
    """
    if requested == "auto" or torch.compiler.is_compiling():  # a traced call was checked when run eagerly
        return
    backend = get(name)
    for arg, t in tensors.items():
        takes = backend.cannot_run(t)
        if takes is not None:
            raise ValueError(f"backend={requested!r} cannot run {arg} ({t.dtype} on {t.device}): it takes {takes}; "
                             f"backends available here: {available()}; backend='auto' picks one by device")
