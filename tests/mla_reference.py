"""vLLM's pure-torch references for DeepSeek's MLA RoPE and its cache write, ported as small functions (a helper).

Independent oracles for tests/test_mla*.py: each function below is vLLM's code with its class
state turned into arguments and nothing else changed (same float32 arithmetic, same quirks).
Sources, in the repository vllm-project/vllm:

- ``vllm/model_executor/layers/rotary_embedding/common.py``: ``rotate_neox``, ``rotate_gptj``,
  ``yarn_find_correction_dim``, ``yarn_find_correction_range``, ``yarn_linear_ramp_mask``;
- ``vllm/model_executor/layers/rotary_embedding/deepseek_scaling_rope.py``: ``yarn_get_mscale``,
  ``DeepseekScalingRotaryEmbedding.__init__`` (its ``mscale``), ``_compute_inv_freq``,
  ``_compute_cos_sin_cache`` and ``forward_native``;
- ``vllm/model_executor/models/deepseek_v2.py`` (``DeepseekV2Attention.__init__``): the softmax
  scale with ``mscale_all_dim``;
- ``tests/kernels/attention/test_cache.py`` (``test_concat_and_cache_mla``): the reference loop
  that writes ``[kv_c | k_pe]`` into a paged MLA cache.
"""

from __future__ import annotations

import math

import torch


