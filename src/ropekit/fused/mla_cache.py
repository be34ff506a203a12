"""The MLA cache write: the compressed kv and the rotated shared key into their caches, in one call.

DeepSeek's MLA caches, per token, the compressed kv ``kv_c`` (``kv_lora_rank`` channels, after
its RMSNorm) and the rotated shared key ``k_pe`` (``rotary_dim`` channels); the keys and values
of every head are expanded from them at attention time. :func:`rotate_into_mla_cache` writes
both into their slots, with the same two layouts as :func:`ropekit.rotate_into_cache`:

- **contiguous** (one buffer per sequence): ``kv_cache`` ``(batch, max_length, kv_lora_rank)``,
  ``pe_cache`` ``(batch, max_length, rotary_dim)``; the new tokens of row ``b`` go to
  ``[slots[b], slots[b] + seq)`` (transformers' MLA cache layers hold the same rows with a head
  axis of 1: pass ``cache[:, 0]``);
- **paged** (vLLM's blocks): ``kv_cache`` ``(num_blocks, block_size, kv_lora_rank)``, ``pe_cache``
  ``(num_blocks, block_size, rotary_dim)``; token ``t`` goes to slot ``slots[t]`` (negative:
  padding, skipped), :func:`ropekit.slot_mapping` computes them from a block table. vLLM keeps
  both in one ``(num_blocks, block_size, kv_lora_rank + rotary_dim)`` buffer: pass its two
  slices ``cache[..., :kv_lora_rank]`` and ``cache[..., kv_lora_rank:]`` (views that share no element).

The key is rotated where it lands when its rows form one slice of the cache (the contiguous
layout with one start for every row: copied into its slots, then rotated in place there, with
no tensor of its own); otherwise it is rotated into a fresh tensor and scattered. Everything is
checked before anything is written. Built on the backends' ``apply_rotary`` (the calls
``Backend.prepared`` gives for the signature, kept as the prepared call of this entry point):
every backend serves it, the eager ``"torch"`` one too.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops import prepared, prepared_keys
from ..ops.dispatch import check_runs, resolve
from ..ops.dispatch import get as get_backend
from ..ops.memory import check_not_shared
from ..validation import check_float_tensor, check_layout, check_tables
from .mla import check_rotary_width, pairs_view, place_rope


def _check_block_size(block_size: int | None) -> int:
    """0 for the contiguous layout (None), else the positive int ``block_size``."""
    if block_size is None:
        return 0
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int (paged layout) or None (contiguous), got {block_size!r}")
    return block_size


def _check_caches(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, pe_cache: Tensor, block_size: int) -> None:
    """Ranks, widths, dtypes and devices of the inputs and their caches (``block_size`` 0: contiguous)."""
    tensors = {"kv_c": kv_c, "k_pe": k_pe, "kv_cache": kv_cache, "pe_cache": pe_cache}
    for name, t in tensors.items():
        check_float_tensor(t, name)
    rank = 2 if block_size else 3
    form = ("kv_c (tokens, kv_lora_rank), k_pe (tokens, rotary_dim), caches (num_blocks, block_size, channels)"
            if block_size else "kv_c (batch, seq, kv_lora_rank), k_pe (batch, seq, rotary_dim), caches (batch, "
            "max_length, channels)")
    layout_name = "paged" if block_size else "contiguous"
    for name, t in tensors.items():
        want = 3 if name.endswith("cache") else rank
        if t.dim() != want:
            raise ValueError(f"{name} must be {want}-D for the {layout_name} layout ({form}), got shape "
                             f"{tuple(t.shape)}")
    if kv_c.shape[:-1] != k_pe.shape[:-1]:
        raise ValueError(f"kv_c and k_pe must hold the same tokens (all axes but the last equal), got "
                         f"{tuple(kv_c.shape)} and {tuple(k_pe.shape)}")
    if kv_cache.shape[:2] != pe_cache.shape[:2]:
        axes = "num_blocks, block_size" if block_size else "batch, max_length"
        raise ValueError(f"kv_cache and pe_cache must have the same first two axes ({axes}), got "
                         f"{tuple(kv_cache.shape)} and {tuple(pe_cache.shape)}")
    if block_size and kv_cache.shape[1] != block_size:
        raise ValueError(f"the caches' axis 1 must be block_size={block_size}, got kv_cache {tuple(kv_cache.shape)}")
    if not block_size and kv_cache.shape[0] != kv_c.shape[0]:
        raise ValueError(f"kv_cache must have kv_c's batch of {kv_c.shape[0]} rows, got {tuple(kv_cache.shape)}")
    for cache, x, cache_name, x_name in ((kv_cache, kv_c, "kv_cache", "kv_c"), (pe_cache, k_pe, "pe_cache", "k_pe")):
        if cache.shape[-1] != x.shape[-1]:
            raise ValueError(f"{cache_name} must have the {x.shape[-1]} channels of {x_name}, got shape "
                             f"{tuple(cache.shape)}")
        if cache.dtype != x.dtype:
            raise ValueError(f"{cache_name} must have the dtype of {x_name}: {x.dtype} into {cache.dtype}")
    for name, t in tensors.items():
        if t.device != k_pe.device:
            raise ValueError(f"{name} is on {t.device} but k_pe is on {k_pe.device}")


def _check_slots(slots: int | Tensor, k_pe: Tensor, kv_cache: Tensor, block_size: int) -> None:
    """Raise unless ``slots`` is an int or an integer tensor of the layout's shape whose every slot fits the caches.

    Contiguous: starts in ``[0, max_length - seq]``; paged: slots below ``num_blocks *
    block_size`` (negative: padding). A CUDA slots tensor is read back for this.
    """
    if isinstance(slots, bool) or not isinstance(slots, (int, Tensor)):
        raise TypeError(f"slots must be an int or an integer tensor, got {type(slots).__name__}")
    if isinstance(slots, int):
        if block_size:
            raise ValueError(f"slots must be a (tokens,) integer tensor (a slot mapping) for the paged layout, got the "
                             f"int {slots}")
        low = high = slots
    else:
        if slots.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"slots must be an int32 or int64 tensor, got {slots.dtype}")
        shapes = [(k_pe.shape[0],)] if block_size else [(), (1,), (k_pe.shape[0],)]
        if tuple(slots.shape) not in shapes:
            what = "(tokens,) for the paged layout" if block_size else "(), (1,) or (batch,) for the contiguous layout"
            raise ValueError(f"slots must have shape {what} = {shapes[-1]}, got {tuple(slots.shape)}")
        if slots.device != k_pe.device:
            raise ValueError(f"slots is on {slots.device} but k_pe is on {k_pe.device}")
        if not slots.numel():
            return
        low, high = (int(v) for v in torch.aminmax(slots.reshape(-1)))
    if block_size:
        capacity = kv_cache.shape[0] * kv_cache.shape[1]
        if high >= capacity:
            raise ValueError(f"slots must be below num_blocks * block_size = {capacity} (negative: padding), got a "
                             f"slot {high}")
    else:
        seq, length = k_pe.shape[1], kv_cache.shape[1]
        if low < 0 or high > length - seq:
            raise ValueError(f"slots must be starts in [0, max_length - seq] = [0, {length - seq}] (the caches hold "
                             f"{length} positions, k_pe {seq} new tokens), got {low if low < 0 else high}")


def _rows(cache: Tensor) -> Tensor | None:
    """A paged cache viewed as ``(num_blocks * block_size, channels)`` rows, or None when its strides forbid it."""
    try:
        return cache.view(-1, cache.shape[-1])  # a view when blocks and rows are evenly strided (any slice of a buffer)
    except RuntimeError:
        return None


def _writer(like: tuple, layout: str, output_layout: str, block_size: int, backend: str):
    """``write(kv_c, k_pe, cos, sin, kv_cache, pe_cache, slots) -> bool`` for arguments like ``like`` (all checked).

    Kept as the prepared call of their signature: it checks the slots' values (the only thing
    the signature does not fix) and returns False, writing nothing, for one outside the caches.
    The rotations are the backend's prepared calls: in place for the key where it lands (a slice
    of ``pe_cache``, placed there in ``output_layout``), else into a new tensor in ``layout``,
    scattered into a view of ``pe_cache`` that puts each pair where ``output_layout`` wants it.
    """
    kv_c, k_pe, cos, sin, kv_cache, pe_cache, _ = like
    kernel = get_backend(backend)
    seq = 0 if block_size else k_pe.shape[1]
    capacity, last_start = kv_cache.shape[0] * kv_cache.shape[1], kv_cache.shape[1] - seq
    rotate_landed = None if block_size else kernel.prepared((pe_cache.narrow(1, 0, seq), cos, sin),
                                                            layout=output_layout, inplace=True)
    rotate_new = kernel.prepared((k_pe, cos, sin), layout=layout, inplace=False)
    reorder = layout != output_layout
    as_rows = bool(block_size) and _rows(kv_cache) is not None and _rows(pe_cache) is not None

    def write(kv_c, k_pe, cos, sin, kv_cache, pe_cache, slots) -> bool:
        count = 1 if type(slots) is int else slots.numel()
        if count == 0:
            return True
        if count == 1:
            low = high = int(slots)
        else:
            low, high = (int(v) for v in torch.aminmax(slots))
        if (high >= capacity) if block_size else (low < 0 or high > last_start):
            return False
        if not block_size and low == high:  # one slice of each cache: the key is rotated where it lands
            kv_cache.narrow(1, low, seq).copy_(kv_c)
            landed = pe_cache.narrow(1, low, seq)
            place_rope(landed, k_pe, layout, output_layout)
            rotate_landed(landed, cos, sin)
            return True
        rotated = rotate_new(k_pe, cos, sin)
        index = slots if slots.dtype is torch.int64 else slots.long()
        if block_size and low < 0:  # padding tokens are not written
            keep = index >= 0
            index, kv_c, rotated = index[keep], kv_c[keep], rotated[keep]
        if block_size and as_rows:
            kv_target, pe_target = kv_cache.view(-1, kv_cache.shape[-1]), pe_cache.view(-1, pe_cache.shape[-1])
        else:
            kv_target, pe_target = kv_cache, pe_cache
        if reorder:  # each pair lands where output_layout wants it
            pe_target, rotated = pairs_view(pe_target, output_layout), pairs_view(rotated, layout)
        if block_size and as_rows:
            kv_target.index_copy_(0, index, kv_c)
            pe_target.index_copy_(0, index, rotated)
            return True
        if block_size:
            where = (index // block_size, index % block_size)
        else:  # one start per row
            where = (torch.arange(k_pe.shape[0], device=k_pe.device)[:, None],
                     index[:, None] + torch.arange(seq, device=k_pe.device))
        kv_target.index_put_(where, kv_c)
        pe_target.index_put_(where, rotated)
        return True

    return write


def rotate_into_mla_cache(
    kv_c: Tensor,
    k_pe: Tensor,
    cos: Tensor,
    sin: Tensor,
    kv_cache: Tensor,
    pe_cache: Tensor,
    slots: int | Tensor,
    *,
    layout: str,
    output_layout: str | None = None,
    block_size: int | None = None,
    backend: str = "auto",
) -> None:
    """Write the compressed kv and the rotated shared key of new tokens into their MLA caches, in one call.

    Equal, bit for bit, to the unfused composition: ``k_rot = apply_rotary(k_pe, cos, sin)``
    (reordered to ``output_layout``), then ``kv_c`` and ``k_rot`` copied into their slots.

    Args:
        kv_c: the compressed kv after its norm: ``(batch, seq, kv_lora_rank)`` (contiguous layout)
            or ``(tokens, kv_lora_rank)`` (paged); any strides.
        k_pe: the unrotated shared key, ``(batch, seq, rotary_dim)`` or ``(tokens, rotary_dim)``.
        cos, sin: the new tokens' half-width tables broadcast against k_pe, e.g. ``(batch, seq,
            rotary_dim // 2)`` or ``(tokens, rotary_dim // 2)``.
        kv_cache, pe_cache: the caches, written in place (dtypes of kv_c and k_pe):
            ``(batch, max_length, channels)``, or paged ``(num_blocks, block_size, channels)``.
        slots: contiguous: the position in the caches of each row's first new token, an int
            (every row) or an integer ``()``/``(batch,)`` tensor; paged: the slot of each token,
            an integer ``(tokens,)`` tensor (negative: padding, not written).
        layout: the pairing k_pe is stored in (``"interleaved"`` for DeepSeek's checkpoints).
        output_layout: the pairing the cache holds; None: ``layout``. ``"half"`` with
            ``layout="interleaved"`` caches what transformers caches (de-interleaved keys).
        block_size: None for the contiguous layout, the caches' block size for the paged one.
        backend: ``"auto"`` or a name from :func:`ropekit.ops.available`.

    Raises:
        ValueError / TypeError: naming the argument: ranks, widths, dtypes or devices that do not
            fit, slots outside the caches, caches that share memory with each other or with an
            input, inputs that require grad (a cache write has no autograd). All checked before
            anything is written (a CUDA slots tensor is read back for this).
    """
    key, run = prepared_keys.rotate_into_mla_cache(kv_c, k_pe, cos, sin, kv_cache, pe_cache, slots, layout,
                                                   output_layout, block_size, backend)  # the options as given
    if run is not None and run(kv_c, k_pe, cos, sin, kv_cache, pe_cache, slots):
        return  # a call of a checked signature whose slots fit (else the checks below raise)
    layout = check_layout(layout)
    output_layout = layout if output_layout is None else check_layout(output_layout, "output_layout")
    paged_block = _check_block_size(block_size)
    _check_caches(kv_c, k_pe, kv_cache, pe_cache, paged_block)
    check_rotary_width(k_pe, cos, sin)
    check_tables(k_pe, cos, sin)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.device != k_pe.device:
            raise ValueError(f"{name} is on {t.device} but k_pe is on {k_pe.device}")
    _check_slots(slots, k_pe, kv_cache, paged_block)
    check_not_shared({"kv_cache": kv_cache, "pe_cache": pe_cache},
                     {"kv_c": kv_c, "k_pe": k_pe, "cos": cos, "sin": sin, "slots": slots}, "rotate_into_mla_cache")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (kv_c, k_pe, cos, sin)):
        raise ValueError("rotate_into_mla_cache writes caches and has no autograd: call it under torch.no_grad() (or "
                         "pass detached tensors)")
    name = resolve(backend, k_pe.device.type)
    check_runs(backend, name, {"k_pe": k_pe, "pe_cache": pe_cache})
    tensors = (kv_c, k_pe, cos, sin, kv_cache, pe_cache, slots)
    write = _writer(tensors, layout, output_layout, paged_block, name)
    prepared.keep(key, write, (kv_cache, pe_cache, kv_c, k_pe, cos, sin, slots))
    write(*tensors)
