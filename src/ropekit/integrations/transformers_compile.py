"""What a patched transformers model computes while ``torch.compile`` traces it: plain torch expressions.

In eager mode the patch hands q and k to ropekit's kernels (the fused q/k norm + rotation, the key
rotated into its cache slot). Traced, a kernel is an opaque ``torch.library`` node: inductor can
fuse nothing into it or out of it, so the q/k norms, the rotation and the cache write each make a
pass of their own and the node costs a dispatch at every step. Measured on a tiny Qwen3
(benchmarks/model_speed.py), the compiled patched model decoded 20-25% fewer tokens per second than
the compiled unpatched one that way. So while tracing, the patch gives inductor expressions it can
fuse with the ops around them:

* the q/k norms are the model's own modules (nothing is deferred);
* the rotation is the eager backend's arithmetic (:func:`rotated`): the half-width float32
  tables, computed in float32, rounded once to q's dtype (as the kernels compute; tested against
  the float64 reference);
* the cache write is transformers' own ``StaticLayer.update`` (an ``index_copy_``).

The same holds for the families with their own rotation function: Llama 4's complex
``apply_rotary_emb`` (:func:`rotated_qk` in its ``(batch, seq, heads, head_dim)`` order) and
DeepSeek-V3's ``apply_rotary_pos_emb_interleave`` (:func:`rotated_mla`: the interleaved pairs
rotated and written in transformers' half order, as :func:`ropekit.mla.apply_rotary_mla` does in
eager mode). A NoPE layer of a schedule (SmolLM3, Llama 4) calls no rotation, traced or not.

The tables stay ropekit's (float64 angles rounded to float32, computed once per forward). With
``EXPRESSIONS = False`` a traced model calls ropekit's operators instead (the benchmark's
``--traced-operators`` compares the two).
"""

from __future__ import annotations

import torch

from ..ops.eager import apply_rotary_differentiable

EXPRESSIONS = True  # False: a traced patched model calls ropekit's operators (for comparisons)


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` rotated by plain torch ops that inductor can fuse: ``y1 = x1 c - x2 s``, ``y2 = x2 c + x1 s``.

    Args:
        x: ``(batch, heads, seq, head_dim)`` (any float dtype).
        cos, sin: half-width float32 tables broadcast against ``x``, e.g. ``(batch, 1, seq, rotary_dim // 2)``.
        layout: ``"half"`` or ``"interleaved"`` (validated by :func:`ropekit.integrations.transformers.patch`).

    Returns:
        A new tensor of ``x``'s shape and dtype: the first ``rotary_dim`` channels rotated (float32
        arithmetic, one rounding), the rest copied.
    """
    return apply_rotary_differentiable(x, cos, sin, layout=layout)


def rotated_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotated` of q and of k (the traced form of ``apply_rotary_pos_emb``)."""
    return rotated(q, cos, sin, layout), rotated(k, cos, sin, layout)


def rotated_mla(q: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The traced form of DeepSeek-V3's ``apply_rotary_pos_emb_interleave``: outputs in the half pairing.

    Args:
        q: ``(batch, heads, seq, rotary_dim)``, the query heads' rope slice (any float dtype).
        k_pe: ``(batch, 1, seq, rotary_dim)``, the shared key's rope slice.
        cos, sin: half-width float32 tables ``(batch, 1, seq, rotary_dim // 2)``.
        layout: the pairing q and k_pe are stored in: ``"interleaved"`` (DeepSeek's checkpoints;
            the channels are put in the half order, then rotated) or ``"half"``.

    Returns:
        ``(q_rotated, k_pe_rotated)`` in the half pairing, shapes and dtypes of q and k_pe, as
        :func:`ropekit.mla.apply_rotary_mla` with ``output_layout="half"`` gives them.
    """
    if layout == "interleaved":  # pairs (2i, 2i + 1) -> (i, i + rotary_dim / 2), as transformers reorders them
        q, k_pe = (t.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2) for t in (q, k_pe))
    return rotated(q, cos, sin, "half"), rotated(k_pe, cos, sin, "half")
