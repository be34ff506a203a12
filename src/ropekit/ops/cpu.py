"""The C++ backend ``"cpu"``: the kernels of ``csrc/rotary_cpu.cpp`` (built by :mod:`.build`).

The extension exposes each kernel twice, running the same C++ function: as a ``torch.ops``
operator (``torch.ops.ropekit_cpu.apply_rotary_qk``, ...) and as a plain Python function of the
extension module. This backend calls the plain functions: no dispatcher between Python and
the kernel. Autograd and ``torch.compile`` see the ``ropekit::*`` operators of
:mod:`.operators`, whose kernels are this backend's methods.

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
from .fp8 import is_fp8

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
        self.module = None
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
                    # the kernels as the extension's plain Python functions: the same C++ entry points
                    # as the torch.ops operators, without the dispatcher between (a decode step is a
                    # few µs, most of it the call); autograd and torch.compile go through the
                    # ropekit::* operators of ops/operators.py, whose kernels are these methods
                    self.module = build.import_library(self.build)
                    self._one, self._one_, self._qk, self._qk_ = (self.module.apply_rotary, self.module.apply_rotary_,
                                                                  self.module.apply_rotary_qk,
                                                                  self.module.apply_rotary_qk_)
                    self._ops = getattr(torch.ops, self.namespace)
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

    def cannot_run(self, x: torch.Tensor) -> str | None:
        """See :class:`ropekit.ops.Backend`: strided CPU tensors of a kernel dtype (FP8: the caches it writes)."""
        if self.takes(x) or (is_fp8(x.dtype) and x.is_cpu and x.layout is torch.strided):
            return None
        return "strided CPU tensors of dtype float32, float64, bfloat16 or float16 (FP8 caches too)"

    def apply_rotary(self, x, cos, sin, *, layout, conjugate, inplace):
        """See :class:`ropekit.ops.Backend`."""
        if self._ops is None:
            self.operators()
        if not (self.takes(x) and cos.layout is torch.strided and sin.layout is torch.strided):
            return self._fallback.apply_rotary(x, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)
        if x.numel() == 0:  # any strides (an empty shard's gradient): nothing the kernel's layout checks need see
            return x if inplace else torch.empty_like(x)
        if inplace:
            self._one_(x, cos, sin, layout == "interleaved", conjugate)
            return x
        return self._one(x, cos, sin, layout == "interleaved", conjugate)

    def apply_rotary_qk(self, q, k, cos, sin, *, layout, conjugate, inplace):
        """See :class:`ropekit.ops.Backend`."""
        if self._ops is None:
            self.operators()
        if not (self.takes(q) and self.takes(k) and cos.layout is torch.strided and sin.layout is torch.strided):
            return super().apply_rotary_qk(q, k, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)
        if q.numel() == 0 or k.numel() == 0:
            return (self.apply_rotary(q, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace),
                    self.apply_rotary(k, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace))
        if inplace:
            self._qk_(q, k, cos, sin, layout == "interleaved", conjugate)
            return q, k
        return self._qk(q, k, cos, sin, layout == "interleaved", conjugate)

    def _by_offset(self, where, *tensors) -> bool:
        """Whether ``where`` is one int offset for every token and the kernel takes the (non-empty) tensors.

        Such a call rotates by a view of the tables' rows (``rotate_offset``, ``rotate_qk_offset``):
        no gather of rows in Python, no Python between the call and the kernel.
        """
        if self._ops is None:
            self.operators()
        return (where.positions is None and where.offsets is None and where.cu_seqlens is None
                and all(self.takes(t) and t.numel() for t in tensors))

    def rotate(self, x, cos_table, sin_table, where, *, layout, conjugate, inplace):
        """See :class:`ropekit.ops.Backend`: one int offset runs natively, other positions gather the rows first."""
        if not self._by_offset(where, x, cos_table, sin_table):
            return super().rotate(x, cos_table, sin_table, where, layout=layout, conjugate=conjugate, inplace=inplace)
        args = (cos_table, sin_table, where.offset, where.seq_dim % x.dim(), layout == "interleaved", conjugate)
        if inplace:
            self.module.rotate_offset_(x, *args)
            return x
        return self.module.rotate_offset(x, *args)

    def rotate_qk(self, q, k, cos_table, sin_table, where, *, layout, conjugate, inplace):
        """See :class:`ropekit.ops.Backend`: one int offset runs natively, other positions gather the rows first."""
        if not self._by_offset(where, q, k, cos_table, sin_table):
            return super().rotate_qk(q, k, cos_table, sin_table, where, layout=layout, conjugate=conjugate,
                                     inplace=inplace)
        args = (cos_table, sin_table, where.offset, where.seq_dim % q.dim(), layout == "interleaved", conjugate)
        if inplace:
            self.module.rotate_qk_offset_(q, k, *args)
            return q, k
        return self.module.rotate_qk_offset(q, k, *args)

    def _takes_all(self, *tensors) -> bool:
        """Every tensor given (None skipped) is one the kernel takes (the first ones: those it writes)."""
        if self._ops is None:
            self.operators()
        return all(t is None or (t.is_cpu and t.layout is torch.strided) for t in tensors) and tensors[0].dtype in \
            KERNEL_DTYPES

    def rms_norm_rotary(self, x, weight, cos, sin, *, eps, weight_offset, per_token, layout, inplace):
        """See :class:`ropekit.ops.Backend`."""
        if not self._takes_all(x, weight, cos, sin):
            return super().rms_norm_rotary(x, weight, cos, sin, eps=eps, weight_offset=weight_offset,
                                           per_token=per_token, layout=layout, inplace=inplace)
        args = (cos, sin, eps, weight_offset, per_token, layout == "interleaved")
        if inplace:
            self.module.rms_norm_rotary_(x, weight, *args)
            return x
        return self.module.rms_norm_rotary(x, weight, *args)

    def rms_norm_rotary_qk(self, q, k, q_weight, k_weight, cos, sin, *, eps, weight_offset, per_token, layout,
                           inplace):
        """See :class:`ropekit.ops.Backend`."""
        if not (self._takes_all(q, q_weight, cos, sin) and self._takes_all(k, k_weight)):
            return super().rms_norm_rotary_qk(q, k, q_weight, k_weight, cos, sin, eps=eps,
                                              weight_offset=weight_offset, per_token=per_token, layout=layout,
                                              inplace=inplace)
        args = (cos, sin, eps, weight_offset, per_token, layout == "interleaved")
        if inplace:
            self.module.rms_norm_rotary_qk_(q, k, q_weight, k_weight, *args)
            return q, k
        return self.module.rms_norm_rotary_qk(q, k, q_weight, k_weight, *args)

    def rms_norm_rotary_backward(self, grad, x, weight, cos, sin, *, eps, weight_offset, per_token,
                                 layout):
        """See :class:`ropekit.ops.Backend`."""
        if not self._takes_all(x, grad, weight, cos, sin):
            return super().rms_norm_rotary_backward(grad, x, weight, cos, sin, eps=eps, weight_offset=weight_offset,
                                                    per_token=per_token, layout=layout)
        grad_x, grad_w = self.module.rms_norm_rotary_backward(grad, x, weight, cos, sin, eps, weight_offset,
                                                              per_token, layout == "interleaved")
        return grad_x, (None if weight is None else grad_w)

    def rotate_into_cache(self, k, v, cos, sin, k_cache, v_cache, slots, start, *, k_weight, eps, weight_offset,
                          per_token, block_size, layout, k_scale=None, v_scale=None):
        """See :class:`ropekit.ops.Backend`; FP8 caches (with their scales) go to ``rotate_into_cache_scaled``."""
        if k_scale is not None or v_scale is not None:
            takes = self._takes_all(k, cos, sin, slots, k_weight, k_scale, k_cache) and self._takes_all(v, v_scale,
                                                                                                         v_cache)
            if not takes or torch.float64 in (k.dtype, v.dtype):  # the kernel stores from float32: float64 stays eager
                return super().rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slots, start, k_weight=k_weight,
                                                 eps=eps, weight_offset=weight_offset, per_token=per_token,
                                                 block_size=block_size, layout=layout, k_scale=k_scale,
                                                 v_scale=v_scale)
            self.module.rotate_into_cache_scaled(k, v, cos, sin, k_cache, v_cache, slots, start, k_weight, eps,
                                                 weight_offset, per_token, block_size, layout == "interleaved",
                                                 k_scale, v_scale)
            return None
        if not (self._takes_all(k_cache, k, cos, sin, slots, k_weight) and self._takes_all(v_cache, v)):
            return super().rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slots, start, k_weight=k_weight,
                                             eps=eps, weight_offset=weight_offset, per_token=per_token,
                                             block_size=block_size, layout=layout)
        self.module.rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slots, start, k_weight, eps, weight_offset,
                                      per_token, block_size, layout == "interleaved")
        return None

    def prepared_cache_write(self, *, k_weight_given, eps, weight_offset, per_token, block_size, layout, like=()):
        """The extension's function itself, bound to the options (see :class:`Backend`), for tensors it takes."""
        k, v, cos, sin, k_cache, v_cache, slots, k_weight = like
        if not (self.is_available() and self._takes_all(k_cache, k, cos, sin, slots, k_weight)
                and self._takes_all(v_cache, v)):
            return super().prepared_cache_write(k_weight_given=k_weight_given, eps=eps, weight_offset=weight_offset,
                                                per_token=per_token, block_size=block_size, layout=layout, like=like)
        write, interleaved = self.module.rotate_into_cache, layout == "interleaved"

        def run(k, v, cos, sin, k_cache, v_cache, slots, start, k_weight):
            write(k, v, cos, sin, k_cache, v_cache, slots, start, k_weight, eps, weight_offset, per_token, block_size,
                  interleaved)

        return run

    def prepared_scaled_cache_write(self, *, k_weight_given, eps, weight_offset, per_token, block_size, layout,
                                    like=()):
        """``rotate_into_cache_scaled`` itself, bound to the options, for tensors it takes (it checks the scales)."""
        k, v, cos, sin, k_cache, v_cache, slots, k_weight, k_scale, v_scale = like
        if not (self.is_available() and self._takes_all(k, cos, sin, slots, k_weight, k_scale, k_cache)
                and self._takes_all(v, v_scale, v_cache)) or torch.float64 in (k.dtype, v.dtype):
            return super().prepared_scaled_cache_write(k_weight_given=k_weight_given, eps=eps,
                                                       weight_offset=weight_offset, per_token=per_token,
                                                       block_size=block_size, layout=layout, like=like)
        write, interleaved = self.module.rotate_into_cache_scaled, layout == "interleaved"

        def run(k, v, cos, sin, k_cache, v_cache, slots, start, k_weight, k_scale, v_scale):
            write(k, v, cos, sin, k_cache, v_cache, slots, start, k_weight, eps, weight_offset, per_token, block_size,
                  interleaved, k_scale, v_scale)

        return run

    def prepared_by_offset(self, tensors, *, seq_dim, layout, inplace, conjugate=False):
        """The extension's offset function itself, bound to the options (see :class:`Backend`), for tensors it takes."""
        if not (self.is_available() and all(self.takes(t) and t.numel() for t in tensors)):
            return super().prepared_by_offset(tensors, seq_dim=seq_dim, layout=layout, inplace=inplace,
                                              conjugate=conjugate)
        interleaved, axis = layout == "interleaved", seq_dim % tensors[0].dim()
        if len(tensors) == 3:
            if inplace:
                one_ = self.module.rotate_offset_

                def run(x, cos_table, sin_table, offset):
                    one_(x, cos_table, sin_table, offset, axis, interleaved, conjugate)
                    return x

                return run
            one = self.module.rotate_offset
            return lambda x, cos_table, sin_table, offset: one(x, cos_table, sin_table, offset, axis, interleaved,
                                                               conjugate)
        if inplace:
            qk_ = self.module.rotate_qk_offset_

            def run_qk(q, k, cos_table, sin_table, offset):
                qk_(q, k, cos_table, sin_table, offset, axis, interleaved, conjugate)
                return q, k

            return run_qk
        qk = self.module.rotate_qk_offset
        return lambda q, k, cos_table, sin_table, offset: qk(q, k, cos_table, sin_table, offset, axis, interleaved,
                                                             conjugate)

    def prepared(self, tensors, *, layout, inplace, conjugate=False):
        """The operator itself, bound to the options, for tensors like ``tensors`` (see :class:`Backend`)."""
        if not (self.is_available() and all(self.takes(t) and t.numel() for t in tensors)):
            return super().prepared(tensors, layout=layout, inplace=inplace, conjugate=conjugate)
        interleaved = layout == "interleaved"
        if len(tensors) == 3:
            if inplace:
                one_ = self._one_

                def run(x, cos, sin):
                    one_(x, cos, sin, interleaved, conjugate)
                    return x

                return run
            one = self._one
            return lambda x, cos, sin: one(x, cos, sin, interleaved, conjugate)
        if inplace:
            qk_ = self._qk_

            def run_qk(q, k, cos, sin):
                qk_(q, k, cos, sin, interleaved, conjugate)
                return q, k

            return run_qk
        qk = self._qk
        return lambda q, k, cos, sin: qk(q, k, cos, sin, interleaved, conjugate)
