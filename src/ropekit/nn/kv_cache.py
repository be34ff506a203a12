"""The key/value cache of an attention layer: concatenating, or preallocated with keys rotated into their slots."""

from __future__ import annotations

import torch

from ..functional import apply_rotary
from ..fused import rms_norm_rotary, rotate_into_cache
from ..validation import positive_int


class KVCache:
    """Rotated keys and values of the tokens seen so far, for one attention layer.

    ``k`` and ``v`` are ``None`` while empty, then tensors of shape
    ``(batch, kv_heads, length, head_dim)``. Keys are stored *after* the rotation
    (as in Hugging Face): a cached key never needs its position again, and the
    cache is valid for any later query position. Use one cache per layer.

    Args:
        max_length: None (default): each :meth:`update` concatenates, the plain,
            allocation-per-step cache, meant to be obviously correct rather than fast. An int:
            the first update allocates buffers of ``max_length`` tokens, later ones write into
            them (``k``/``v`` are views of the filled part), and :meth:`update_rotating` rotates
            new keys straight into their slots (:func:`ropekit.rotate_into_cache`).

    Example::

        cache = KVCache(max_length=4096)
        out = attn(prompt, cache=cache)                 # positions 0 .. P-1
        out = attn(next_token, cache=cache)             # position P, sees all P+1 keys
    """

    def __init__(self, max_length: int | None = None) -> None:
        self.max_length = None if max_length is None else positive_int(max_length, "max_length")
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._filled = 0

    @property
    def length(self) -> int:
        """Number of cached tokens (0 when empty)."""
        return 0 if self.k is None else self.k.shape[-2]

    def __repr__(self) -> str:
        shape = None if self.k is None else tuple(self.k.shape)
        return f"KVCache(length={self.length}, shape={shape}, max_length={self.max_length})"

    def reset(self) -> None:
        """Drop every cached token (preallocated buffers are kept for the next sequence of the same shape)."""
        self.k = None
        self.v = None
        self._filled = 0

    def _check_new(self, k: torch.Tensor, v: torch.Tensor) -> None:
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(
                    f"{name} must be a (batch, kv_heads, seq, head_dim) tensor, got {getattr(t, 'shape', t)}"
                )
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        if self.k is None:
            return
        cached = self.k.shape
        if (k.shape[0], k.shape[1], k.shape[3]) != (cached[0], cached[1], cached[3]):
            raise ValueError(
                f"k of shape {tuple(k.shape)} does not extend the cache of shape {tuple(cached)}: "
                "batch, kv_heads and head_dim must match"
            )
        if k.dtype != self.k.dtype or k.device != self.k.device or v.dtype != self.v.dtype:
            raise ValueError(
                f"k is {k.dtype} on {k.device} but the cache holds {self.k.dtype} on {self.k.device}"
            )

    def _slots(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The preallocated buffers, (re)allocated for k's batch, heads, dtype and device; checks the room left."""
        if self._filled + k.shape[2] > self.max_length:
            raise ValueError(f"the cache holds {self._filled} tokens and max_length={self.max_length}: no room for "
                             f"{k.shape[2]} more")
        buffers = self._buffers
        shape = (k.shape[0], k.shape[1], self.max_length, k.shape[3])
        if buffers is None or buffers[0].shape != shape or buffers[0].dtype != k.dtype or buffers[1].dtype != v.dtype \
                or buffers[0].device != k.device:
            buffers = (k.new_zeros(shape), v.new_zeros(shape))
            self._buffers = buffers
        return buffers

    def _filled_views(self, added: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._filled += added
        k_buf, v_buf = self._buffers
        self.k, self.v = k_buf[:, :, :self._filled], v_buf[:, :, :self._filled]
        return self.k, self.v

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new keys and values; return all of them.

        Args:
            k: rotated keys of the new tokens, ``(batch, kv_heads, new, head_dim)``.
            v: values of the new tokens, same shape as ``k``.

        Returns:
            ``(k_all, v_all)`` of shape ``(batch, kv_heads, length + new, head_dim)``
            (``length`` before the call), the cached tokens first.
        """
        self._check_new(k, v)
        if self.max_length is not None:
            k_buf, v_buf = self._slots(k, v)
            k_buf[:, :, self._filled:self._filled + k.shape[2]].copy_(k)
            v_buf[:, :, self._filled:self._filled + k.shape[2]].copy_(v)
            return self._filled_views(k.shape[2])
        if self.k is None or self.v is None:
            self.k, self.v = k, v
            return k, v
        self.k = torch.cat((self.k, k), dim=-2)
        self.v = torch.cat((self.v, v), dim=-2)
        return self.k, self.v

    def update_rotating(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                        layout: str = "half", k_weight: torch.Tensor | None = None, eps: float | None = None,
                        norm: str = "per_head", weight_offset: float = 0.0,
                        backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """Append *unrotated* keys (rotated on the way in, normalised first with ``eps``) and values.

        With ``max_length`` the keys are rotated straight into their slots and the values copied
        in the same pass (:func:`ropekit.rotate_into_cache`: one read and one write per element);
        otherwise, and while autograd records k or v, they are rotated and then appended.

        Args:
            k, v: ``(batch, kv_heads, new, head_dim)``, the keys not yet rotated.
            cos, sin: the new tokens' tables, broadcast against k as for :func:`ropekit.apply_rotary`
                (e.g. ``(batch or 1, 1, new, rotary_dim // 2)``).
            layout, backend: as for :func:`ropekit.apply_rotary`.
            k_weight, eps, norm, weight_offset: the keys' RMSNorm, as for :func:`ropekit.rms_norm_rotary`.

        Returns:
            ``(k_all, v_all)`` as :meth:`update` returns them.
        """
        self._check_new(k, v)
        grad = torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)
        if self.max_length is None or grad:
            if eps is None:
                rotated = apply_rotary(k, cos, sin, layout=layout, backend=backend)
            else:
                rotated = self._normalised(k, k_weight, cos, sin, eps=eps, norm=norm, layout=layout,
                                           weight_offset=weight_offset, backend=backend)
            return self.update(rotated, v)
        k_buf, v_buf = self._slots(k, v)
        rotate_into_cache(k, v, cos, sin, k_buf, v_buf, self._filled, layout=layout, k_weight=k_weight, eps=eps,
                          norm=norm, weight_offset=weight_offset, backend=backend)
        return self._filled_views(k.shape[2])

    @staticmethod
    def _normalised(k, k_weight, cos, sin, *, eps, norm, layout, weight_offset, backend):
        """Keys normalised and rotated (per token: over the kv_heads axis 1)."""
        if norm != "per_token":
            return rms_norm_rotary(k, k_weight, cos, sin, eps=eps, norm=norm, layout=layout,
                                   weight_offset=weight_offset, backend=backend)
        lead = (1,) * (k.dim() - cos.dim())
        cos, sin = cos.view(*lead, *cos.shape).transpose(1, 2), sin.view(*lead, *sin.shape).transpose(1, 2)
        return rms_norm_rotary(k.transpose(1, 2), k_weight, cos, sin, eps=eps, norm=norm, layout=layout,
                               weight_offset=weight_offset, backend=backend).transpose(1, 2)
