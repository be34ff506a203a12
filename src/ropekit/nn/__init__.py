"""Modules: rotary embedding, attention with RoPE (softmax and linear), absolute encodings."""

from .absolute import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from .attention import RotarySelfAttention
from .kv_cache import KVCache
from .linear_attention import RotaryLinearAttention
from .rotary import RotaryEmbedding

__all__ = [
    "KVCache",
    "LearnedPositionalEmbedding",
    "RotaryEmbedding",
    "RotaryLinearAttention",
    "RotarySelfAttention",
    "SinusoidalPositionalEncoding",
]
