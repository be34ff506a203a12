r"""ALiBi: attention with linear biases instead of position embeddings (Press et al. 2022, "Train Short, Test Long").

No position enters the queries or keys; each head ``h`` adds a fixed penalty proportional to
the distance to its (scaled) attention logits:

.. math::
    \mathrm{softmax}\Big(\frac{q_i^\top k_j}{\sqrt{d}} - m_h\,|i - j|\Big), \qquad
    m_h = 2^{-8(h+1)/H} \quad (H \text{ a power of two})

For a head count that is not a power of two, the slopes are those of the nearest lower power
of two ``c`` followed by every other slope of the ``2c`` series (the paper's code,
``get_slopes``): 12 heads give ``2^-1 .. 2^-8`` and then ``2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5``.
Under the causal mask ``-m_h |i - j|`` is the paper's ``-m_h (i - j)``; without it the bias is
symmetric (as in bidirectional uses of ALiBi).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..validation import check_hidden_states, check_positions, positive_int
from .attention import SDPA_HAS_GQA, HeadedAttention, attention_bias_mask
from .kv_cache import KVCache


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The slopes ``m_h`` of Press et al. for ``num_heads`` heads: float64 ``(num_heads,)``, decreasing by rounds."""
    num_heads = positive_int(num_heads, "num_heads")

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    lower = 1 << (num_heads.bit_length() - 1)  # the largest power of two <= num_heads
    slopes = power_of_two(lower)
    if lower < num_heads:
        slopes += power_of_two(2 * lower)[0::2][: num_heads - lower]
    return torch.tensor(slopes, dtype=torch.float64)


