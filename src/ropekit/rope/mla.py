"""DeepSeek's multi-head latent attention (MLA): the maths of its decoupled RoPE.

MLA (DeepSeek-V2, arXiv:2405.04434, section 2.1.3) rotates only a slice of each query head and
one key head shared by all heads:

    q_head = [q_nope (qk_nope_head_dim) | q_pe (qk_rope_head_dim)]     per head, q_pe rotated
    k_head = [k_nope (qk_nope_head_dim) | k_pe (qk_rope_head_dim)]     k_nope per head (from the
                                                                       compressed kv), k_pe one
                                                                       rotated head for all heads

With YaRN, DeepSeek scales twice (its reference ``modeling_deepseek.py``, vLLM's
``DeepseekScalingRotaryEmbedding`` and transformers' ``DeepseekV3Attention`` agree on the second):

    cos, sin  *  mscale(s, mscale) / mscale(s, mscale_all_dim)          :func:`attention_factor`
    softmax scale  mscale(s, mscale_all_dim)**2 / sqrt(qk_head_dim)     :func:`softmax_scale`

with ``mscale(s, m) = 0.1 * m * ln(s) + 1`` for ``s > 1`` (else 1). Released configs set
``mscale == mscale_all_dim`` (V2: 0.707, V3 and Kimi K2: 1.0), so the tables are unscaled and the
whole factor ``mscale(s, mscale_all_dim)**2`` sits in the softmax scale. transformers' YaRN
(ropekit's :class:`~ropekit.scaling.YaRN` follows it) differs from DeepSeek's tables only when
one of the two keys is missing: it then uses ``mscale(s, 1)``.

DeepSeek's checkpoints store each rope slice in interleaved pairs ``(2i, 2i+1)``;
:func:`permute_mla_weight` moves the rows of the projections once, so that the half pairing
(transformers' de-interleaved order) comes out of them.
"""

from __future__ import annotations

import math

import torch

from ..validation import check_layout
from .layouts import channel_permutation, check_projection
from .scaling import YaRN, yarn_mscale


def _yarn_or_none(scaling: object) -> YaRN | None:
    if scaling is not None and not isinstance(scaling, YaRN):
        raise TypeError(f"scaling must be None or a ropekit.scaling.YaRN (DeepSeek's MLA scales its RoPE with YaRN "
                        f"or not at all), got {type(scaling).__name__}")
    return scaling


def attention_factor(scaling: YaRN | None) -> float:
    """The factor DeepSeek multiplies its cos/sin tables by: ``mscale(s, mscale) / mscale(s, mscale_all_dim)``.

    As DeepSeek's reference code and vLLM's ``DeepseekScalingRotaryEmbedding`` compute it: a
    missing ``mscale`` is 1, a missing ``mscale_all_dim`` is 0 (``mscale(s, 0) = 1``). An
    explicit ``attention_factor`` of the rule is returned as it is (transformers' meaning of the
    key). ``scaling=None``: 1.0.

    transformers' (and :meth:`ropekit.scaling.YaRN.attention_scale`'s) value differs only when
    exactly one of ``mscale`` / ``mscale_all_dim`` is set: it then ignores both and uses
    ``mscale(s, 1)``.

    Raises:
        TypeError: ``scaling`` neither None nor a YaRN rule.
        ValueError: the factor is not a finite number > 0 (``mscale_all_dim`` so negative that
            ``mscale(s, mscale_all_dim) <= 0``).
    """
    rule = _yarn_or_none(scaling)
    if rule is None:
        return 1.0
    if rule.attention_factor is not None:
        return rule.attention_factor
    numerator = yarn_mscale(rule.factor, 1.0 if rule.mscale is None else rule.mscale)
    denominator = yarn_mscale(rule.factor, 0.0 if rule.mscale_all_dim is None else rule.mscale_all_dim)
    factor = numerator / denominator if denominator > 0 else math.inf
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"scaling: mscale={rule.mscale!r} and mscale_all_dim={rule.mscale_all_dim!r} give DeepSeek's "
                         f"attention factor {factor!r} at factor={rule.factor!r}; it must be a finite number > 0")
    return factor


