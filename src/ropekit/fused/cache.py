"""Rotation into a KV cache: unrotated keys (and values) in, rotated keys in their cache slots out.

Decoding usually rotates the new key into a fresh tensor and then copies it into the cache: the
key is read twice and written twice. :func:`rotate_into_cache` rotates it straight into its slot
and copies the value in the same pass (flash-attention's ``flash_attn_with_kvcache`` and vLLM /
FlashInfer's fused writes do the same on GPUs). Two cache layouts:

- **contiguous** (one buffer per sequence, Hugging Face's ``StaticCache`` and
  :class:`ropekit.nn.KVCache` with ``max_length``): ``k_cache``, ``v_cache`` of shape
  ``(batch, kv_heads, max_length, head_dim)``; the new tokens of row ``b`` go to
  ``[slots[b], slots[b] + seq)``;
- **paged** (vLLM's blocks): ``k_cache``, ``v_cache`` of shape ``(num_blocks, block_size,
  kv_heads, head_dim)``; token ``t`` goes to slot ``slots[t]`` (block ``slots[t] // block_size``,
  row ``slots[t] % block_size``), :func:`slot_mapping` computes them from a block table.

Either cache may be FP8 (``float8_e4m3fn`` or ``float8_e5m2``) with a scale, vLLM's
``k_scale``/``v_scale`` (:mod:`.cache_scales`); :func:`dequantize_cache` reads one back.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops import operators_fused, prepared, prepared_keys
from ..ops.dispatch import check_runs, resolve
from ..ops.dispatch import get as get_backend
from ..ops.fp8 import is_fp8
from ..ops.memory import check_not_shared
from ..validation import (
    check_finite_float,
    check_float_tensor,
    check_layout,
    check_norm,
    check_norm_weight,
    check_positive_float,
    check_tables,
)
from .cache_scales import check_scale, scaled_call

_INT64_END = 2**63  # slots are int64: every slot is below this


def _check_slots(slots, k: Tensor, paged: bool, k_cache: Tensor | None = None) -> tuple[Tensor | None, int]:
    """``(slots tensor or None, start)`` from an int or an integer tensor of the layout's shape.

    With ``k_cache`` (the layout already checked by :func:`_check_caches`), every slot is also
    range-checked against it, so that no backend is handed a slot outside the cache: contiguous
    starts in ``[0, max_length - seq]``, paged slots below ``num_blocks * block_size`` (negative:
    padding). A CUDA slots tensor is read back for this.
    """
    if isinstance(slots, bool) or not isinstance(slots, (int, Tensor)):
        raise TypeError(f"slots must be an int or an integer tensor, got {type(slots).__name__}")
    if isinstance(slots, int):
        if paged:
            raise ValueError("slots must be a (tokens,) integer tensor (a slot mapping) for the paged layout, "
                             f"got the int {slots}")
        if slots < 0:
            raise ValueError(f"slots must be >= 0, got {slots}")
        if k_cache is not None:
            _check_slot_range(slots, slots, k, k_cache, paged)
        return None, slots
    if slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slots must be an int32 or int64 tensor, got {slots.dtype}")
    shapes = [(k.shape[0],)] if paged else [(), (1,), (k.shape[0],)]
    if tuple(slots.shape) not in shapes:
        what = "(tokens,) for the paged layout" if paged else "(), (1,) or (batch,) for the contiguous layout"
        raise ValueError(f"slots must have shape {what} = {shapes[-1]}, got {tuple(slots.shape)}")
    if slots.device != k.device:
        raise ValueError(f"slots is on {slots.device} but k is on {k.device}")
    if k_cache is not None and slots.numel():
        low, high = torch.aminmax(slots.reshape(-1))
        _check_slot_range(int(low), int(high), k, k_cache, paged)
    return slots, 0


def _check_slot_range(low: int, high: int, k: Tensor, k_cache: Tensor, paged: bool) -> None:
    """Raise ValueError unless the slots ``[low, high]`` fit the cache (see :func:`_check_slots`)."""
    if paged:
        capacity = k_cache.shape[0] * k_cache.shape[1]
        if high >= capacity:
            raise ValueError(f"slots must be below num_blocks * block_size = {capacity} (negative: padding), got a "
                             f"slot {high}")
        return
    seq, length = k.shape[2], k_cache.shape[2]
    if low < 0 or high > length - seq:
        bad = low if low < 0 else high
        raise ValueError(f"slots must be starts in [0, max_length - seq] = [0, {length - seq}] (k_cache holds "
                         f"{length} positions, k {seq} new tokens), got {bad}")


def _check_caches(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, block_size: int | None) -> int:
    """The layout's checks; returns ``block_size`` as the kernels take it (0: contiguous)."""
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_float_tensor(t, name)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    for name, x, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if is_fp8(cache.dtype):
            if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"an FP8 {name}_cache takes {name} of dtype float32, bfloat16 or float16 (computed in "
                                 f"float32, rounded once to FP8), got {name} {x.dtype}")
        elif x.dtype != cache.dtype:
            raise ValueError(f"the caches must have the dtypes of k and v (or be FP8: float8_e4m3fn, float8_e5m2): "
                             f"k {k.dtype} into k_cache {k_cache.dtype}, v {v.dtype} into v_cache {v_cache.dtype}")
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device} but k is on {k.device}")
    if block_size is None:
        if k.dim() != 4 or k_cache.dim() != 4 or (k.shape[0], k.shape[1], k.shape[3]) != (
                k_cache.shape[0], k_cache.shape[1], k_cache.shape[3]):
            raise ValueError("the contiguous layout needs k (batch, kv_heads, seq, head_dim) and caches (batch, "
                             f"kv_heads, max_length, head_dim) of the same batch, kv_heads and head_dim; got k "
                             f"{tuple(k.shape)} and k_cache {tuple(k_cache.shape)}")
        return 0
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int (paged layout) or None (contiguous), got {block_size!r}")
    if k.dim() != 3 or k_cache.dim() != 4 or tuple(k_cache.shape[1:]) != (block_size, *k.shape[1:]):
        raise ValueError(f"the paged layout needs k (tokens, kv_heads, head_dim) and caches (num_blocks, "
                         f"block_size={block_size}, kv_heads, head_dim); got k {tuple(k.shape)} and k_cache "
                         f"{tuple(k_cache.shape)}")
    return block_size