def alibi_bias(slopes: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """``-m_h |i - j|`` for every head, query position ``i`` and key position ``j``.

    Args:
        slopes: ``(H,)``.
        query_positions: integer ``(Q,)`` or ``(batch, Q)``.
        key_positions: integer ``(K,)`` or ``(batch, K)``.

    Returns:
        float64 ``(H, Q, K)``, or ``(batch, H, Q, K)`` when either positions are batched.
    """
    distance = (query_positions.to(torch.float64)[..., :, None] - key_positions.to(torch.float64)[..., None, :]).abs()
    return -slopes.to(torch.float64).reshape(-1, 1, 1) * distance.unsqueeze(-3)


class ALiBiSelfAttention(HeadedAttention):
    r"""Multi-head self-attention with ALiBi biases (no rotary or absolute position embedding).

    .. math::
        \mathrm{out} = W_O\,\mathrm{concat}_h\,\mathrm{softmax}\!\Big(\frac{(W_Q^h x_i)^\top
        (W_K^{g(h)} x_j)}{\sqrt{d}} - m_h |i - j|\Big) W_V^{g(h)} x_j

    Args:
        embed_dim: model width ``E``.
        num_heads: query heads ``H`` (each has its own slope, :func:`alibi_slopes`).
        num_kv_heads: key/value heads (divides ``num_heads``); default ``num_heads``.
        head_dim: channels per head; default ``embed_dim // num_heads``.
        causal: mask future tokens (the paper's setting); ``False`` gives the symmetric bias.
        bias: add biases to the four projections.
        dropout: attention-probability dropout in training mode.

    Attributes:
        q_proj, k_proj, v_proj, o_proj: projections as in :class:`~ropekit.nn.RotarySelfAttention`.
        slopes: float64 ``(num_heads,)``, not a parameter.

    Shapes: ``x`` ``(batch, seq, E)`` -> ``(batch, seq, E)``. The bias is added to the scaled
    logits by SDPA as a float mask in the inputs' dtype, ``(H, seq, key_len)`` per call.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        causal: bool = True,
        bias: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self._init_geometry(embed_dim, num_heads, num_kv_heads, head_dim, causal, bias, dropout)
        self.slopes = alibi_slopes(self.num_heads)
        self._init_projections(bias)

    def _positions(self, batch: int, seq: int, positions: torch.Tensor | None, past: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(query positions, key positions)``: ``(seq,)`` / ``(past + seq,)`` or batched ``(batch, seq)``."""
        if positions is None:
            return torch.arange(past, past + seq, device=device), torch.arange(past + seq, device=device)
        if past:
            raise ValueError("positions: with a non-empty cache the cached keys' positions are not known; "
                             "leave positions=None (the new tokens continue at cache.length)")
        check_positions(positions)
        if positions.dim() not in (1, 2) or positions.shape[-1] != seq or (
                positions.dim() == 2 and positions.shape[0] not in (1, batch)):
            raise ValueError(f"positions must have shape (seq,) or (batch, seq) = ({batch}, {seq}), "
                             f"got {tuple(positions.shape)}")
        positions = positions.to(device)
        return positions, positions

    def score_bias(self, batch: int, seq: int, past: int, positions: torch.Tensor | None,
                   attention_mask: torch.Tensor | None, dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(float SDPA mask, rows without keys)`` for one call.

        The mask is ``(batch or 1, H, seq, past + seq)``: the bias, ``-inf`` where masked; the
        second is a bool ``(batch, 1, seq, 1)`` of query rows that see no key at all, or ``None``.
        """
        allowed, is_causal = attention_bias_mask(batch, seq, past + seq, causal=self.causal,
                                                 attention_mask=attention_mask, device=device)
        if allowed is None and is_causal:
            allowed = torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device).tril()
        query_positions, key_positions = self._positions(batch, seq, positions, past, device)
        bias = alibi_bias(self.slopes.to(device), query_positions, key_positions)
        bias = bias if bias.dim() == 4 else bias.unsqueeze(0)
        no_key = None
        if allowed is not None:
            if attention_mask is not None:  # a row with no key at all: attend anywhere, zero it afterwards
                no_key = ~allowed.any(dim=-1, keepdim=True)
                allowed = allowed | no_key
            bias = bias.masked_fill(~allowed, -math.inf)
        return bias.to(dtype), no_key

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, *, cache: KVCache | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attend over ``x`` (and the cached tokens) with ALiBi biases.

        Args:
            x: float ``(batch, seq, embed_dim)``.
            positions: integer ``(seq,)`` or ``(batch, seq)`` positions of the tokens, used for
                ``|i - j|``; default ``cache.length + arange(seq)``. Not allowed with a non-empty cache.
            cache: a :class:`~ropekit.nn.KVCache` (keys and values as projected: nothing positional is stored).
            attention_mask: optional bool ``(batch, key_len)`` key-padding mask, ``True`` = attend.

        Returns:
            ``(batch, seq, embed_dim)`` in ``x``'s dtype.
        """
        batch, seq = check_hidden_states(x, self.embed_dim)
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a ropekit.nn.KVCache or None, got {type(cache).__name__}")
        past = 0 if cache is None else cache.length
        if cache is not None and cache.k is not None and cache.k.shape[:2] != (batch, self.num_kv_heads):
            raise ValueError(f"cache holds (batch, kv_heads) = {tuple(cache.k.shape[:2])} but x has batch {batch} "
                             f"and this module has num_kv_heads={self.num_kv_heads}")
        mask, no_key = self.score_bias(batch, seq, past, positions, attention_mask, x.dtype, x.device)
        q = self._split_heads(self.q_proj(x), self.num_heads)
        k = self._split_heads(self.k_proj(x), self.num_kv_heads)
        v = self._split_heads(self.v_proj(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.update(k, v)
        dropout_p = self.dropout if self.training else 0.0
        if self.num_kv_heads != self.num_heads and not SDPA_HAS_GQA:
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        gqa = {"enable_gqa": True} if self.num_kv_heads != self.num_heads and SDPA_HAS_GQA else {}
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, **gqa)
        if no_key is not None:
            out = out.masked_fill(no_key, 0.0)
        return self.o_proj(out.transpose(1, 2).flatten(2))
