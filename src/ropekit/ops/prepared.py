"""Prepared calls: the one shortcut for repeated calls of the public entry points.

A decode loop calls one entry point with arguments of one signature on every step. The first
call runs every check and keeps the kernel call it leads to under its signature; a later call of
the same signature runs that kernel call directly. A warm call is a cold call: the signature
holds everything the checks read, so a call found here would pass every check of a cold one.

:func:`signature` is, for one entry point (``form``):

- each tensor argument's type, shape, strides, dtype and device (``None`` for an absent
  optional tensor): every size and dtype check, the tables' batch sizes and the internal-overlap
  check of an in-place tensor depend on nothing else;
- which arguments are the same object;
- each option's type and value (``inplace=1`` is not ``inplace=True``), the backend's name
  included;
- no signature at all (the checks run) when a tensor would record a gradient, under
  ``torch.compile``, for tensor subclasses and non-strided layouts, or when a tensor the call
  writes shares memory with another argument (:func:`ropekit.ops.memory.overlapping`; this
  is computed on every call, since a new tensor may be a view of an old one).

What no signature holds, the values inside tensors (positions, cache slots), the kernels check
on every call. :func:`clear` forgets every prepared call (a process that never called anything);
:func:`ropekit.ops.register` clears them, since a name may now mean another backend.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn import Parameter

from .dispatch import on_register
from .memory import overlapping

_is_compiling = torch.compiler.is_compiling
PREPARED_MAX = 256  # signatures kept at most (a loop uses a few; a varying workload starts over)
_calls: dict[tuple, Callable] = {}


def clear() -> None:
    """Forget every prepared call: the next call of each signature is checked as in a fresh process."""
    _calls.clear()


on_register(clear)


_NOT_TENSOR = object()


def _tensor_key(t) -> tuple | None:
    """What the checks read of one tensor argument (``_NOT_TENSOR`` for subclasses and other objects)."""
    if t is None:
        return None
    kind = type(t)
    if kind is not Tensor and kind is not Parameter:
        return _NOT_TENSOR
    return kind, t.shape, t.stride(), t.dtype, t.device


def _shares_memory(tensors: tuple, written: int) -> bool:
    """Whether one of the first ``written`` tensors shares memory with a later argument (storages first: cheap)."""
    storages = [None if t is None else t.untyped_storage().data_ptr() for t in tensors]
    for i in range(written):
        for j in range(i + 1, len(tensors)):
            if storages[j] == storages[i] and overlapping(tensors[i], tensors[j]):
                return True
    return False


def signature(form: str, tensors: tuple, options: tuple, *, written: int = 0) -> tuple | None:
    """The key of a call of ``form`` (see the module docstring), or None: no shortcut, run the checks.

    Args:
        form: the entry point's name.
        tensors: its tensor arguments in a fixed order, the ones it writes first; None for an
            absent optional one.
        options: every other argument (ints, floats, strings, bools, None), each keyed by type and value.
        written: how many of the first ``tensors`` the call writes (0 out of place).
    """
    if _is_compiling():
        return None
    try:
        key = (form, options, *map(type, options), *map(_tensor_key, tensors))
    except (RuntimeError, AttributeError):  # stride(): sparse layouts; non-tensors
        return None
    if _NOT_TENSOR in key:
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return None
    if len(set(map(id, tensors))) != len(tensors):  # an argument given twice: which ones is part of the signature
        ids = list(map(id, tensors))
        key += tuple(map(ids.index, ids))
    if written and _shares_memory(tensors, written):
        return None
    return key


def lookup(key: tuple | None) -> Callable | None:
    """The call kept for ``key``, or None (also for an unhashable option: the checks name it)."""
    if key is None:
        return None
    try:
        return _calls.get(key)
    except TypeError:
        return None


def keep(key: tuple | None, call: Callable) -> None:
    """Keep ``call`` for ``key``, a signature whose call has just passed every check."""
    if key is None:
        return
    try:
        hash(key)
    except TypeError:
        return
    if len(_calls) >= PREPARED_MAX:
        _calls.clear()
    _calls[key] = call