def rotate_into_cache(
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: int | Tensor,
    *,
    layout: str = "half",
    k_weight: Tensor | None = None,
    eps: float | None = None,
    norm: str = "per_head",
    weight_offset: float = 0.0,
    block_size: int | None = None,
    backend: str = "auto",
    k_scale: float | Tensor | None = None,
    v_scale: float | Tensor | None = None,
) -> None:
    """Write the rotated keys and the values of new tokens into their cache slots, in one pass.

    Args:
        k, v: unrotated keys and values of the new tokens: ``(batch, kv_heads, seq, head_dim)``
            (contiguous layout) or ``(tokens, kv_heads, head_dim)`` (paged); any strides.
        cos, sin: the new tokens' half-width tables, broadcast against k as for
            :func:`ropekit.apply_rotary` (e.g. ``(batch, 1, seq, rotary_dim // 2)``, or
            ``(tokens, 1, rotary_dim // 2)`` paged).
        k_cache, v_cache: the caches, written in place (dtypes of k and v, or FP8:
            ``float8_e4m3fn`` / ``float8_e5m2``, each cache on its own, e.g. FP8 keys beside
            bfloat16 values): ``(batch, kv_heads, max_length, head_dim)``, or paged
            ``(num_blocks, block_size, kv_heads, head_dim)``.
        slots: contiguous: the position in the cache of each row's first new token, an int (every
            row) or an integer ``()``/``(batch,)`` tensor; paged: the slot of each token, an
            integer ``(tokens,)`` tensor (negative: padding, not written).
        layout: ``"half"`` or ``"interleaved"``.
        k_weight, eps, norm, weight_offset: normalise the keys first, as
            :func:`ropekit.rms_norm_rotary` does (``eps`` given: normalise; ``k_weight`` None
            then means gains of 1). ``norm="per_token"`` spans the kv_heads axis.
        block_size: None for the contiguous layout, the caches' block size for the paged one.
        backend: ``"auto"`` or a name from :func:`ropekit.ops.available`.
        k_scale, v_scale: the scales of FP8 caches (vLLM's ``k_scale``/``v_scale``): a float, a
            ``()``/``(1,)`` tensor (per tensor) or a ``(kv_heads,)`` tensor (per head), on the
            caches' device, converted to float32; None means 1.0. Only for an FP8 cache.

    FP8 caches hold vLLM's ``fp8(clamp(x / scale, -max, max))`` (``reshape_and_cache_flash``,
    whose conversion ``scaled_vec_conversion`` in ``csrc/quantization/fp8/nvidia/quant_utils.cuh``
    divides by the scale and saturates to the largest finite value: 448 for e4m3fn, 57344 for
    e5m2; NaN stays NaN), where ``x`` is the rotated (normalised) key in float32, or the value
    converted exactly to float32: one rounding, from float32 straight to FP8, never through k's
    dtype (vLLM's own path rotates into k's dtype first, then quantises: two roundings).
    :func:`dequantize_cache` reads such a cache back (``float(q) * scale``).

    Raises:
        ValueError: shapes or dtypes that do not fit, slots outside the cache, or an FP8 scale
            given for a cache that is not FP8, of the wrong shape or device, or not finite and > 0
            (all checked before anything is written; on CUDA this reads the slots and the scale
            tensors back).
        TypeError: a scale that is not a number or a floating tensor.

    No autograd (a cache write): k and v must not require grad while grad is enabled.
    """
    scaled = k_scale is not None or v_scale is not None or is_fp8(getattr(k_cache, "dtype", None)) or is_fp8(
        getattr(v_cache, "dtype", None))
    key, run = prepared_keys.rotate_into_cache(
        k, v, cos, sin, k_cache, v_cache, slots, layout, k_weight, eps, norm, weight_offset, block_size, backend,
        k_scale, v_scale)  # the layout as given
    if run is not None:
        slots_int = type(slots) is int
        try:  # the kernels check the slots' values (inside the caches), and the scales', on every call, before writing
            if scaled:
                run(k, v, cos, sin, k_cache, v_cache, None if slots_int else slots, slots if slots_int else 0,
                    k_weight, k_scale, v_scale)
            else:
                run(k, v, cos, sin, k_cache, v_cache, None if slots_int else slots, slots if slots_int else 0,
                    k_weight)
            return
        except (RuntimeError, ValueError, TypeError):
            pass  # the checks below raise what a first call raises (or this call raises the kernel's error again)
    layout = check_layout(layout)
    paged_block = _check_caches(k, v, k_cache, v_cache, block_size)
    slot_tensor, start = _check_slots(slots, k, paged_block > 0, k_cache)
    per_token = check_norm(norm)
    weight_offset = check_finite_float(weight_offset, "weight_offset")
    if eps is not None:
        eps = check_positive_float(eps, "eps")
        heads_last = k if paged_block else k.transpose(1, 2)  # the norm's (kv_heads, head_dim) axes last
        check_norm_weight(k_weight, heads_last, per_token, "k_weight", "k")
    elif k_weight is not None or weight_offset != 0.0 or per_token:
        raise ValueError("k_weight, weight_offset and norm='per_token' describe the keys' norm: pass eps to "
                         "normalise the keys, or leave them at their defaults")
    if k_weight is None and weight_offset != 0.0:
        raise ValueError(f"k_weight is None but weight_offset={weight_offset!r} is not 0")
    check_tables(k, cos, sin)
    heads = k.shape[-2] if paged_block else k.shape[1]
    k_scales = check_scale(k_scale, "k_scale", k_cache, "k_cache", heads)
    v_scales = check_scale(v_scale, "v_scale", v_cache, "v_cache", heads)
    check_not_shared({"k_cache": k_cache, "v_cache": v_cache},
                     {"k": k, "v": v, "cos": cos, "sin": sin, "slots": slots, "k_weight": k_weight,
                      "k_scale": k_scale if isinstance(k_scale, Tensor) else None,
                      "v_scale": v_scale if isinstance(v_scale, Tensor) else None},
                     "rotate_into_cache")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (k, v, cos, sin)):
        raise ValueError("rotate_into_cache writes a cache and has no autograd: call it under torch.no_grad() (or "
                         "pass detached tensors)")
    name = resolve(backend, k.device.type)
    check_runs(backend, name, {"k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache})
    kernel = get_backend(name)
    call = dict(k_weight=k_weight, eps=eps, weight_offset=weight_offset, per_token=per_token, block_size=paged_block,
                layout=layout)
    if scaled:
        if operators_fused.direct(k, v, cos, sin, k_cache, v_cache):
            options = {n: value for n, value in call.items() if n != "k_weight"}
            write = kernel.prepared_scaled_cache_write(
                k_weight_given=k_weight is not None,
                like=(k, v, cos, sin, k_cache, v_cache, slot_tensor, k_weight, k_scales, v_scales), **options)
            prepared.keep(key, scaled_call(write, k_scale, k_scales, v_scale, v_scales, heads),
                          (k_cache, v_cache, k, v, cos, sin, slots, k_weight, k_scale, v_scale))
        operators_fused.rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slot_tensor, start, backend=name,
                                          k_scale=k_scales, v_scale=v_scales, **call)
        return
    if operators_fused.direct(k, v, cos, sin, k_cache, v_cache):
        write = kernel.prepared_cache_write(
            k_weight_given=k_weight is not None, like=(k, v, cos, sin, k_cache, v_cache, slot_tensor, k_weight),
            **{n: value for n, value in call.items() if n != "k_weight"})
        prepared.keep(key, write, (k_cache, v_cache, k, v, cos, sin, slots, k_weight, None, None))
    operators_fused.rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slot_tensor, start, backend=name, **call)


