"""The signature of a call of each prepared entry point, and the prepared call it finds.

One function per entry point builds the signature :mod:`ropekit.ops.prepared` describes as one
flat tuple, every attribute read written out: a decode step pays for the signature on every
call, and a loop over the tensors, a helper per tensor or a storage lookup per argument costs
more than the kernel call of a small step (a device is read only off the CPU: ``t.is_cpu or
t.device``, True for every CPU tensor; strides only off contiguous tensors: ``t.is_contiguous()
or t.stride()``, True for every contiguous one, whose shape then fixes every stride a check or a
kernel depends on: the stride of an axis of size 1 addresses no second element). Each returns
``(key, call)``:

- ``(None, None)``: no shortcut; the checks run and nothing is kept (an argument given twice, a
  gradient to record, tracing, a subclass or layout without strides, or a written tensor that
  shares memory with another argument, which the checks then refuse);
- ``(key, None)``: the checks run, then :func:`ropekit.ops.prepared.keep` keeps the call under ``key``;
- ``(key, call)``: a prepared call of this signature whose arguments share no memory it writes.

Memory: the byte ranges ``[data_ptr, data_ptr + extent)`` of each written tensor and each other
tensor argument are compared (the extents, fixed by the signature, were kept with the call);
only when two intersect is the exact test (:func:`ropekit.ops.prepared.apart`) run.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import Parameter

from .prepared import apart, calls

_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_WEIGHTS = frozenset((Tensor, Parameter, type(None)))  # what an optional weight may be
_COLD = (None, None)


def apply_rotary(x, cos, sin, layout, inplace, inverse, backend) -> tuple:
    """``(key, call)`` of ``apply_rotary``; the call takes ``(x, cos, sin)``."""
    if (_is_compiling() or type(x) is not Tensor or type(cos) is not Tensor or type(sin) is not Tensor
            or x is cos or x is sin or cos is sin
            or (_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad))):
        return _COLD
    try:
        key = ("apply_rotary", layout, type(layout), inplace, type(inplace), inverse, type(inverse), backend,
               type(backend),
               x.shape, x.is_contiguous() or x.stride(), x.dtype, x.is_cpu or x.device,
               cos.shape, cos.is_contiguous() or cos.stride(), cos.dtype, cos.is_cpu or cos.device,
               sin.shape, sin.is_contiguous() or sin.stride(), sin.dtype, sin.is_cpu or sin.device)
        entry = calls.get(key)
    except (RuntimeError, TypeError):  # stride() of a layout without strides; an unhashable option
        return _COLD
    if entry is None:
        return key, None
    call, ex, ec, es = entry
    if inplace is True:
        px, pc, ps = x.data_ptr(), cos.data_ptr(), sin.data_ptr()
        if not ((px + ex <= pc or pc + ec <= px) and (px + ex <= ps or ps + es <= px)) and not apart((x,), (cos, sin)):
            return _COLD
    return key, call


def apply_rotary_qk(q, k, cos, sin, layout, inplace, inverse, backend) -> tuple:
    """``(key, call)`` of ``apply_rotary_qk``; the call takes ``(q, k, cos, sin)``."""
    if (_is_compiling() or type(q) is not Tensor or type(k) is not Tensor or type(cos) is not Tensor
            or type(sin) is not Tensor or q is k or q is cos or q is sin or k is cos or k is sin or cos is sin
            or (_grad_enabled() and (q.requires_grad or k.requires_grad or cos.requires_grad or sin.requires_grad))):
        return _COLD
    try:
        key = ("apply_rotary_qk", layout, type(layout), inplace, type(inplace), inverse, type(inverse), backend,
               type(backend),
               q.shape, q.is_contiguous() or q.stride(), q.dtype, q.is_cpu or q.device,
               k.shape, k.is_contiguous() or k.stride(), k.dtype, k.is_cpu or k.device,
               cos.shape, cos.is_contiguous() or cos.stride(), cos.dtype, cos.is_cpu or cos.device,
               sin.shape, sin.is_contiguous() or sin.stride(), sin.dtype, sin.is_cpu or sin.device)
        entry = calls.get(key)
    except (RuntimeError, TypeError):
        return _COLD
    if entry is None:
        return key, None
    call, eq, ek, ec, es = entry
    if inplace is True:
        pq, pk, pc, ps = q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr()
        if not ((pq + eq <= pk or pk + ek <= pq) and (pq + eq <= pc or pc + ec <= pq)
                and (pq + eq <= ps or ps + es <= pq) and (pk + ek <= pc or pc + ec <= pk)
                and (pk + ek <= ps or ps + es <= pk)) and not apart((q, k), (cos, sin)):
            return _COLD
    return key, call


def rms_norm_rotary_qk(q, k, q_weight, k_weight, cos, sin, eps, norm, layout, weight_offset, inplace,
                       backend) -> tuple:
    """``(key, call)`` of ``rms_norm_rotary_qk``; the call takes ``(q, k, q_weight, k_weight, cos, sin)``.

    One weight for both (``q_weight is k_weight``) is part of the signature, not a reason to
    skip it: the weights are only read.
    """
    no_qw, no_kw = q_weight is None, k_weight is None
    if (_is_compiling() or type(q) is not Tensor or type(k) is not Tensor or type(cos) is not Tensor
            or type(sin) is not Tensor or type(q_weight) not in _WEIGHTS or type(k_weight) not in _WEIGHTS
            or q is k or q is cos or q is sin or k is cos or k is sin or cos is sin
            or q_weight is q or q_weight is k or q_weight is cos or q_weight is sin
            or k_weight is q or k_weight is k or k_weight is cos or k_weight is sin
            or (_grad_enabled() and (q.requires_grad or k.requires_grad or cos.requires_grad or sin.requires_grad
                                     or (not no_qw and q_weight.requires_grad)
                                     or (not no_kw and k_weight.requires_grad)))):
        return _COLD
    try:
        key = ("rms_norm_rotary_qk", eps, type(eps), norm, type(norm), layout, type(layout), weight_offset,
               type(weight_offset), inplace, type(inplace), backend, type(backend),
               q.shape, q.is_contiguous() or q.stride(), q.dtype, q.is_cpu or q.device,
               k.shape, k.is_contiguous() or k.stride(), k.dtype, k.is_cpu or k.device,
               cos.shape, cos.is_contiguous() or cos.stride(), cos.dtype, cos.is_cpu or cos.device,
               sin.shape, sin.is_contiguous() or sin.stride(), sin.dtype, sin.is_cpu or sin.device,
               type(q_weight), None if no_qw else q_weight.shape,
               None if no_qw else q_weight.is_contiguous() or q_weight.stride(),
               None if no_qw else q_weight.dtype, None if no_qw else q_weight.is_cpu or q_weight.device,
               type(k_weight), None if no_kw else k_weight.shape,
               None if no_kw else k_weight.is_contiguous() or k_weight.stride(),
               None if no_kw else k_weight.dtype, None if no_kw else k_weight.is_cpu or k_weight.device,
               q_weight is k_weight)
        entry = calls.get(key)
    except (RuntimeError, TypeError):
        return _COLD
    if entry is None:
        return key, None
    call, eq, ek, ec, es, eqw, ekw = entry
    if inplace is True:
        pq, pk, pc, ps = q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr()
        pqw = 0 if no_qw else q_weight.data_ptr()
        pkw = 0 if no_kw else k_weight.data_ptr()
        if not ((pq + eq <= pk or pk + ek <= pq) and (pq + eq <= pc or pc + ec <= pq)
                and (pq + eq <= ps or ps + es <= pq) and (pk + ek <= pc or pc + ec <= pk)
                and (pk + ek <= ps or ps + es <= pk) and (pq + eq <= pqw or pqw + eqw <= pq)
                and (pq + eq <= pkw or pkw + ekw <= pq) and (pk + ek <= pqw or pqw + eqw <= pk)
                and (pk + ek <= pkw or pkw + ekw <= pk)) and not apart((q, k), (cos, sin, q_weight, k_weight)):
            return _COLD
    return key, call


def rms_norm_rotary(x, weight, cos, sin, eps, norm, layout, weight_offset, inplace, backend) -> tuple:
    """``(key, call)`` of ``rms_norm_rotary``; the call takes ``(x, weight, cos, sin)``."""
    no_w = weight is None
    if (_is_compiling() or type(x) is not Tensor or type(cos) is not Tensor or type(sin) is not Tensor
            or type(weight) not in _WEIGHTS or x is cos or x is sin or cos is sin
            or weight is x or weight is cos or weight is sin
            or (_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad
                                     or (not no_w and weight.requires_grad)))):
        return _COLD
    try:
        key = ("rms_norm_rotary", eps, type(eps), norm, type(norm), layout, type(layout), weight_offset,
               type(weight_offset), inplace, type(inplace), backend, type(backend),
               x.shape, x.is_contiguous() or x.stride(), x.dtype, x.is_cpu or x.device,
               cos.shape, cos.is_contiguous() or cos.stride(), cos.dtype, cos.is_cpu or cos.device,
               sin.shape, sin.is_contiguous() or sin.stride(), sin.dtype, sin.is_cpu or sin.device,
               type(weight), None if no_w else weight.shape,
               None if no_w else weight.is_contiguous() or weight.stride(),
               None if no_w else weight.dtype, None if no_w else weight.is_cpu or weight.device)
        entry = calls.get(key)
    except (RuntimeError, TypeError):
        return _COLD
    if entry is None:
        return key, None
    call, ex, ec, es, ew = entry
    if inplace is True:
        px, pc, ps = x.data_ptr(), cos.data_ptr(), sin.data_ptr()
        pw = 0 if no_w else weight.data_ptr()
        if not ((px + ex <= pc or pc + ec <= px) and (px + ex <= ps or ps + es <= px)
                and (px + ex <= pw or pw + ew <= px)) and not apart((x,), (cos, sin, weight)):
            return _COLD
    return key, call


_SCALES = frozenset((Tensor, float, int, type(None)))  # what an FP8 scale of a prepared call may be


def rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slots, layout, k_weight, eps, norm, weight_offset,
                      block_size, backend, k_scale=None, v_scale=None) -> tuple:
    """``(key, call)`` of ``rotate_into_cache``; the call takes the backend's cache-write arguments.

    An int slot is keyed by its sign (a negative one is refused; the kernels check the rest on
    every call), a slots tensor like every other tensor. An FP8 scale is keyed by its type and, a
    number, by its value (one that passed the checks: finite and > 0 as a float32), a tensor like
    every other tensor: per tensor and per head, its dtype and device are the signature's; its
    values the call checks on every call, before writing (the C++ kernel itself, or one reduction).
    """
    slots_int, no_kw = type(slots) is int, k_weight is None
    ks_tensor, vs_tensor = type(k_scale) is Tensor, type(v_scale) is Tensor
    if (type(k_scale) not in _SCALES or type(v_scale) not in _SCALES
            or (_grad_enabled() and ((ks_tensor and k_scale.requires_grad) or (vs_tensor and v_scale.requires_grad)))):
        return _COLD
    if (_is_compiling() or type(k) is not Tensor or type(v) is not Tensor or type(cos) is not Tensor
            or type(sin) is not Tensor or type(k_cache) is not Tensor or type(v_cache) is not Tensor
            or not (slots_int or type(slots) is Tensor) or type(k_weight) not in _WEIGHTS
            or k_cache is v_cache or k is v or k is cos or k is sin or v is cos or v is sin or cos is sin
            or k_cache is k or k_cache is v or k_cache is cos or k_cache is sin
            or v_cache is k or v_cache is v or v_cache is cos or v_cache is sin
            or (not slots_int and (slots is k or slots is v or slots is cos or slots is sin or slots is k_cache
                                   or slots is v_cache or slots is k_weight))
            or (not no_kw and (k_weight is k or k_weight is v or k_weight is cos or k_weight is sin
                               or k_weight is k_cache or k_weight is v_cache))
            or (_grad_enabled() and (k.requires_grad or v.requires_grad or cos.requires_grad or sin.requires_grad
                                     or k_cache.requires_grad or v_cache.requires_grad
                                     or (not slots_int and slots.requires_grad)
                                     or (not no_kw and k_weight.requires_grad)))):
        return _COLD
    try:
        key = ("rotate_into_cache", layout, type(layout), eps, type(eps), norm, type(norm), weight_offset,
               type(weight_offset), block_size, type(block_size), backend, type(backend),
               k_cache.shape, k_cache.is_contiguous() or k_cache.stride(), k_cache.dtype,
               k_cache.is_cpu or k_cache.device,
               v_cache.shape, v_cache.is_contiguous() or v_cache.stride(), v_cache.dtype,
               v_cache.is_cpu or v_cache.device,
               k.shape, k.is_contiguous() or k.stride(), k.dtype, k.is_cpu or k.device,
               v.shape, v.is_contiguous() or v.stride(), v.dtype,
               v.is_cpu or v.device,
               cos.shape, cos.is_contiguous() or cos.stride(), cos.dtype, cos.is_cpu or cos.device,
               sin.shape, sin.is_contiguous() or sin.stride(), sin.dtype, sin.is_cpu or sin.device,
               slots_int, slots >= 0 if slots_int else slots.shape,
               None if slots_int else slots.is_contiguous() or slots.stride(),
               None if slots_int else slots.dtype, None if slots_int else slots.is_cpu or slots.device,
               type(k_weight), None if no_kw else k_weight.shape,
               None if no_kw else k_weight.is_contiguous() or k_weight.stride(),
               None if no_kw else k_weight.dtype, None if no_kw else k_weight.is_cpu or k_weight.device,
               type(k_scale), (k_scale.shape, k_scale.is_contiguous() or k_scale.stride(), k_scale.dtype,
                               k_scale.is_cpu or k_scale.device) if ks_tensor else k_scale,
               type(v_scale), (v_scale.shape, v_scale.is_contiguous() or v_scale.stride(), v_scale.dtype,
                               v_scale.is_cpu or v_scale.device) if vs_tensor else v_scale)
        entry = calls.get(key)
    except (RuntimeError, TypeError):
        return _COLD
    if entry is None:
        return key, None
    call, ekc, evc, ek, ev, ec, es, esl, ekw, eks, evs = entry
    pkc, pvc, pk, pv, pc, ps = (k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(),
                                sin.data_ptr())
    psl = 0 if slots_int else slots.data_ptr()
    pkw = 0 if no_kw else k_weight.data_ptr()
    if not ((pkc + ekc <= pvc or pvc + evc <= pkc)
            and (pkc + ekc <= pk or pk + ek <= pkc) and (pvc + evc <= pk or pk + ek <= pvc)
            and (pkc + ekc <= pv or pv + ev <= pkc) and (pvc + evc <= pv or pv + ev <= pvc)
            and (pkc + ekc <= pc or pc + ec <= pkc) and (pvc + evc <= pc or pc + ec <= pvc)
            and (pkc + ekc <= ps or ps + es <= pkc) and (pvc + evc <= ps or ps + es <= pvc)
            and (slots_int or ((pkc + ekc <= psl or psl + esl <= pkc) and (pvc + evc <= psl or psl + esl <= pvc)))
            and (no_kw or ((pkc + ekc <= pkw or pkw + ekw <= pkc) and (pvc + evc <= pkw or pkw + ekw <= pvc)))) \
            and not apart((k_cache, v_cache), (k, v, cos, sin, slots, k_weight)):
        return _COLD
    if ks_tensor or vs_tensor:  # a scale is read: it shares no memory with a cache
        pks = k_scale.data_ptr() if ks_tensor else 0
        pvs = v_scale.data_ptr() if vs_tensor else 0
        if not ((not ks_tensor or ((pkc + ekc <= pks or pks + eks <= pkc) and (pvc + evc <= pks or pks + eks <= pvc)))
                and (not vs_tensor or ((pkc + ekc <= pvs or pvs + evs <= pkc)
                                       and (pvc + evc <= pvs or pvs + evs <= pvc)))) \
                and not apart((k_cache, v_cache), (k_scale, v_scale)):
            return _COLD
    return key, call


def rotate_qk(q, k, cos_table, sin_table, offsets, tensor_format, seq_dim, layout, inplace, inverse,
              backend) -> tuple:
    """``(key, call)`` of ``rotate_qk`` by one int offset; the call takes ``(q, k, cos_table, sin_table, offsets)``.

    Only a call without ``positions``, ``cu_seqlens``, ``max_seqlen`` and ``head_size`` (the caller
    asks only then) and with an int ``offsets`` has a signature. The offset's value is checked on
    every call against the rows of the tables and the tokens of q kept with the call (both fixed
    by the signature): a value outside them has no signature, and the checks raise.
    """
    if (type(offsets) is not int or _is_compiling() or type(q) is not Tensor or type(k) is not Tensor
            or type(cos_table) is not Tensor or type(sin_table) is not Tensor or q is k or q is cos_table
            or q is sin_table or k is cos_table or k is sin_table or cos_table is sin_table
            or (_grad_enabled() and (q.requires_grad or k.requires_grad or cos_table.requires_grad
                                     or sin_table.requires_grad))):
        return _COLD
    try:
        key = ("rotate_qk", layout, type(layout), inplace, type(inplace), inverse, type(inverse), backend,
               type(backend), tensor_format, type(tensor_format), seq_dim, type(seq_dim),
               q.shape, q.is_contiguous() or q.stride(), q.dtype, q.is_cpu or q.device,
               k.shape, k.is_contiguous() or k.stride(), k.dtype, k.is_cpu or k.device,
               cos_table.shape, cos_table.is_contiguous() or cos_table.stride(), cos_table.dtype,
               cos_table.is_cpu or cos_table.device,
               sin_table.shape, sin_table.is_contiguous() or sin_table.stride(), sin_table.dtype,
               sin_table.is_cpu or sin_table.device)
        entry = calls.get(key)
    except (RuntimeError, TypeError):
        return _COLD
    if entry is None:
        return key, None
    call, eq, ek, ec, es, rows, tokens = entry
    if not 0 <= offsets <= rows - tokens:
        return _COLD
    if inplace is True:
        pq, pk, pc, ps = q.data_ptr(), k.data_ptr(), cos_table.data_ptr(), sin_table.data_ptr()
        if not ((pq + eq <= pk or pk + ek <= pq) and (pq + eq <= pc or pc + ec <= pq)
                and (pq + eq <= ps or ps + es <= pq) and (pk + ek <= pc or pc + ec <= pk)
                and (pk + ek <= ps or ps + es <= pk)) and not apart((q, k), (cos_table, sin_table)):
            return _COLD
    return key, call


_COLD_MODULE = (None, None, None, None)


def rotary_embedding(tables, version, q, k, offset, tensor_format, seq_dim, inplace, inverse) -> tuple:
    """``(key, call, cos_table, sin_table)`` of ``RotaryEmbedding.forward(q, k, offset=offset)`` (int offset).

    The module passes its cached ``tables`` (device -> (cos, sin)) and its ``version``: a number
    never reused, new whenever its tables change or an attribute its calls depend on is set
    (layout, backend, head_dim, max_cached_positions, scaling). The signature holds the version,
    q's and k's shapes, strides, dtypes and devices and the call's options. The call found is the
    prepared call of ``rotate_qk`` that the module's cold call reached (the tables' rows the module
    serves, q's tokens and the device are kept with it): ``call(q, k, cos_table, sin_table,
    offset)``. The offset is checked on every call against those rows; a value outside them
    (tables to grow, rows past ``max_cached_positions``, a negative offset) has no signature.
    """
    if (type(offset) is not int or _is_compiling() or type(q) is not Tensor or type(k) is not Tensor or q is k
            or (_grad_enabled() and (q.requires_grad or k.requires_grad))):
        return _COLD_MODULE
    try:
        key = ("RotaryEmbedding", version, inplace, type(inplace), inverse, type(inverse), tensor_format,
               type(tensor_format), seq_dim, type(seq_dim),
               q.shape, q.is_contiguous() or q.stride(), q.dtype, q.is_cpu or q.device,
               k.shape, k.is_contiguous() or k.stride(), k.dtype, k.is_cpu or k.device)
        entry = calls.get(key)
    except (RuntimeError, TypeError):
        return _COLD_MODULE
    if entry is None:
        return key, None, None, None
    call, eq, ek, ec, es, rows, tokens, device = entry
    cached = tables.get(device)
    if cached is None or not 0 <= offset <= rows - tokens:
        return _COLD_MODULE
    cos, sin = cached
    if inplace is True:
        pq, pk, pc, ps = q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr()
        if not ((pq + eq <= pk or pk + ek <= pq) and (pq + eq <= pc or pc + ec <= pq)
                and (pq + eq <= ps or ps + es <= pq) and (pk + ek <= pc or pc + ec <= pk)
                and (pk + ek <= ps or ps + es <= pk)) and not apart((q, k), (cos, sin)):
            return _COLD_MODULE
    return key, call, cos, sin



def rotate_into_mla_cache(kv_c, k_pe, cos, sin, kv_cache, pe_cache, slots, layout, output_layout, block_size,
                          backend) -> tuple:
    """``(key, call)`` of ``ropekit.mla.rotate_into_mla_cache``; the call takes its seven tensor arguments.

    An int slot is keyed by its sign, a slots tensor like every other tensor. The call checks the
    slots' values on every call (it returns False, writing nothing, for one outside the caches).
    """
    slots_int = type(slots) is int
    if (_is_compiling() or type(kv_c) is not Tensor or type(k_pe) is not Tensor or type(cos) is not Tensor
            or type(sin) is not Tensor or type(kv_cache) is not Tensor or type(pe_cache) is not Tensor
            or not (slots_int or type(slots) is Tensor)
            or kv_cache is pe_cache or kv_c is k_pe or kv_c is cos or kv_c is sin or k_pe is cos or k_pe is sin
            or cos is sin or kv_cache is kv_c or kv_cache is k_pe or kv_cache is cos or kv_cache is sin
            or pe_cache is kv_c or pe_cache is k_pe or pe_cache is cos or pe_cache is sin
            or (not slots_int and (slots is kv_c or slots is k_pe or slots is cos or slots is sin
                                   or slots is kv_cache or slots is pe_cache))
            or (_grad_enabled() and (kv_c.requires_grad or k_pe.requires_grad or cos.requires_grad
                                     or sin.requires_grad or kv_cache.requires_grad or pe_cache.requires_grad
                                     or (not slots_int and slots.requires_grad)))):
        return _COLD
    try:
        key = ("rotate_into_mla_cache", layout, type(layout), output_layout, type(output_layout), block_size,
               type(block_size), backend, type(backend),
               kv_cache.shape, kv_cache.is_contiguous() or kv_cache.stride(), kv_cache.dtype,
               kv_cache.is_cpu or kv_cache.device,
               pe_cache.shape, pe_cache.is_contiguous() or pe_cache.stride(), pe_cache.dtype,
               pe_cache.is_cpu or pe_cache.device,
               kv_c.shape, kv_c.is_contiguous() or kv_c.stride(), kv_c.dtype, kv_c.is_cpu or kv_c.device,
               k_pe.shape, k_pe.is_contiguous() or k_pe.stride(), k_pe.dtype, k_pe.is_cpu or k_pe.device,
               cos.shape, cos.is_contiguous() or cos.stride(), cos.dtype, cos.is_cpu or cos.device,
               sin.shape, sin.is_contiguous() or sin.stride(), sin.dtype, sin.is_cpu or sin.device,
               slots_int, slots >= 0 if slots_int else slots.shape,
               None if slots_int else slots.is_contiguous() or slots.stride(),
               None if slots_int else slots.dtype, None if slots_int else slots.is_cpu or slots.device)
        entry = calls.get(key)
    except (RuntimeError, TypeError):
        return _COLD
    if entry is None:
        return key, None
    call, ekv, epe, ec, ek, eco, esi, esl = entry
    pkv, ppe, pc, pk, pco, psi = (kv_cache.data_ptr(), pe_cache.data_ptr(), kv_c.data_ptr(), k_pe.data_ptr(),
                                  cos.data_ptr(), sin.data_ptr())
    psl = 0 if slots_int else slots.data_ptr()
    if not ((pkv + ekv <= ppe or ppe + epe <= pkv)
            and (pkv + ekv <= pc or pc + ec <= pkv) and (ppe + epe <= pc or pc + ec <= ppe)
            and (pkv + ekv <= pk or pk + ek <= pkv) and (ppe + epe <= pk or pk + ek <= ppe)
            and (pkv + ekv <= pco or pco + eco <= pkv) and (ppe + epe <= pco or pco + eco <= ppe)
            and (pkv + ekv <= psi or psi + esi <= pkv) and (ppe + epe <= psi or psi + esi <= ppe)
            and (slots_int or ((pkv + ekv <= psl or psl + esl <= pkv) and (ppe + epe <= psl or psl + esl <= ppe)))) \
            and not apart((kv_cache, pe_cache), (kv_c, k_pe, cos, sin, slots)):
        return _COLD
    return key, call
