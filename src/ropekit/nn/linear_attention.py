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
        causal: position ``m`` sees only ``n <= m`` (prefix sums over the sequence);
            default ``False`` (the bidirectional form of the paper).
        use_rope: ``False`` gives plain linear attention (eq. 18) for comparison.
        eps: lower bound of the denominator (only reached when the features underflow;
            ``phi > 0`` keeps it positive otherwise).

    Attributes:
        q_proj, k_proj, v_proj, o_proj: bias-free :class:`torch.nn.Linear` projections
            (``E -> H*d`` and ``H*d -> E``), named as in Hugging Face models.
        rope: the :class:`ropekit.RotaryEmbedding`, or ``None`` when ``use_rope=False``.

    Cost: non-causal O(N d^2) time and O(d^2) extra memory per head; causal keeps the
    prefix sums of ``R_n phi(k_n) v_n^T``, i.e. O(N d^2) memory per head.
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
            f"causal={self.causal}, use_rope={self.use_rope}"
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
            rot_q, rot_k = self.rope(phi_q, phi_k, positions, seq_dim=-2)
        else:
            rot_q, rot_k = phi_q, phi_k
        if self.causal:
            # S_m = sum_{n<=m} (R_n phi(k_n)) v_n^T and z_m = sum_{n<=m} phi(k_n)
            kv_prefix = torch.einsum("bhnd,bhne->bhnde", rot_k, v).cumsum(dim=2)
            numerator = torch.einsum("bhnd,bhnde->bhne", rot_q, kv_prefix)
            denominator = (phi_q * phi_k.cumsum(dim=2)).sum(dim=-1)
        else:
            kv_sum = torch.einsum("bhnd,bhne->bhde", rot_k, v)
            numerator = torch.einsum("bhnd,bhde->bhne", rot_q, kv_sum)
            denominator = torch.einsum("bhnd,bhd->bhn", phi_q, phi_k.sum(dim=2))
        out = numerator / denominator.clamp_min(self.eps).unsqueeze(-1)
        return self.o_proj(out.transpose(1, 2).flatten(2).to(x.dtype))
