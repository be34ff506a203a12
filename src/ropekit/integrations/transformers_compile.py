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
