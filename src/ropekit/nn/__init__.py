"""Modules: rotary embedding (1-D, multi-axis, xPos), attention with RoPE or ALiBi, absolute encodings."""

from .absolute import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from .alibi import ALiBiSelfAttention, alibi_bias, alibi_slopes
from .attention import RotarySelfAttention
from .kv_cache import KVCache
from .linear_attention import RotaryLinearAttention, causal_linear_attention
from .multiaxis import MixedRotaryEmbedding, MultiAxisRotaryEmbedding
from .protocol import RotaryModule, check_rotary_module
from .rotary import RotaryEmbedding
from .xpos import XPosEmbedding, xpos_zeta

__all__ = [
    "ALiBiSelfAttention",
    "KVCache",
    "LearnedPositionalEmbedding",
    "MixedRotaryEmbedding",
    "MultiAxisRotaryEmbedding",
    "RotaryEmbedding",
    "RotaryLinearAttention",
    "RotaryModule",
    "RotarySelfAttention",
    "SinusoidalPositionalEncoding",
    "XPosEmbedding",
    "alibi_bias",
    "alibi_slopes",
    "causal_linear_attention",
    "check_rotary_module",
    "xpos_zeta",
]
