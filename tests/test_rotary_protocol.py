"""One rotary-module protocol: every module honours it, and the attention class takes any of them.

The ViT block (axial RoPE over a 2-D patch grid) and the xPos block run through the same
:class:`ropekit.nn.RotarySelfAttention`, each checked against an independent computation: the
module's projection weights in float64, the float64 rotation matrices of
:func:`ropekit.rotation_matrix` token by token (xPos's factors from the paper's formula), and a
plain softmax attention.
"""

from __future__ import annotations

import math

import pytest
import torch

from ropekit import rotation_matrix
from ropekit.multiaxis import axial, patch_grid
from ropekit.nn import (
    KVCache,
    MixedRotaryEmbedding,
    MultiAxisRotaryEmbedding,
    RotaryEmbedding,
    RotaryModule,
    RotarySelfAttention,
    XPosEmbedding,
    check_rotary_module,
)

HEAD_DIM, HEADS, EMBED = 8, 2, 16


def modules():
    return {
        "rotary": (RotaryEmbedding(HEAD_DIM), torch.arange(6)),
        "xpos": (XPosEmbedding(HEAD_DIM), torch.arange(6)),
        "multiaxis": (MultiAxisRotaryEmbedding(axial((4, 4), 100.0)), patch_grid((2, 3))),
        "mixed": (MixedRotaryEmbedding(HEAD_DIM, HEADS, generator=torch.Generator().manual_seed(0)),
                  patch_grid((2, 3)).float()),
    }


@pytest.mark.parametrize("name", ["rotary", "xpos", "multiaxis", "mixed"])
def test_every_module_honours_the_protocol(name):
    module, positions = modules()[name]
    assert isinstance(module, RotaryModule)
    assert check_rotary_module(module) is module
    torch.manual_seed(0)
    q, k = torch.randn(2, HEADS, 6, HEAD_DIM), torch.randn(2, HEADS, 6, HEAD_DIM)
    # one call, one signature: positional positions, keyword offset and tensor_format
    q_out, k_out = module(q, k, positions, offset=0, tensor_format="bhsd")
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == q.dtype
    same_q, none = module(q, None, positions, tensor_format="bhsd")
    assert none is None
    torch.testing.assert_close(same_q, q_out, atol=1e-6, rtol=1e-6)
    # the same call in flash-attention's order gives the same rotation
    q_bshd, k_bshd = module(q.transpose(1, 2), k.transpose(1, 2), positions, tensor_format="bshd")
    torch.testing.assert_close(q_bshd.transpose(1, 2), q_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_bshd.transpose(1, 2), k_out, atol=1e-6, rtol=1e-6)


def test_vector_position_modules_refuse_an_offset_and_missing_positions():
    q = torch.randn(1, HEADS, 6, HEAD_DIM)
    for name in ("multiaxis", "mixed"):
        module, positions = modules()[name]
        with pytest.raises(ValueError, match="offset"):
            module(q, q, positions, offset=3)
        with pytest.raises(ValueError, match="positions"):
            module(q, q)


def test_attention_refuses_a_module_without_the_protocol_by_saying_what_is_missing():
    class OldStyle(torch.nn.Module):
        head_dim = HEAD_DIM

        def forward(self, q, k, positions=None, *, seq_dim=-2):
            return q, k

    with pytest.raises(TypeError, match=r"does not honour ropekit.nn.RotaryModule: its forward lacks offset, "
                                        r"tensor_format"):
        RotarySelfAttention(EMBED, HEADS, rope=OldStyle())
    with pytest.raises(TypeError, match="int head_dim"):
        RotarySelfAttention(EMBED, HEADS, rope=torch.nn.Identity())

    class OwnRope(torch.nn.Module):  # any class with the call will do
        head_dim = HEAD_DIM

        def forward(self, q, k, positions=None, *, offset=0, tensor_format=None):
            return q, k

    attn = RotarySelfAttention(EMBED, HEADS, rope=OwnRope())
    assert attn(torch.randn(1, 3, EMBED)).shape == (1, 3, EMBED)


# -- the independent computation --------------------------------------------------------------------

