"""A transformers static cache whose full-attention layers take keys unrotated and rotate them into their slots.

transformers' attention rotates the key, then ``past_key_values.update(key, value, layer_idx)`` copies
it into the cache: the key is read and written twice. With :func:`static_cache`, the patched
``apply_rotary_pos_emb`` hands the key back unrotated (and, for the q/k-norm families,
unnormalised) and records it; :class:`RotatingStaticLayer` recognises it in ``update`` and writes
the rotated (normalised) keys and the values into their slots in one pass
(:func:`ropekit.rotate_into_cache`). Anything else reaching ``update`` (an unpatched model, a key
that is not the recorded one) takes transformers' own path.

Limits: only ``StaticLayer`` (full attention) layers are replaced; sliding-window layers, the
``DynamicCache`` that ``generate`` builds by default (it concatenates, so there is no copy to save),
quantised and offloaded caches keep transformers' update. Under ``torch.compile`` nothing is deferred.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import StaticCache, StaticLayer

from ..fused import rotate_into_cache
from .transformers_norms import current


class RotatingStaticLayer(StaticLayer):
    """A ``StaticLayer`` that writes keys deferred by ropekit's patch rotated into their slots (see the module)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """The fused cache write for the key the patched attention deferred; anything else: transformers' ``update``."""
        call = current()
        deferred = call.deferred_key if call is not None else None
        if deferred is None or deferred[0] is not key_states:
            return super().update(key_states, value_states, *args, **kwargs)
        call.deferred_key = None
        _, k, spec, cos, sin = deferred
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        norm = {} if spec is None else dict(
            k_weight=spec.weight.view(k.shape[1], -1) if spec.weight.numel() != k.shape[-1] else spec.weight,
            eps=spec.eps, weight_offset=spec.weight_offset,
            norm="per_token" if spec.weight.numel() != k.shape[-1] else "per_head")
        rotate_into_cache(k, value_states, cos, sin, self.keys, self.values, self.cumulative_length,
                          layout=call.layout, backend=call.backend, **norm)
        self.cumulative_length.add_(k.shape[-2])
        return self.keys, self.values


def static_cache(model: torch.nn.Module, max_cache_len: int, **kwargs: Any) -> StaticCache:
    """A transformers ``StaticCache`` for ``model`` whose full-attention layers rotate keys into their slots.

    Pass it as ``model.generate(..., past_key_values=static_cache(model, max_cache_len))`` (or to
    ``model(...)``) on a model patched by :func:`ropekit.integrations.transformers.patch`. Keyword
    arguments go to ``StaticCache``.
    """
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len, **kwargs)
    for i, layer in enumerate(cache.layers):
        if type(layer) is StaticLayer:
            cache.layers[i] = RotatingStaticLayer(max_cache_len=layer.max_cache_len)
    return cache
