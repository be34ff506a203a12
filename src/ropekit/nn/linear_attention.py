r"""Linear attention with RoPE (RoFormer eq. 19).

Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs") replaces
``exp(q^T k)`` by ``phi(q)^T phi(k)`` with the non-negative feature map
``phi(x) = elu(x) + 1`` (eq. 18), so that ``sum_n phi(k_n) v_n^T`` can be summed once
and the cost is O(N) in the sequence length. RoFormer adds RoPE by rotating the
*features* in the numerator only (eq. 19):

.. math::
    \mathrm{out}_m = \frac{\sum_n \big(R_m \phi(q_m)\big)^\top \big(R_n \phi(k_n)\big)\, v_n}
                          {\sum_n \phi(q_m)^\top \phi(k_n)}

The denominator stays unrotated: ``phi(q)^T phi(k) > 0`` keeps it away from zero,
whereas the rotated inner products may be negative. The weights of the values are
therefore not a probability distribution (the paper accepts this).

The causal form (``n <= m``) runs over the sequence in chunks of ``C`` tokens with a running
state ``S = sum_n (R_n phi(k_n)) v_n^T`` (``d x d`` per head) and ``z = sum_n phi(k_n)``: inside a
chunk the ``C x C`` causal products are formed explicitly, earlier chunks enter through ``S`` and
``z``. This is the same sum, regrouped: extra memory is ``O(C^2 + d^2)`` per head whatever the
length, where prefix sums would keep a ``d x d`` matrix per position.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..validation import check_hidden_states, positive_int, resolve_head_dim
from .attention import build_rope


def feature_map(x: torch.Tensor) -> torch.Tensor:
    """``phi(x) = elu(x) + 1`` (Katharopoulos et al.), elementwise and > 0; same shape and dtype."""
    return F.elu(x) + 1.0


def causal_linear_attention(
    rot_q: torch.Tensor,
    rot_k: torch.Tensor,
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    chunk_size: int = 64,
    eps: float = 1e-6,
) -> torch.Tensor:
    r"""Causal eq. (19) chunk by chunk: ``out_m = sum_{n<=m} (rq_m . rk_n) v_n / max(sum_{n<=m} pq_m . pk_n, eps)``.

    Args:
        rot_q, rot_k: rotated features ``R_m phi(q_m)``, ``R_n phi(k_n)``, ``(batch, heads, seq, d)``.
        phi_q, phi_k: the unrotated features (denominator), same shape.
        v: values ``(batch, heads, seq, e)``.
        chunk_size: tokens per chunk ``C`` (any ``C >= 1`` gives the same sums).
        eps: lower bound of the denominator.

    Returns:
        ``(batch, heads, seq, e)`` in the inputs' dtype.

    Memory: ``O(C^2 + d e)`` per head besides inputs and output; with autograd, one ``d x e``
    state per chunk is kept for the backward pass (``O(seq / C * d e)``), never one per token.
    """
    batch, heads, seq, d = rot_q.shape
    state = rot_k.new_zeros(batch, heads, d, v.shape[-1])  # sum over earlier chunks of R_n phi(k_n) v_n^T
    key_sum = phi_k.new_zeros(batch, heads, d, 1)  # sum over earlier chunks of phi(k_n)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=rot_q.device).tril()
    chunks = []
    for start in range(0, seq, chunk_size):
        end = min(start + chunk_size, seq)
        rq, rk, pq, pk, vc = (t[:, :, start:end] for t in (rot_q, rot_k, phi_q, phi_k, v))
        mask = causal[: end - start, : end - start]
        numerator = rq @ state + (rq @ rk.transpose(-1, -2)).masked_fill(~mask, 0.0) @ vc
        denominator = pq @ key_sum + (pq @ pk.transpose(-1, -2)).masked_fill(~mask, 0.0).sum(-1, keepdim=True)
        chunks.append(numerator / denominator.clamp_min(eps))
        state = state + rk.transpose(-1, -2) @ vc
        key_sum = key_sum + pk.sum(dim=2).unsqueeze(-1)
    return torch.cat(chunks, dim=2) if chunks else v.new_zeros(batch, heads, 0, v.shape[-1])


class RotaryLinearAttention(nn.Module):
    r"""Multi-head linear attention with RoPE in the numerator, exactly as RoFormer eq. (19).

    Args:
        embed_dim: model width ``E`` (input and output channels).
        num_heads: heads ``H`` (queries, keys and values alike).
        head_dim: channels per head ``d`` (even); default ``embed_dim // num_heads``.
        rotary_dim: rotated channels per head (even, ``<= head_dim``); default ``head_dim``.
        base: RoPE base, default 10000.
        layout: ``"half"`` (default) or ``"interleaved"``.
        scaling: ``None`` or a rule from :mod:`ropekit.scaling`.
        causal: position ``m`` sees only ``n <= m`` (computed chunk by chunk, see
            :func:`causal_linear_attention`); default ``False`` (the bidirectional form of the paper).
        chunk_size: tokens per chunk of the causal form (default 64); it changes the
            grouping of the sums, not the result.
        use_rope: ``False`` gives plain linear attention (eq. 18) for comparison.
        eps: lower bound of the denominator (only reached when the features underflow;
            ``phi > 0`` keeps it positive otherwise).

    Attributes:
        q_proj, k_proj, v_proj, o_proj: bias-free :class:`torch.nn.Linear` projections
            (``E -> H*d`` and ``H*d -> E``), named as in Hugging Face models.
        rope: the :class:`ropekit.RotaryEmbedding`, or ``None`` when ``use_rope=False``.

    Cost: O(N d^2) time and O(d^2) extra memory per head non-causal; causal O(N (C + d) d)
    time and O(C^2 + d^2) extra memory per head (``C = chunk_size``), linear in ``N``.
    Arithmetic is float32 for half-precision inputs (float64 for float64).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        head_dim: int | None = None,
        rotary_dim: int | None = None,
        base: float = 10000.0,
        layout: str = "half",
        scaling: Any = None,
        causal: bool = False,
        use_rope: bool = True,
        eps: float = 1e-6,
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        self.embed_dim = positive_int(embed_dim, "embed_dim")
        self.num_heads = positive_int(num_heads, "num_heads")
        self.head_dim = resolve_head_dim(self.embed_dim, self.num_heads, head_dim)
        for name, flag in (("causal", causal), ("use_rope", use_rope)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"eps must be a number > 0, got {eps!r}")
        self.causal = causal
        self.chunk_size = positive_int(chunk_size, "chunk_size")
        self.use_rope = use_rope
        self.eps = float(eps)
        self.rope = (
            build_rope(self.head_dim, None, rotary_dim=rotary_dim, base=base, layout=layout, scaling=scaling)
            if use_rope
            else None
        )
        width = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(self.embed_dim, width, bias=False)
        self.k_proj = nn.Linear(self.embed_dim, width, bias=False)
        self.v_proj = nn.Linear(self.embed_dim, width, bias=False)
        self.o_proj = nn.Linear(width, self.embed_dim, bias=False)

    def extra_repr(self) -> str:
        """The constructor arguments shown by ``repr(module)``."""
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"causal={self.causal}, use_rope={self.use_rope}, chunk_size={self.chunk_size}"
        )

    def _split_heads(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``(batch, seq, H*d)`` -> ``(batch, H, seq, d)`` in ``dtype``."""
        return t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2).to(dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Linear attention over ``x``.

        Args:
            x: float tensor ``(batch, seq, embed_dim)``.
            positions: integer token positions, ``(seq,)`` or ``(batch, seq)``; default
                ``arange(seq)``. Ignored when ``use_rope=False``.

        Returns:
            Tensor ``(batch, seq, embed_dim)`` with ``x``'s dtype.
        """
        check_hidden_states(x, self.embed_dim)
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        phi_q = feature_map(self._split_heads(self.q_proj(x), work))  # (b, H, N, d)
        phi_k = feature_map(self._split_heads(self.k_proj(x), work))
        v = self._split_heads(self.v_proj(x), work)
        if self.rope is not None:
            rot_q, rot_k = self.rope(phi_q, phi_k, positions, tensor_format="bhsd")
        else:
            rot_q, rot_k = phi_q, phi_k
        if self.causal:
            out = causal_linear_attention(rot_q, rot_k, phi_q, phi_k, v, chunk_size=self.chunk_size, eps=self.eps)
        else:
            kv_sum = torch.einsum("bhnd,bhne->bhde", rot_k, v)
            numerator = torch.einsum("bhnd,bhde->bhne", rot_q, kv_sum)
            denominator = torch.einsum("bhnd,bhd->bhn", phi_q, phi_k.sum(dim=2))
            out = numerator / denominator.clamp_min(self.eps).unsqueeze(-1)
        return self.o_proj(out.transpose(1, 2).flatten(2).to(x.dtype))
