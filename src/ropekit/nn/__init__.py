"""Modules: rotary embedding, attention with RoPE (softmax and linear), absolute encodings."""

from .absolute import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from .attention import KVCache, RotarySelfAttention
from .linear_attention import RotaryLinearAttention
from .multiaxis import MixedRotaryEmbedding, MultiAxisRotaryEmbedding
from .rotary import RotaryEmbedding

__all__ = [
    "KVCache",
    "LearnedPositionalEmbedding",
    "MixedRotaryEmbedding",
    "MultiAxisRotaryEmbedding",
    "RotaryEmbedding",
    "RotaryLinearAttention",
    "RotarySelfAttention",
    "SinusoidalPositionalEncoding",
]
