"""Modules: rotary embedding (and xPos), attention with RoPE (softmax and linear) or ALiBi, absolute encodings."""

from .absolute import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from .alibi import ALiBiSelfAttention, alibi_bias, alibi_slopes
from .attention import KVCache, RotarySelfAttention
from .linear_attention import RotaryLinearAttention, causal_linear_attention
from .rotary import RotaryEmbedding
from .xpos import XPosEmbedding, xpos_zeta

__all__ = [
    "ALiBiSelfAttention",
    "KVCache",
    "LearnedPositionalEmbedding",
    "RotaryEmbedding",
    "RotaryLinearAttention",
    "RotarySelfAttention",
    "SinusoidalPositionalEncoding",
    "XPosEmbedding",
    "alibi_bias",
    "alibi_slopes",
    "causal_linear_attention",
    "xpos_zeta",
]
