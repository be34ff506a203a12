"""Prepared calls: the one shortcut for repeated calls of the public entry points.

A decode loop calls one entry point with arguments of one signature on every step. The first
call runs every check and keeps the kernel call it leads to under its signature; a later call of
the same signature runs that kernel call directly. A warm call is a cold call: the signature
holds everything the checks read, so a call found here would pass every check of a cold one.

A signature (built per entry point by :mod:`ropekit.ops.prepared_keys`, one flat tuple) holds:

- each tensor argument's shape, strides (True for a contiguous tensor: its shape fixes every
  stride that addresses a second element), dtype and device (True for the CPU), and its type where
  a ``nn.Parameter`` is accepted (``None`` for an absent optional tensor): every size and dtype
  check, the tables' batch sizes and the internal-overlap check of an in-place tensor depend on
  nothing else;
- each option's type and value (``inplace=1`` is not ``inplace=True``), the backend's name
  included;
- no signature at all (the checks run) when an argument is given twice (``q is k``, ``cos is
  sin``), when a tensor would record a gradient, under ``torch.compile``, for tensor subclasses
  and non-strided layouts, or when a tensor the call writes shares memory with another argument.
  The last is decided on every call, since a new tensor may be a view of an old one: the byte
  ranges ``[data_ptr, data_ptr + extent)`` of the arguments (their extents kept with the call,
  the signature fixing them) are compared, and only ranges that intersect are tested exactly
  (:func:`apart`, :func:`ropekit.ops.memory.overlapping`).

What no signature holds, the values inside tensors (positions, cache slots, FP8 scales), the
prepared calls check on every call, before writing anything. :func:`clear` forgets every
prepared call (a process that never called anything); :func:`ropekit.ops.register` clears them,
since a name may now mean another backend.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from .dispatch import on_register
from .memory import overlapping

PREPARED_MAX = 256  # signatures kept at most (a loop uses a few; a varying workload starts over)
calls: dict[tuple, tuple] = {}  # signature -> (call, byte extent of each of the signature's tensors)


def clear() -> None:
    """Forget every prepared call: the next call of each signature is checked as in a fresh process."""
    calls.clear()


on_register(clear)


def extent(t: Tensor | None) -> int:
    """Bytes from ``t.data_ptr()`` to the end of its last element (0: None, non-tensors, no elements)."""
    if not isinstance(t, Tensor) or t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()


def keep(key: tuple | None, call: Callable, tensors: tuple, *limits) -> None:
    """Keep ``call`` for ``key``, a signature whose call has just passed every check.

    ``tensors`` are the signature's tensors in the order its entry point unpacks their extents;
    ``limits`` are what its entry point checks the call's values against on every call (the
    by-offset forms: the rows of the tables, the tokens of q).
    """
    if key is None:
        return
    if len(calls) >= PREPARED_MAX:
        calls.clear()
    calls[key] = (call, *map(extent, tensors), *limits)


def apart(written: tuple, others: tuple) -> bool:
    """Whether no tensor of ``written`` shares memory with a later one of ``written`` or one of ``others`` (exact).

    Called only when byte ranges intersect (views of one buffer); None and non-tensors are skipped.
    """
    for i, t in enumerate(written):
        for u in (*written[i + 1:], *others):
            if isinstance(u, Tensor) and overlapping(t, u):
                return False
    return True