def reference_attention(attn, x, rotate_q, rotate_k, causal):
    """float64: project with attn's weights, rotate each (head, token) vector, softmax attention, o_proj."""
    x = x.double()
    w = {n: getattr(attn, n).weight.detach().double() for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    b, n, _ = x.shape
    q = (x @ w["q_proj"].T).reshape(b, n, HEADS, HEAD_DIM)
    k = (x @ w["k_proj"].T).reshape(b, n, HEADS, HEAD_DIM)
    v = (x @ w["v_proj"].T).reshape(b, n, HEADS, HEAD_DIM)
    q = torch.stack([torch.stack([rotate_q(h, t, q[:, t, h]) for t in range(n)], 1) for h in range(HEADS)], 2)
    k = torch.stack([torch.stack([rotate_k(h, t, k[:, t, h]) for t in range(n)], 1) for h in range(HEADS)], 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(HEAD_DIM)
    if causal:
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, n, HEADS * HEAD_DIM)
    return out @ w["o_proj"].T


def test_vit_block_with_axial_rope_through_the_attention_class():
    torch.manual_seed(1)
    grid = patch_grid((3, 4))  # 12 patches, (row, column)
    rope = MultiAxisRotaryEmbedding(axial((4, 4), 100.0))
    attn = RotarySelfAttention(EMBED, HEADS, causal=False, rope=rope)
    x = torch.randn(2, 12, EMBED)
    # independent frequencies: axis 0 (rows) owns pairs 0-1, axis 1 (columns) pairs 2-3, ladder 100^(-2j/4)
    ladder = 100.0 ** (-torch.arange(0, 4, 2, dtype=torch.float64) / 4)
    freq = torch.zeros(2, 4, dtype=torch.float64)
    freq[0, :2], freq[1, 2:] = ladder, ladder
    matrices = [rotation_matrix(grid[t], freq, layout="half") for t in range(12)]

    def rotate(h, t, vec):
        return vec @ matrices[t].T

    want = reference_attention(attn, x, rotate, rotate, causal=False)
    torch.testing.assert_close(attn(x, grid).double(), want, atol=1e-5, rtol=1e-5)


def test_vit_block_with_rope_mixed_through_the_attention_class():
    torch.manual_seed(2)
    grid = patch_grid((2, 3), indexing="xy").float()
    rope = MixedRotaryEmbedding(HEAD_DIM, HEADS, generator=torch.Generator().manual_seed(3))
    attn = RotarySelfAttention(EMBED, HEADS, causal=False, rope=rope)
    x = torch.randn(1, 6, EMBED)
    freqs = rope.freqs.detach().double()  # (heads, 2, pairs): per head a (2, pairs) frequency matrix

    def rotate(h, t, vec):
        return vec @ rotation_matrix(grid[t], freqs[h], layout="interleaved").T

    want = reference_attention(attn, x, rotate, rotate, causal=False)
    torch.testing.assert_close(attn(x, grid).double(), want, atol=1e-5, rtol=1e-5)


def xpos_reference(rope: XPosEmbedding):
    """Rotation by the float64 matrix, then pair i scaled by zeta_i^(+-n/B) (Sun et al. 2022), written out."""
    pairs = HEAD_DIM // 2
    zeta = (2 * torch.arange(pairs, dtype=torch.float64) / HEAD_DIM + 0.4) / 1.4
    theta = 10000.0 ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)

    def make(sign):
        def rotate(h, t, vec):
            factor = zeta ** (sign * t / 512.0)
            return (vec @ rotation_matrix(t, theta, layout="half").T) * torch.cat((factor, factor))
        return rotate
    return make(+1), make(-1)


def test_xpos_block_through_the_same_attention_class():
    torch.manual_seed(4)
    rope = XPosEmbedding(HEAD_DIM, scale_base=512.0)
    attn = RotarySelfAttention(EMBED, HEADS, causal=True, rope=rope)
    x = torch.randn(2, 9, EMBED)
    rotate_q, rotate_k = xpos_reference(rope)
    want = reference_attention(attn, x, rotate_q, rotate_k, causal=True)
    torch.testing.assert_close(attn(x).double(), want, atol=1e-5, rtol=1e-5)
    # decoding with a preallocated cache gives the same: the keys keep their own factors
    cache = KVCache(max_length=9)
    with torch.no_grad():
        first = attn(x[:, :5], cache=cache)
        rest = [attn(x[:, t:t + 1], cache=cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat([first, *rest], 1).double(), want, atol=1e-5, rtol=1e-5)
