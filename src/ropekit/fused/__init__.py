"""The fused forms: validate every argument once, then call an operator (:mod:`ropekit.ops.operators_fused`).

- :func:`rms_norm_rotary_qk` / :func:`rms_norm_rotary`: q/k RMSNorm (per head, or per token over
  its heads) and rotation in one pass, forward and backward;
- :func:`rotate_into_cache`: keys rotated (optionally normalised) and values copied into KV-cache
  slots in one pass, contiguous or paged, FP8 caches through vLLM's scales; :func:`slot_mapping` for
  the paged layout; :func:`dequantize_cache` reads an FP8 cache back;
- :func:`rerotate_cache`: cached keys moved from position ``p`` to ``p + delta`` in place (context
  shift, attention sinks), contiguous or paged; :func:`context_shift` for StreamingLLM's step.

The layer above :mod:`ropekit.functional`: same conventions (tables, layouts, backends), and
``nn`` and ``integrations`` call these as they call the rotations.
"""

from .cache import rotate_into_cache, slot_mapping
from .cache_scales import dequantize_cache
from .norm import rms_norm_rotary, rms_norm_rotary_qk
from .rerotate import context_shift, rerotate_cache

__all__ = ["context_shift", "dequantize_cache", "rerotate_cache", "rms_norm_rotary", "rms_norm_rotary_qk",
           "rotate_into_cache", "slot_mapping"]