def softmax_scale(qk_head_dim: int, scaling: YaRN | None = None) -> float:
    """DeepSeek's softmax scale: ``qk_head_dim ** -0.5``, times ``mscale(s, mscale_all_dim) ** 2`` under YaRN.

    The multiplier applies when the rule's ``mscale_all_dim`` is set and non-zero (transformers'
    ``yarn_apply_mscale``, vLLM's ``DeepseekV2Attention``, DeepSeek's ``softmax_scale``).

    Args:
        qk_head_dim: channels of one query/key head, ``qk_nope_head_dim + qk_rope_head_dim`` (192
            for DeepSeek-V2/V3).
        scaling: the model's YaRN rule (``RopeConfig.from_hf(config).scaling``), or None.

    Raises:
        TypeError: ``qk_head_dim`` not an int, or ``scaling`` neither None nor a YaRN rule.
        ValueError: ``qk_head_dim`` not positive.
    """
    if isinstance(qk_head_dim, bool) or not isinstance(qk_head_dim, int):
        raise TypeError(f"qk_head_dim must be an int, got {type(qk_head_dim).__name__} {qk_head_dim!r}")
    if qk_head_dim <= 0:
        raise ValueError(f"qk_head_dim must be positive, got {qk_head_dim}")
    rule = _yarn_or_none(scaling)
    scale = qk_head_dim ** -0.5
    if rule is not None and rule.mscale_all_dim:
        mscale = yarn_mscale(rule.factor, rule.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


def mla_channel_permutation(nope_dim: int, rotary_dim: int, src: str, dst: str) -> torch.Tensor:
    """Index ``perm`` of one MLA head ``[nope | rope]`` such that ``x_dst = x_src[..., perm]``.

    The first ``nope_dim`` channels stay put; the last ``rotary_dim`` move from the ``src``
    pairing to the ``dst`` one (:func:`ropekit.channel_permutation`). int64 ``(nope_dim + rotary_dim,)``.
    """
    if isinstance(nope_dim, bool) or not isinstance(nope_dim, int) or nope_dim < 0:
        raise ValueError(f"nope_dim must be an int >= 0, got {nope_dim!r}")
    rope = channel_permutation(rotary_dim, src, dst)
    return torch.cat((torch.arange(nope_dim), nope_dim + rope))


def permute_mla_weight(w: torch.Tensor, n_heads: int, *, nope_dim: int, rotary_dim: int, src: str,
                       dst: str) -> torch.Tensor:
    """Permute the rope rows of an MLA projection between the interleaved and half pairings, once.

    DeepSeek's checkpoints hold each rope slice in interleaved pairs; transformers'
    ``apply_rotary_pos_emb_interleave`` de-interleaves q_pe and k_pe at every call. Permuting the
    rows once (``src="interleaved", dst="half"``) gives a model whose q_pe and k_pe come out
    de-interleaved, so the half pairing rotates them (``layout="half"``), with outputs equal to
    transformers' bit for bit.

    Args:
        w: weight ``(n_heads * (nope_dim + rotary_dim), in_features)`` or bias ``(n_heads * (nope_dim
            + rotary_dim),)``: rows head-major, each head ``[nope | rope]``. The query projection
            (``q_proj`` / ``q_b_proj``): ``n_heads`` heads, ``nope_dim = qk_nope_head_dim``; the
            compressed key projection (``kv_a_proj_with_mqa``, rows ``[kv_lora_rank | k_pe]``):
            ``n_heads=1``, ``nope_dim = kv_lora_rank``.
        n_heads: heads whose rows ``w`` holds.
        nope_dim, rotary_dim: channels of each head left as they are, then rotated (``qk_rope_head_dim``).
        src, dst: the pairing of ``w``'s rope rows and the one wanted.

    Returns:
        a new tensor of ``w``'s shape and dtype with the rope rows permuted; the values bit for bit.

    Raises:
        TypeError: ``w`` not a tensor.
        ValueError: ``w`` not 1-D or 2-D, rows that are not ``n_heads * (nope_dim + rotary_dim)``,
            ``rotary_dim`` not positive and even, an unknown layout.
    """
    check_projection(w, n_heads)
    check_layout(src, "src"), check_layout(dst, "dst")
    perm = mla_channel_permutation(nope_dim, rotary_dim, src, dst).to(w.device)
    if w.shape[0] != n_heads * perm.numel():
        raise ValueError(f"w has {w.shape[0]} rows; n_heads * (nope_dim + rotary_dim) = {n_heads} * ({nope_dim} + "
                         f"{rotary_dim}) = {n_heads * perm.numel()}")
    heads = w.reshape(n_heads, perm.numel(), *w.shape[1:])
    return heads.index_select(1, perm).reshape(w.shape).clone()
