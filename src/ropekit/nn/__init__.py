"""Modules: rotary embedding, attention with RoPE (softmax and linear), absolute encodings."""

from .rotary import RotaryEmbedding

__all__ = ["RotaryEmbedding"]
