"""The public namespace of DeepSeek's multi-head latent attention (MLA) RoPE: ``from ropekit import mla``.

DeepSeek-V2/V3, Kimi K2 and GLM's MLA models rotate a slice of each query head (``q_pe``) and
one key head shared by all heads (``k_pe``), and cache the compressed kv beside the rotated key:

- rotations: :func:`apply_rotary_mla` (broadcast tables) and :func:`rotate_mla` (rows by
  position) rotate q_pe and k_pe in one kernel call, in DeepSeek's interleaved pairing or
  de-interleaved on the way out (transformers' order); :func:`mla_keys` concatenates the
  per-head keys;
- the cache write: :func:`rotate_into_mla_cache` (compressed kv and rotated key into their
  caches, contiguous or paged);
- the maths: :func:`attention_factor` (DeepSeek's YaRN cos/sin factor), :func:`softmax_scale`
  (its ``mscale_all_dim`` softmax scale), :func:`permute_mla_weight` (the rope rows of the
  projections between pairings, once).

They live in :mod:`ropekit.fused.mla`, :mod:`ropekit.fused.mla_cache` and :mod:`ropekit.rope.mla`.
See docs/models.md, "DeepSeek MLA".
"""

from .fused.mla import apply_rotary_mla, mla_keys, rotate_mla
from .fused.mla_cache import rotate_into_mla_cache
from .rope.mla import attention_factor, permute_mla_weight, softmax_scale

__all__ = [
    "apply_rotary_mla",
    "attention_factor",
    "mla_keys",
    "permute_mla_weight",
    "rotate_into_mla_cache",
    "rotate_mla",
    "softmax_scale",
]