def slot_mapping(block_table: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """VLLM's slot mapping: where each token of a paged cache lives.

    ``slot = block_table[b, p // block_size] * block_size + p % block_size`` for the token of
    sequence ``b`` at position ``p``; negative positions (padding) give slot -1.

    Args:
        block_table: integer ``(batch, max_blocks)``, the cache blocks of each sequence in order.
        positions: integer ``(batch, seq)`` positions of the tokens to write.
        block_size: rows per block, below 2**63.

    Raises:
        ValueError: a position past the blocks of its row of ``block_table``, or a block id (at a
            non-negative position) that is negative or whose slots would not fit in int64.

    Returns:
        int64 ``(batch * seq,)`` slots, for :func:`rotate_into_cache` with k of shape
        ``(batch * seq, kv_heads, head_dim)``.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 0 < block_size < _INT64_END:
        raise ValueError(f"block_size must be a positive int below 2**63, got {block_size!r}")
    for name, t in (("block_table", block_table), ("positions", positions)):
        if not isinstance(t, Tensor) or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D (batch, ...), got shape {tuple(t.shape)}")
    if block_table.shape[0] != positions.shape[0]:
        raise ValueError(f"block_table has {block_table.shape[0]} rows but positions has {positions.shape[0]}")
    pos = positions.to(torch.int64)
    valid = pos >= 0
    block_index = torch.where(valid, pos // block_size, 0)
    if bool((block_index >= block_table.shape[1]).any()):
        raise ValueError(f"positions reach block {int(block_index.max())}, past the {block_table.shape[1]} blocks of "
                         "block_table")
    blocks = torch.where(valid, torch.gather(block_table.to(torch.int64), 1, block_index), 0)
    # a slot must be a non-negative int64: a negative block would read as padding (the token
    # dropped), one past this bound would wrap around into another sequence's blocks
    last_block = (_INT64_END - block_size) // block_size
    bad = (blocks < 0) | (blocks > last_block)
    if bool(bad.any()):
        b, p = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"block_table must hold block ids in [0, {last_block}] for block_size={block_size} "
                         f"(slots are int64), got {int(blocks[b, p])} for sequence {b}, position {int(pos[b, p])}")
    return torch.where(valid, blocks * block_size + pos % block_size, -1).reshape(-1)
