"""The calling forms of two peers, against float64 oracles written from their reference code.

Neither peer is installed here (both need CUDA builds), so each oracle restates, in float64, what
the peer's own PyTorch reference does:

- flash-attention, ``flash_attn/layers/rotary.py``: ``apply_rotary_emb_torch(x, cos, sin,
  interleaved)`` repeats the half tables to full width and computes ``x * cos +
  rotate_half(x) * sin`` on the first ``rotary_dim`` channels; ``apply_rotary_emb(x, cos, sin,
  interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)`` rotates token ``t`` of
  sequence ``b`` by row ``seqlen_offsets[b] + t`` (its tests slice the tables that way), ``x``
  being ``(batch, seqlen, nheads, headdim)`` or packed ``(total, nheads, headdim)`` with
  ``cu_seqlens``. ropekit's form: :func:`ropekit.rotate`.
- vLLM, ``vllm/model_executor/layers/rotary_embedding.py``: ``RotaryEmbedding.forward_native(
  positions, query, key)`` with flat ``(num_tokens, num_heads * head_size)`` query/key, a
  ``cos_sin_cache`` of ``(max_position, rotary_dim)`` (cos halves then sin halves) indexed by
  ``positions``, the rotation of the first ``rotary_dim`` channels of each head, NeoX style
  (halves) or GPT-J style (interleaved pairs). ropekit's form: :func:`ropekit.rotate_qk` with
  ``head_size=``.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ropekit
from ropekit import ops

BACKENDS = [name for name in ("torch", "cpu") if name in ops.available()]


def rotate_half64(x, interleaved):
    """flash-attention's rotate_half: (-x2, x1) on halves, or on interleaved pairs."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def flash_attn_oracle(x, cos, sin, interleaved, seqlen_offsets, cu_seqlens=None):
    """float64 ``apply_rotary_emb`` of flash-attention: per sequence, rows offset + t of the tables."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    ro_dim = 2 * cos.shape[-1]
    if cu_seqlens is None:
        starts, lengths, views = range(x.shape[0]), [x.shape[1]] * x.shape[0], [x[b] for b in range(x.shape[0])]
    else:
        bounds = cu_seqlens.tolist()
        views = [x[bounds[b]:bounds[b + 1]] for b in range(len(bounds) - 1)]
        starts, lengths = range(len(views)), [v.shape[0] for v in views]
    out = []
    for b, view, length in zip(starts, views, lengths, strict=True):
        offset = int(seqlen_offsets[b]) if isinstance(seqlen_offsets, torch.Tensor) else seqlen_offsets
        rows = torch.arange(length) + offset
        c, s = cos[rows], sin[rows]  # (length, ro_dim / 2)
        full = "interleaved" if interleaved else "halves"
        c = c.repeat_interleave(2, dim=-1) if full == "interleaved" else torch.cat((c, c), dim=-1)
        s = s.repeat_interleave(2, dim=-1) if full == "interleaved" else torch.cat((s, s), dim=-1)
        rot = view[..., :ro_dim] * c[:, None] + rotate_half64(view[..., :ro_dim], interleaved) * s[:, None]
        out.append(torch.cat((rot, view[..., ro_dim:]), dim=-1))
    return torch.cat(out) if cu_seqlens is not None else torch.stack(out)


def vllm_oracle(positions, query, cos_sin_cache, head_size, rotary_dim, is_neox_style):
    """float64 ``forward_native`` of vLLM for one of query/key."""
    cos, sin = cos_sin_cache.double()[positions].chunk(2, dim=-1)
    heads = query.double().view(query.shape[0], -1, head_size)
    x, passed = heads[..., :rotary_dim], heads[..., rotary_dim:]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    rotated = torch.cat((o1, o2), dim=-1) if is_neox_style else torch.stack((o1, o2), dim=-1).flatten(-2)
    return torch.cat((rotated, passed), dim=-1).reshape(query.shape)


def assert_close64(got, want):
    assert got.shape == want.shape
    scale = max(want.abs().max().item(), 1.0)
    assert (got.double() - want).abs().max().item() <= 1e-6 * scale


@settings(max_examples=20)
@given(
    interleaved=st.booleans(), inplace=st.booleans(), packed=st.booleans(), tensor_offsets=st.booleans(),
    rotary_half=st.sampled_from([4, 8, 16]), tail=st.sampled_from([0, 8]), backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 2**16),
)
def test_flash_attention_apply_rotary_emb(interleaved, inplace, packed, tensor_offsets, rotary_half, tail, backend,
                                          seed):
    gen = torch.Generator().manual_seed(seed)
    headdim, nheads, seqlen_ro = 2 * rotary_half + tail, 3, 64
    cos, sin = ropekit.cos_sin(torch.arange(seqlen_ro), ropekit.inv_frequencies(2 * rotary_half)[0])
    if packed:
        cu_seqlens = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
        x = torch.randn(12, nheads, headdim, generator=gen)
        offsets = torch.tensor([3, 0, 40]) if tensor_offsets else 7
        kwargs = {"cu_seqlens": cu_seqlens, "seq_dim": 0}
    else:
        cu_seqlens = None
        x = torch.randn(2, 6, nheads, headdim, generator=gen)
        offsets = torch.tensor([0, 50]) if tensor_offsets else 9
        kwargs = {"seq_dim": 1}
    want = flash_attn_oracle(x, cos, sin, interleaved, offsets, cu_seqlens)
    x_in = x.clone()
    got = ropekit.rotate(x_in, cos, sin, offsets=offsets, layout="interleaved" if interleaved else "half",
                         inplace=inplace, backend=backend, **kwargs)
    assert (got is x_in) == inplace
    assert_close64(got, want)
    if not inplace:
        assert torch.equal(x_in, x)


@settings(max_examples=20)
@given(
    is_neox_style=st.booleans(), rotary_dim=st.sampled_from([16, 32, 64]), heads=st.sampled_from([(4, 4), (8, 2)]),
    inplace=st.booleans(), backend=st.sampled_from(BACKENDS), seed=st.integers(0, 2**16),
)
def test_vllm_forward_with_flat_query_and_key(is_neox_style, rotary_dim, heads, inplace, backend, seed):
    gen = torch.Generator().manual_seed(seed)
    head_size, num_tokens, max_position = 64, 9, 128
    inv_freq = ropekit.inv_frequencies(rotary_dim, base=10000.0)[0]
    cos, sin = ropekit.cos_sin(torch.arange(max_position), inv_freq)
    cos_sin_cache = torch.cat((cos, sin), dim=-1)  # vLLM's cache layout
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen)
    query = torch.randn(num_tokens, heads[0] * head_size, generator=gen)
    key = torch.randn(num_tokens, heads[1] * head_size, generator=gen)
    q_in, k_in = query.clone(), key.clone()
    q_out, k_out = ropekit.rotate_qk(q_in, k_in, cos, sin, positions=positions, seq_dim=0, head_size=head_size,
                                     layout="half" if is_neox_style else "interleaved", inplace=inplace,
                                     backend=backend)
    assert q_out.shape == query.shape and k_out.shape == key.shape
    assert (q_out is q_in and k_out is k_in) == inplace
    assert_close64(q_out, vllm_oracle(positions, query, cos_sin_cache, head_size, rotary_dim, is_neox_style))
    assert_close64(k_out, vllm_oracle(positions, key, cos_sin_cache, head_size, rotary_dim, is_neox_style))


def test_flat_forms_check_the_head_size():
    q, k = torch.randn(4, 96), torch.randn(4, 64)
    cos, sin = ropekit.cos_sin(torch.arange(8), ropekit.inv_frequencies(32)[0])
    with pytest.raises(ValueError, match="head_size=40"):
        ropekit.rotate_qk(q, k, cos, sin, seq_dim=0, head_size=40)
    with pytest.raises(TypeError, match="head_size"):
        ropekit.rotate_qk(q, k, cos, sin, seq_dim=0, head_size=0)
    with pytest.raises(ValueError, match="rotary_dim"):
        ropekit.rotate_qk(q, k, cos, sin, seq_dim=0, head_size=16)  # 32 rotated channels > 16
    with pytest.raises(ValueError, match="outside the cos/sin tables"):
        ropekit.rotate(torch.randn(1, 9, 2, 32), cos, sin, offsets=0, seq_dim=1)