# -- vllm/model_executor/layers/rotary_embedding/common.py ---------------------------------------
def rotate_neox(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_gptj(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def yarn_find_correction_dim(num_rotations, dim, base=10000, max_position_embeddings=2048) -> float:
    return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_find_correction_range(low_rot, high_rot, dim, base=10000, max_position_embeddings=2048) -> tuple[int, int]:
    low = math.floor(yarn_find_correction_dim(low_rot, dim, base, max_position_embeddings))
    high = math.ceil(yarn_find_correction_dim(high_rot, dim, base, max_position_embeddings))
    return max(low, 0), min(high, dim - 1)  # Clamp values just in case


def yarn_linear_ramp_mask(low: float, high: float, dim: int, dtype: torch.dtype) -> torch.Tensor:
    if low == high:
        high += 0.001  # Prevent singularity
    linear_func = (torch.arange(dim, dtype=dtype) - low) / (high - low)
    return torch.clamp(linear_func, 0, 1)


# -- vllm/model_executor/layers/rotary_embedding/deepseek_scaling_rope.py -----------------------
def yarn_get_mscale(scale: float = 1, mscale: float = 1) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def deepseek_mscale(scaling_factor, *, attn_factor=1, mscale=1, mscale_all_dim=0) -> float:
    """``DeepseekScalingRotaryEmbedding.__init__``'s ``self.mscale`` (the cos/sin factor)."""
    return float(yarn_get_mscale(scaling_factor, float(mscale)) / yarn_get_mscale(scaling_factor, float(mscale_all_dim))
                 * attn_factor)


def deepseek_inv_freq(rotary_dim, base, max_position_embeddings, scaling_factor, *, extrapolation_factor=1,
                      beta_fast=32, beta_slow=1) -> torch.Tensor:
    """``DeepseekScalingRotaryEmbedding._compute_inv_freq`` (on the CPU)."""
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (scaling_factor * pos_freqs)
    low, high = yarn_find_correction_range(beta_fast, beta_slow, rotary_dim, base, max_position_embeddings)
    # Get n-d rotational scaling corrected for extrapolation
    inv_freq_mask = (1 - yarn_linear_ramp_mask(low, high, rotary_dim // 2, dtype=torch.float)) * extrapolation_factor
    return inv_freq_interpolation * (1 - inv_freq_mask) + inv_freq_extrapolation * inv_freq_mask


def deepseek_cos_sin_cache(rotary_dim, base, max_position_embeddings, scaling_factor, **kwargs) -> torch.Tensor:
    """``DeepseekScalingRotaryEmbedding._compute_cos_sin_cache``: ``(max_position_embeddings * factor, rotary_dim)``.

    ``kwargs``: ``extrapolation_factor``, ``beta_fast``, ``beta_slow`` (the frequencies) and
    ``attn_factor``, ``mscale``, ``mscale_all_dim`` (the factor).
    """
    freq_keys = {"extrapolation_factor", "beta_fast", "beta_slow"}
    inv_freq = deepseek_inv_freq(rotary_dim, base, max_position_embeddings, scaling_factor,
                                 **{k: v for k, v in kwargs.items() if k in freq_keys})
    mscale = deepseek_mscale(scaling_factor, **{k: v for k, v in kwargs.items() if k not in freq_keys})
    t = torch.arange(max_position_embeddings * scaling_factor, dtype=torch.float32)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    cos = freqs.cos() * mscale
    sin = freqs.sin() * mscale
    return torch.cat((cos, sin), dim=-1)


def deepseek_forward_native(positions, query, key, cos_sin_cache, rotary_dim, head_size, is_neox_style,
                            offsets=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``DeepseekScalingRotaryEmbedding.forward_native`` (the cache already in the query's dtype)."""
    query_rot = query[..., :rotary_dim]
    key_rot = key[..., :rotary_dim]
    if rotary_dim < head_size:
        query_pass = query[..., rotary_dim:]
        key_pass = key[..., rotary_dim:]

    cos_sin = cos_sin_cache[torch.add(positions, offsets) if offsets is not None else positions]
    cos, sin = cos_sin.chunk(2, dim=-1)
    if is_neox_style:
        # NOTE(woosuk): Here we assume that the positions tensor has the
        # shape [batch_size, seq_len].
        cos = cos.repeat(1, 1, 2).unsqueeze(-2)
        sin = sin.repeat(1, 1, 2).unsqueeze(-2)
    else:
        cos = cos.repeat_interleave(2, dim=-1).unsqueeze(-2)
        sin = sin.repeat_interleave(2, dim=-1).unsqueeze(-2)

    rotate_fn = rotate_neox if is_neox_style else rotate_gptj
    query_rot = query_rot * cos + rotate_fn(query_rot) * sin
    key_rot = key_rot * cos + rotate_fn(key_rot) * sin

    if rotary_dim < head_size:
        query = torch.cat((query_rot, query_pass), dim=-1)
        key = torch.cat((key_rot, key_pass), dim=-1)
    else:
        query = query_rot
        key = key_rot
    return query, key


# -- vllm/model_executor/models/deepseek_v2.py ---------------------------------------------------
def deepseek_softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
    """``DeepseekV2Attention.__init__``'s ``self.scaling`` (``rope_scaling`` None: rope_type ``"default"``)."""
    scaling = qk_head_dim**-0.5
    if rope_scaling:  # vLLM: rope_type != "default", which it renames "deepseek_yarn"
        mscale_all_dim = rope_scaling.get("mscale_all_dim", False)
        scaling_factor = rope_scaling["factor"]
        mscale = yarn_get_mscale(scaling_factor, float(mscale_all_dim))
        scaling = scaling * mscale * mscale
    return scaling


# -- tests/kernels/attention/test_cache.py (test_concat_and_cache_mla) ---------------------------
def concat_and_cache_mla_reference(kv_c, k_pe, ref_temp, slot_mapping, block_size, kv_lora_rank) -> None:
    """The reference loop: token ``i`` into ``ref_temp[block, offset] = [kv_c[i] | k_pe[i]]``.

    vLLM's test samples distinct non-negative slots; the kernel skips negative ones (padding),
    which the loop here does too (the one line added).
    """
    num_tokens = kv_c.shape[0]
    for i in range(num_tokens):
        slot = slot_mapping[i].item()
        if slot < 0:
            continue
        block_idx = slot // block_size
        block_offset = slot % block_size
        ref_temp[block_idx, block_offset, :kv_lora_rank] = kv_c[i]
        ref_temp[block_idx, block_offset, kv_lora_rank:] = k_pe[i]
