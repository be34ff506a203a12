"""A transformers static cache whose full-attention layers take keys unrotated and rotate them into their slots.

transformers' attention rotates the key, then ``past_key_values.update(key, value, layer_idx)`` copies
it into the cache: the key is read and written twice. With :func:`static_cache`, the patched
``apply_rotary_pos_emb`` hands the key back unrotated (and, for the q/k-norm families,
unnormalised) and records it; :class:`RotatingStaticLayer` recognises it in ``update`` and writes
the rotated (normalised) keys and the values into their slots in one pass
(:func:`ropekit.rotate_into_cache`). Anything else reaching ``update`` (an unpatched model, a key
that is not the recorded one) takes transformers' own path.

On a CPU model the layer also hands attention, in eager mode, only the slots written so far, and
says so to the mask (``get_mask_sizes``). transformers' ``StaticLayer`` returns all ``max_cache_len``
slots, so every decode step attends over the empty ones too, behind an explicit mask; and since a
static cache says it is compileable, transformers builds that mask at every step, even for one query
token, where it would otherwise leave attention unmasked (it expects a compiled forward). A tiny
model decoded 10-20% fewer tokens per second with it than with ``DynamicCache`` (which attends over
the written keys, unmasked for one query token). Here the slots written are counted in Python
(``filled``, beside the ``cumulative_length`` tensor; the layers also give it as their length and
as the slot the keys go to), and the layer is compileable only while ``torch.compile`` traces it,
where it returns every slot, as transformers' does. A traced step does not read the count (the
compiled graph would guard on its value and be compiled again at every step): it leaves it unknown,
and the next eager step reads it back once from ``cumulative_length``. ``generate`` compiles its
forward only on accelerators (or when asked to with ``compile_config``), so on a model elsewhere (a
GPU: ``generate`` may compile with a static cache) the layers keep transformers' behaviour.

Limits: only ``StaticLayer`` (full attention) layers are replaced; sliding-window layers, the
``DynamicCache`` that ``generate`` builds by default (it concatenates, so there is no copy to save),
quantised and offloaded caches keep transformers' update. Under ``torch.compile`` nothing is deferred:
the traced key is rotated by a plain expression and written by transformers' ``update``
(:mod:`.transformers_compile`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import StaticCache, StaticLayer

from ..fused import rotate_into_cache
from .transformers_norms import current


class RotatingStaticLayer(StaticLayer):
    """A ``StaticLayer`` that writes keys deferred by ropekit's patch rotated into their slots (see the module).

    ``filled``: the slots written so far (``cumulative_length`` as a Python int). With
    ``attend_written`` (a CPU model: see the module), in eager mode ``update`` returns those slots
    alone, ``get_mask_sizes`` sizes the mask for them and the layer is not compileable (so
    transformers may leave attention unmasked for one query token); while ``torch.compile`` traces
    it, it is transformers' ``StaticLayer``.
    """

    def __init__(self, max_cache_len: int, attend_written: bool = False, **kwargs: Any) -> None:
        super().__init__(max_cache_len=max_cache_len, **kwargs)
        self._filled: int | None = 0  # None: written by a compiled step, read back from cumulative_length
        self.attend_written = attend_written

    @property
    def filled(self) -> int:
        """The slots written so far, an int (read back from ``cumulative_length`` once after compiled steps)."""
        if self._filled is None:
            self._filled = int(self.cumulative_length)
        return self._filled

    @property
    def is_compileable(self) -> bool:
        """Whether transformers may take the layer as static-shaped: not in eager mode with ``attend_written``."""
        return not self.attend_written or torch.compiler.is_compiling()

    def reset(self) -> None:
        """Empty the layer (transformers' ``reset``), and the count of slots written."""
        super().reset()
        self._filled = 0

    def get_seq_length(self) -> Any:
        """The tokens in the layer: an int (as DynamicCache gives) in eager mode with attend_written, else a tensor."""
        if not self.attend_written or torch.compiler.is_compiling():
            return super().get_seq_length()
        return self.filled

    def get_mask_sizes(self, query_length: Any, *args: Any, **kwargs: Any) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the mask: the slots written once this step's are (eager), else every slot."""
        if not self.attend_written or torch.compiler.is_compiling():
            return super().get_mask_sizes(query_length, *args, **kwargs)
        if isinstance(query_length, torch.Tensor):  # transformers before 4.57 passes cache_position
            query_length = query_length.shape[0]
        return min(self.filled + query_length, self.max_cache_len), 0

    def _wrote(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Count ``tokens`` more slots written; return the keys and values attention reads.

        Eager: the slots written (with ``attend_written``), else the whole cache. A traced step
        returns the whole cache and forgets the count instead of reading it: a count read while
        tracing would make ``torch.compile`` guard on its value (and compile again at every step,
        or make it a symbolic size); ``cumulative_length``, the tensor the compiled graph updates,
        keeps it.
        """
        if torch.compiler.is_compiling():
            self._filled = None
            return self.keys, self.values
        filled = self.filled + tokens
        self._filled = filled
        if not self.attend_written or filled >= self.max_cache_len:
            return self.keys, self.values
        return self.keys.narrow(2, 0, filled), self.values.narrow(2, 0, filled)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """The fused cache write for the key the patched attention deferred; anything else: transformers' ``update``."""
        call = current()
        deferred = call.deferred_key if call is not None else None
        if deferred is None or deferred[0] is not key_states:
            super().update(key_states, value_states, *args, **kwargs)
            return self._wrote(key_states.shape[-2])
        call.deferred_key = None  # deferred in eager mode only (the patch defers nothing while tracing)
        _, k, spec, cos, sin = deferred
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        norm = {}
        if spec is not None:
            weight = spec.weight
            per_token = weight.numel() != k.shape[-1]
            norm = dict(k_weight=weight.view(k.shape[1], -1) if per_token else weight, eps=spec.eps,
                        weight_offset=spec.weight_offset, norm="per_token" if per_token else "per_head")
        start = self.filled if self.attend_written else self.cumulative_length  # an int slot as DynamicCache counts
        rotate_into_cache(k, value_states, cos, sin, self.keys, self.values, start, layout=call.layout,
                          backend=call.backend, **norm)
        self.cumulative_length.add_(k.shape[-2])
        return self._wrote(k.shape[-2])


def static_cache(model: torch.nn.Module, max_cache_len: int, **kwargs: Any) -> StaticCache:
    """A transformers ``StaticCache`` for ``model`` whose full-attention layers rotate keys into their slots.

    Pass it as ``model.generate(..., past_key_values=static_cache(model, max_cache_len))`` (or to
    ``model(...)``) on a model patched by :func:`ropekit.integrations.transformers.patch`. Keyword
    arguments go to ``StaticCache``. On a CPU model its layers attend over the slots written so far in
    eager mode (see the module).
    """
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len, **kwargs)
    parameter = next(model.parameters(), None)
    attend_written = parameter is None or parameter.device.type == "cpu"
    for i, layer in enumerate(cache.layers):
        if type(layer) is StaticLayer:
            cache.layers[i] = RotatingStaticLayer(max_cache_len=layer.max_cache_len, attend_written=attend_written)
    return cache
