"""Multi-head softmax self-attention with RoPE (RoFormer eq. 16) and a key/value cache.

``RotarySelfAttention`` is the textbook self-attention with RoPE grown to what a decoder
layer needs: grouped-query attention, partial rotary, a KV cache for incremental decoding,
padded batches with per-row positions. Scores are

    softmax((R_m q_m)^T (R_n k_n) / sqrt(head_dim)) = softmax(q_m^T R_{n-m} k_n / sqrt(head_dim))

so they depend on positions only through ``n - m``; the attention itself is
:func:`torch.nn.functional.scaled_dot_product_attention`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.context import ContextShard
from ..functional import apply_rotary
from ..validation import check_hidden_states, positive_int, resolve_head_dim
from .kv_cache import KVCache
from .protocol import RotaryModule, check_rotary_module
from .rotary import RotaryEmbedding

# ``enable_gqa`` appeared in torch 2.5; older versions get k/v repeated per query head.
SDPA_HAS_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


def build_rope(
    head_dim: int,
    rope: RotaryModule | None,
    *,
    rotary_dim: int | None,
    base: float,
    layout: str,
    scaling: Any,
) -> RotaryModule:
    """The module's rotary module: ``rope`` itself (any :class:`~ropekit.nn.RotaryModule`, checked) or a new one.

    The new one is a :class:`RotaryEmbedding` of ``rotary_dim``, ``base``, ``layout`` and ``scaling``.
    """
    if rope is None:
        return RotaryEmbedding(head_dim, base=base, rotary_dim=rotary_dim, layout=layout, scaling=scaling)
    check_rotary_module(rope)
    if rope.head_dim != head_dim:
        raise ValueError(f"rope was built for head_dim={rope.head_dim} but this module has head_dim={head_dim}")
    if rotary_dim is not None or base != 10000.0 or layout != "half" or scaling is not None:
        raise ValueError(
            "pass either rope or rotary_dim/base/layout/scaling, not both: a given rope already fixes them"
        )
    return rope


def attention_bias_mask(
    batch: int,
    q_len: int,
    k_len: int,
    *,
    causal: bool,
    attention_mask: torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor | None, bool]:
    """Boolean SDPA mask (``True`` = attend) and the ``is_causal`` flag for one call.

    Causal masking is *bottom-right aligned*: the ``q_len`` queries are the last
    ``q_len`` of the ``k_len`` keys, so query ``i`` sees keys ``0 .. k_len - q_len + i``.
    SDPA's ``is_causal`` is top-left aligned, so it is used only when
    ``q_len == k_len`` and there is no padding mask.

    Returns:
        ``(mask, is_causal)`` with ``mask`` ``None`` or of shape ``(batch or 1, 1, q_len, k_len)``.
    """
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
            raise TypeError(
                "attention_mask must be a bool tensor (True = attend), got "
                f"{getattr(attention_mask, 'dtype', type(attention_mask).__name__)}"
            )
        if attention_mask.shape != (batch, k_len):
            raise ValueError(
                f"attention_mask must have shape (batch, key_len) = ({batch}, {k_len}) (key_len counts cached "
                f"tokens too), got {tuple(attention_mask.shape)}"
            )
        if attention_mask.device != device:
            raise ValueError(f"attention_mask is on {attention_mask.device} but x is on {device}")
    if attention_mask is None:
        if not causal or q_len == 1:
            return None, False
        if q_len == k_len:
            return None, True
    mask = torch.ones(1, 1, q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        mask = mask.tril(diagonal=k_len - q_len)
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, :]
    return mask, False


class HeadedAttention(nn.Module):
    """The parts ropekit's self-attention modules share.

    The head geometry (checked), the four projections, ``repr`` and the split into heads;
    subclasses add the positions (RoPE, ALiBi).
    """

    def _init_geometry(self, embed_dim: int, num_heads: int, num_kv_heads: int | None, head_dim: int | None,
                       causal: bool, bias: bool, dropout: float) -> None:
        """Check and keep the geometry and options (``bias`` is checked here, used by :meth:`_init_projections`)."""
        self.embed_dim = positive_int(embed_dim, "embed_dim")
        self.num_heads = positive_int(num_heads, "num_heads")
        self.num_kv_heads = num_heads if num_kv_heads is None else positive_int(num_kv_heads, "num_kv_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        self.head_dim = resolve_head_dim(self.embed_dim, self.num_heads, head_dim)
        for name, flag in (("causal", causal), ("bias", bias)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
        self.causal = causal
        self.dropout = float(dropout)

    def _init_projections(self, bias: bool) -> None:
        """``q_proj``, ``k_proj``, ``v_proj`` (``embed_dim -> heads * head_dim``) and ``o_proj`` back."""
        q_width = self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(self.embed_dim, q_width, bias=bias)
        self.k_proj = nn.Linear(self.embed_dim, kv_width, bias=bias)
        self.v_proj = nn.Linear(self.embed_dim, kv_width, bias=bias)
        self.o_proj = nn.Linear(q_width, self.embed_dim, bias=bias)

    def extra_repr(self) -> str:
        """The constructor arguments shown by ``repr(module)``."""
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, causal={self.causal}, dropout={self.dropout}"
        )

    def _split_heads(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        """``(batch, seq, heads*d)`` -> ``(batch, heads, seq, d)``."""
        return t.unflatten(-1, (heads, self.head_dim)).transpose(1, 2)


class RotarySelfAttention(HeadedAttention):
    r"""Multi-head self-attention with rotary position embedding and grouped-query heads.

    .. math::
        \mathrm{out} = W_O\,\mathrm{concat}_h\,\mathrm{softmax}\!\Big(\frac{(R_m W_Q^h x_m)^\top
        (R_n W_K^{g(h)} x_n)}{\sqrt{d}}\Big) W_V^{g(h)} x_n

    where ``g(h) = h // (num_heads // num_kv_heads)`` is the key/value head of query head ``h``.

    Args:
        embed_dim: model width ``E`` (input and output channels).
        num_heads: query heads ``H``.
        num_kv_heads: key/value heads; must divide ``num_heads``. Default ``num_heads``
            (multi-head attention); ``1`` is multi-query attention.
        head_dim: channels per head ``d`` (even); default ``embed_dim // num_heads``.
        rotary_dim: rotated channels per head (even, ``<= head_dim``); default ``head_dim``.
        base: RoPE base (``rope_theta``), default 10000.
        layout: ``"half"`` (HF / GPT-NeoX, default) or ``"interleaved"`` (RoFormer / Meta).
        scaling: ``None`` or a rule from :mod:`ropekit.scaling`.
        causal: mask future tokens (decoder); ``False`` for an encoder.
        bias: add biases to the four projections.
        dropout: attention-probability dropout, applied in training mode only.
        rope: any rotary module (:class:`ropekit.nn.RotaryModule`: ``RotaryEmbedding``,
            ``XPosEmbedding``, ``MultiAxisRotaryEmbedding``, ``MixedRotaryEmbedding`` or one's
            own), e.g. shared between layers; then ``rotary_dim``/``base``/``layout``/``scaling``
            must be left at their defaults. It is called ``rope(q, k, positions, offset=...,
            tensor_format="bhsd")`` and its ``(q', k')`` attended to as they are.

    Attributes:
        q_proj, k_proj, v_proj, o_proj: :class:`torch.nn.Linear` projections named as in
            Hugging Face models: ``q_proj`` is ``E -> H*d``, ``k_proj``/``v_proj`` are
            ``E -> num_kv_heads*d``, ``o_proj`` is ``H*d -> E``. Output rows are head-major.
        rope: the rotary module applied to queries and keys.

    Shapes:
        ``x``: ``(batch, seq, E)``; output ``(batch, seq, E)`` in ``x``'s dtype.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        rotary_dim: int | None = None,
        base: float = 10000.0,
        layout: str = "half",
        scaling: Any = None,
        causal: bool = True,
        bias: bool = False,
        dropout: float = 0.0,
        rope: RotaryModule | None = None,
    ) -> None:
        super().__init__()
        self._init_geometry(embed_dim, num_heads, num_kv_heads, head_dim, causal, bias, dropout)
        self.rope = build_rope(self.head_dim, rope, rotary_dim=rotary_dim, base=base, layout=layout, scaling=scaling)
        self._init_projections(bias)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool):
        dropout_p = self.dropout if self.training else 0.0
        if self.num_kv_heads == self.num_heads:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
        if SDPA_HAS_GQA:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=True
            )
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
        context: ContextShard | None = None,
    ) -> torch.Tensor:
        """Attend over ``x`` (and the cached tokens).

        Args:
            x: float tensor ``(batch, seq, embed_dim)``.
            positions: integer token positions, ``(seq,)`` or ``(batch, seq)`` (padded batches:
                each row its own positions). Default ``cache.length + arange(seq)``
                (``arange(seq)`` without a cache). With a multi-axis ``rope``, position vectors
                ``(seq, n_axes)`` or ``(batch, seq, n_axes)`` (required: they have no default).
            cache: a :class:`KVCache`; the new rotated keys and values are appended to it
                and the queries attend over all of them. Causal masking then lets the
                ``seq`` new tokens see every cached token (bottom-right alignment).
            attention_mask: optional bool ``(batch, key_len)`` key-padding mask, ``True`` =
                attend, with ``key_len = cache.length + seq`` (``seq`` without a cache);
                combined with the causal mask. Query rows that can see no key at all
                (e.g. left padding) give zeros before ``o_proj``.
            context: a :class:`ropekit.distributed.ContextShard` when ``x`` holds this rank's
                shard of the sequence (context parallelism): the queries and keys are rotated by the
                shard's global positions with the global length for dynamic rules, the keys and
                values of every rank are all-gathered, and each query attends to the keys its
                global position (and, packed, its own sequence) allows. Not with ``positions``,
                ``cache`` or ``attention_mask``; a collective: every rank of the group calls it.

        Returns:
            Tensor ``(batch, seq, embed_dim)`` with ``x``'s dtype.
        """
        if context is not None:
            return self._forward_shard(x, context, positions=positions, cache=cache, attention_mask=attention_mask)
        batch, seq = check_hidden_states(x, self.embed_dim)
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a ropekit.nn.KVCache or None, got {type(cache).__name__}")
        past = 0 if cache is None else cache.length
        if cache is not None and cache.k is not None and cache.k.shape[:2] != (batch, self.num_kv_heads):
            raise ValueError(
                f"cache holds (batch, kv_heads) = {tuple(cache.k.shape[:2])} but x has batch {batch} and this "
                f"module has num_kv_heads={self.num_kv_heads}"
            )
        q = self._split_heads(self.q_proj(x), self.num_heads)
        k = self._split_heads(self.k_proj(x), self.num_kv_heads)
        v = self._split_heads(self.v_proj(x), self.num_kv_heads)
        # Plain RoPE (RotaryEmbedding's own forward, keys rotated like queries) may rotate the keys straight
        # into their cache slots; any other module's (q', k') is taken as it comes.
        plain_rope = isinstance(self.rope, RotaryEmbedding) and type(self.rope).forward is RotaryEmbedding.forward
        into_cache = cache is not None and cache.max_length is not None and plain_rope and not (
            torch.is_grad_enabled() and (k.requires_grad or v.requires_grad))
        if into_cache:  # q rotated here, k rotated into its cache slots (tables computed once for both)
            cos, sin = self.rope._broadcast_tables(q, positions, 0 if positions is not None else past, -2, None)
            q = apply_rotary(q, cos, sin, layout=self.rope.layout, backend=self.rope.backend)
        elif positions is None:
            q, k = self.rope(q, k, offset=past, tensor_format="bhsd")
        else:
            q, k = self.rope(q, k, positions, tensor_format="bhsd")
        # Build (and so validate) the mask before touching the cache: a bad call leaves it as it was.
        mask, is_causal = attention_bias_mask(
            batch, seq, past + seq, causal=self.causal, attention_mask=attention_mask, device=x.device
        )
        if into_cache:
            k, v = cache.update_rotating(k, v, cos, sin, layout=self.rope.layout, backend=self.rope.backend)
        elif cache is not None:
            k, v = cache.update(k, v)
        no_key = None
        if mask is not None and attention_mask is not None:
            # A row with every key masked would give NaN (0/0) in some SDPA kernels and NaN
            # gradients: let it attend everywhere, then zero its output.
            no_key = ~mask.any(dim=-1, keepdim=True)
            mask = mask | no_key
        out = self._attend(q, k, v, mask, is_causal)
        if no_key is not None:
            out = out.masked_fill(no_key, 0.0)
        return self.o_proj(out.transpose(1, 2).flatten(2))

    def _forward_shard(
        self, x: torch.Tensor, context: ContextShard, *, positions: Any, cache: Any, attention_mask: Any
    ) -> torch.Tensor:
        """Context parallelism: x is ``(batch, n, E)``, this rank's tokens; keys and values all-gathered."""
        if not isinstance(context, ContextShard):
            raise TypeError(f"context must be a ropekit.distributed.ContextShard or None, got {type(context).__name__}")
        for name, value in (("positions", positions), ("cache", cache), ("attention_mask", attention_mask)):
            if value is not None:
                raise ValueError(f"{name} cannot be combined with context: the context gives the positions and mask")
        _, seq = check_hidden_states(x, self.embed_dim)
        if seq != context.token_index.numel():
            raise ValueError(
                f"x must hold the {context.token_index.numel()} tokens this rank holds ({context!r}), got {seq}"
            )
        q = self._split_heads(self.q_proj(x), self.num_heads)
        k = self._split_heads(self.k_proj(x), self.num_kv_heads)
        v = self._split_heads(self.v_proj(x), self.num_kv_heads)
        if not isinstance(self.rope, RotaryEmbedding):
            raise TypeError(f"context: context parallelism rotates by the shard's integer positions and the global "
                            f"length, which needs a ropekit.RotaryEmbedding rope, got {type(self.rope).__name__}")
        q, k = self.rope(q, k, context.positions.to(x.device), tensor_format="bhsd", seq_len=context.rope_seq_len)
        k, v = context.gather(k, seq_dim=2), context.gather(v, seq_dim=2)
        mask = context.attention_mask(causal=self.causal, device=x.device)
        out = self._attend(q, k, v, None if mask is None else mask[None, None], False)
        return self.o_proj(out.transpose(1, 2).flatten(2))
