"""The C++ backend ``"cpu"``: the operators of ``csrc/rotary_cpu.cpp`` (built by :mod:`.build`).

Same contract as every backend (:mod:`.backend`), one pass over memory: in place it reads and
writes each element once; out of place it writes into ``torch.empty_like(x)``. Rows of q and k
are split together over torch's own threads (``at::parallel_for``: the same pool, and the
same behaviour after ``fork``, as torch's own CPU ops). Arithmetic is float32 (float64 for
float64 ``x``) without FMA contraction, so results equal the eager backend's bit for bit.

Nothing happens at import: the first :meth:`CppBackend.is_available` (``backend="auto"`` on a
CPU tensor does it) loads the library, building it first if the cache has none. A failure is
reported once as a ``RuntimeWarning`` that says why, and remembered: the eager kernel then runs
wherever ``"auto"`` would have picked this one.
"""

from __future__ import annotations

import threading
import warnings

import torch

from . import build
from .backend import Backend
from .eager import EagerBackend

KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class CppBackend(Backend):
    """``backend="cpu"``: see the module docstring.

    Args:
        namespace: ``torch.ops`` namespace of the operators (one per build loaded in a process).
        extra_flags: compiler flags after the defaults (tests build ``-DROPEKIT_PORTABLE``).
    """

    name = "cpu"

    def __init__(self, namespace: str = build.DEFAULT_NAMESPACE, extra_flags: tuple[str, ...] = ()) -> None:
        self.namespace = namespace
        self.extra_flags = tuple(extra_flags)
        self.error: str | None = None
        self.build: build.Build | None = None
        self._ops = None
        self._lock = threading.Lock()
        self._fallback = EagerBackend()

    def is_available(self) -> bool:
        """Load (building if needed) the operators; False, with one warning, when that fails."""
        if self._ops is not None:
            return True
        with self._lock:
            if self._ops is None and self.error is None:
                try:
                    self.build = build.load(self.extra_flags, self.namespace)
                    ops = getattr(torch.ops, self.namespace)
                    # the overloads' own entry points: a call skips the packet's overload lookup and
                    # the Python frame of OpOverload.__call__ (a decode step is a few µs in all)
                    self._rotate, self._rotate_, self._pair, self._pair_ = (
                        getattr(overload, "_op", overload) for overload in
                        (ops.rotate.default, ops.rotate_.default, ops.rotate_pair.default, ops.rotate_pair_.default))
                    self._ops = ops
                except Exception as exc:  # noqa: BLE001 - any failure means "not available"
                    self.error = f"{type(exc).__name__}: {exc}"
                    warnings.warn(f"ropekit's C++ CPU kernel is unavailable, the eager torch kernel runs instead "
                                  f"({self.error})", RuntimeWarning, stacklevel=4)
        return self._ops is not None

    def operators(self):
        """``torch.ops.<namespace>``; raises RuntimeError when the kernel is unavailable."""
        if self._ops is None and not self.is_available():
            raise RuntimeError(f"ropekit's C++ CPU kernel is unavailable: {self.error}")
        return self._ops

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """Whether the kernel runs ``x`` (a strided CPU tensor of a kernel dtype); else the eager one does."""
        return x.dtype in KERNEL_DTYPES and x.is_cpu and x.layout is torch.strided

    def rotate(self, x, cos, sin, *, layout, conjugate, inplace):  # noqa: D102
        if self._ops is None:
            self.operators()
        if not (self.takes(x) and cos.layout is torch.strided and sin.layout is torch.strided):
            return self._fallback.rotate(x, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)
        if x.numel() == 0:  # any strides (an empty shard's gradient): nothing the kernel's layout checks need see
            return x if inplace else torch.empty_like(x)
        if inplace:
            self._rotate_(x, cos, sin, layout == "interleaved", conjugate)
            return x
        return self._rotate(x, cos, sin, layout == "interleaved", conjugate)

    def rotate_pair(self, q, k, cos, sin, *, layout, conjugate, inplace):  # noqa: D102
        if self._ops is None:
            self.operators()
        if not (self.takes(q) and self.takes(k) and cos.layout is torch.strided and sin.layout is torch.strided):
            return super().rotate_pair(q, k, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)
        if q.numel() == 0 or k.numel() == 0:
            return (self.rotate(q, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace),
                    self.rotate(k, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace))
        if inplace:
            self._pair_(q, k, cos, sin, layout == "interleaved", conjugate)
            return q, k
        return self._pair(q, k, cos, sin, layout == "interleaved", conjugate)

    def prepared(self, tensors, *, layout, inplace):
        """The operator itself, bound to the options, for tensors like ``tensors`` (see :class:`Backend`)."""
        if not (self.is_available() and all(self.takes(t) and t.numel() for t in tensors)):
            return super().prepared(tensors, layout=layout, inplace=inplace)
        interleaved = layout == "interleaved"
        if len(tensors) == 3:
            if inplace:
                rotate_ = self._rotate_

                def run(x, cos, sin):
                    rotate_(x, cos, sin, interleaved, False)
                    return x

                return run
            rotate = self._rotate
            return lambda x, cos, sin: rotate(x, cos, sin, interleaved, False)
        if inplace:
            pair_ = self._pair_

            def run_pair(q, k, cos, sin):
                pair_(q, k, cos, sin, interleaved, False)
                return q, k

            return run_pair
        pair = self._pair
        return lambda q, k, cos, sin: pair(q, k, cos, sin, interleaved, False)
