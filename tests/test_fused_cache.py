"""Rotation into a KV cache: the same bits as rotate-then-copy, in the right slots, and nothing else touched.

The oracle is the unfused path written with the public rotation and plain indexing
(``apply_rotary`` / ``rms_norm_rotary`` then a copy into the slots); slots no call may write
keep a sentinel value. Bad slots raise before anything is written.
"""

import pytest
import torch

import ropekit
from ropekit import ops
from ropekit.nn import KVCache, RotarySelfAttention

torch.set_num_threads(1)

BACKENDS = [b for b in ("cpu", "torch") if b in ops.available()]
SENTINEL = 7.0


def tables(positions, rotary_dim=32):
    inv_freq, _ = ropekit.inv_frequencies(rotary_dim)
    return ropekit.cos_sin(positions, inv_freq)


def caches(shape, dtype):
    return torch.full(shape, SENTINEL, dtype=dtype), torch.full(shape, SENTINEL, dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("slots_kind", ["int", "scalar_tensor", "per_row"])
def test_contiguous_layout_equals_rotate_then_copy(backend, dtype, layout, slots_kind):
    gen = torch.Generator().manual_seed(1)
    batch, heads, seq, length, d = 3, 2, 4, 16, 40  # partial rotary: 32 of 40 channels
    k = torch.randn(batch, heads, seq, d, generator=gen).to(dtype)
    v = torch.randn(batch, heads, seq, d, generator=gen).to(dtype)
    starts = {"int": [5] * batch, "scalar_tensor": [5] * batch, "per_row": [0, 9, 3]}[slots_kind]
    slots = {"int": 5, "scalar_tensor": torch.tensor(5), "per_row": torch.tensor(starts)}[slots_kind]
    positions = torch.tensor(starts)[:, None] + torch.arange(seq)
    cos, sin = tables(positions)
    cos, sin = cos[:, None], sin[:, None]  # (batch, 1, seq, half)
    k_cache, v_cache = caches((batch, heads, length, d), dtype)
    k_in, v_in = k.clone(), v.clone()
    ropekit.rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slots, layout=layout, backend=backend)
    assert torch.equal(k, k_in) and torch.equal(v, v_in)
    rotated = ropekit.apply_rotary(k, cos, sin, layout=layout, backend=backend)
    want_k, want_v = caches((batch, heads, length, d), dtype)
    for b, first in enumerate(starts):
        want_k[b, :, first:first + seq] = rotated[b]
        want_v[b, :, first:first + seq] = v[b]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm", ["per_head", "per_token"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_keys_normalised_on_the_way_in_equal_the_fused_norm(backend, norm, offset):
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(2, 3, 5, 32, generator=gen).to(torch.bfloat16)  # (batch, kv_heads, seq, head_dim)
    v = torch.randn(2, 3, 5, 32, generator=gen).to(torch.bfloat16)
    weight = torch.randn((3, 32) if norm == "per_token" else (32,), generator=gen).to(torch.bfloat16)
    cos, sin = tables(torch.arange(5) + 2)
    k_cache, v_cache = caches((2, 3, 8, 32), torch.bfloat16)
    ropekit.rotate_into_cache(k, v, cos, sin, k_cache, v_cache, 2, k_weight=weight, eps=1e-6, norm=norm,
                              weight_offset=offset, backend=backend)
    if norm == "per_head":
        want = ropekit.rms_norm_rotary(k, weight, cos, sin, eps=1e-6, weight_offset=offset, backend=backend)
    else:  # the norm spans the kv_heads axis: heads next to the channels for rms_norm_rotary
        want = ropekit.rms_norm_rotary(k.transpose(1, 2), weight, cos[:, None], sin[:, None], eps=1e-6,
                                       norm=norm, weight_offset=offset, backend=backend).transpose(1, 2)
    assert torch.equal(k_cache[:, :, 2:7], want) and torch.equal(v_cache[:, :, 2:7], v)
    assert (k_cache[:, :, :2] == SENTINEL).all() and (k_cache[:, :, 7:] == SENTINEL).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_layout_follows_the_slot_mapping_and_skips_padding(backend):
    gen = torch.Generator().manual_seed(3)
    block_size, blocks, heads, d = 4, 6, 2, 32
    block_table = torch.tensor([[5, 1, 0], [2, 4, 3]])
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, -1, -1, -1]])  # sequence 1 is padded
    slots = ropekit.slot_mapping(block_table, positions, block_size)
    assert slots.tolist() == [20, 21, 22, 23, 4, 5, 18, 19, 12, -1, -1, -1]
    tokens = slots.numel()
    k = torch.randn(tokens, heads, d, generator=gen)
    v = torch.randn(tokens, heads, d, generator=gen)
    cos, sin = tables(positions.clamp_min(0).reshape(-1))
    cos, sin = cos[:, None], sin[:, None]  # (tokens, 1, half)
    k_cache, v_cache = caches((blocks, block_size, heads, d), torch.float32)
    ropekit.rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slots, block_size=block_size, backend=backend)
    rotated = ropekit.apply_rotary(k, cos, sin, backend=backend)
    want_k, want_v = caches((blocks, block_size, heads, d), torch.float32)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // block_size, slot % block_size] = rotated[t]
            want_v[slot // block_size, slot % block_size] = v[t]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_then_decode_equals_one_rotation(backend):
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(2, 2, 11, 32, generator=gen)
    v = torch.randn(2, 2, 11, 32, generator=gen)
    cos, sin = tables(torch.arange(11))
    k_cache, v_cache = caches((2, 2, 16, 32), torch.float32)
    for first, last in ((0, 4), (4, 9), (9, 10), (10, 11)):  # two prefill chunks, two decode steps
        ropekit.rotate_into_cache(k[:, :, first:last], v[:, :, first:last], cos[first:last], sin[first:last],
                                  k_cache, v_cache, first, backend=backend)
    assert torch.equal(k_cache[:, :, :11], ropekit.apply_rotary(k, cos, sin, backend=backend))
    assert torch.equal(v_cache[:, :, :11], v) and (k_cache[:, :, 11:] == SENTINEL).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout_kind", ["contiguous", "paged"])
def test_slots_outside_the_cache_raise_before_anything_is_written(backend, layout_kind):
    k = torch.randn(3, 2, 2, 32)
    cos, sin = tables(torch.arange(2))
    if layout_kind == "contiguous":
        k_cache, v_cache = caches((3, 2, 8, 32), torch.float32)
        bad = [torch.tensor([0, 7, 2]), 7, torch.tensor([0, -1, 2])]  # row 1 would end past the cache / before it
        kwargs = {}
    else:
        k = k[:, :, 0]  # (tokens, heads, dim)
        cos, sin = cos[:1].expand(3, 16)[:, None], sin[:1].expand(3, 16)[:, None]
        k_cache, v_cache = caches((2, 4, 2, 32), torch.float32)
        bad = [torch.tensor([0, 8, 1])]  # slot 8 of 8
        kwargs = {"block_size": 4}
    for slots in bad:
        with pytest.raises(ValueError, match="slots"):
            ropekit.rotate_into_cache(k, k.clone(), cos, sin, k_cache, v_cache, slots, backend=backend, **kwargs)
        assert (k_cache == SENTINEL).all() and (v_cache == SENTINEL).all()


def test_kv_cache_with_max_length_gives_the_same_attention_as_the_concatenating_one():
    torch.manual_seed(0)
    attn = RotarySelfAttention(64, 4, num_kv_heads=2, rotary_dim=8).eval()
    x = torch.randn(2, 13, 64)
    plain, rotating = KVCache(), KVCache(max_length=16)
    with torch.no_grad():
        outs = {}
        for name, cache in (("plain", plain), ("rotating", rotating)):
            steps = [attn(x[:, :5], cache=cache), attn(x[:, 5:9], cache=cache)]  # chunked prefill
            steps += [attn(x[:, t:t + 1], cache=cache) for t in range(9, 13)]  # decode
            outs[name] = torch.cat(steps, 1)
        full = attn(x)
    assert torch.equal(outs["plain"], outs["rotating"])
    torch.testing.assert_close(outs["rotating"], full, rtol=1e-5, atol=1e-6)
    assert torch.equal(plain.k, rotating.k) and torch.equal(plain.v, rotating.v) and rotating.length == 13
    before = rotating.k.clone()
    with pytest.raises(ValueError, match="max_length"), torch.no_grad():
        attn(x[:, :4], cache=rotating)
    assert rotating.length == 13 and torch.equal(rotating.k, before)


def test_xpos_attention_with_a_preallocated_cache_scales_its_keys():
    """xPos keys are scaled as well as rotated: a KVCache(max_length) must not rotate them into their slots
    with the queries' tables (the preallocated cache then only stores what xPos computed)."""
    from ropekit.nn import XPosEmbedding

    torch.manual_seed(1)
    attn = RotarySelfAttention(64, 4, rope=XPosEmbedding(16, scale_base=8.0)).eval()
    x = torch.randn(1, 9, 64)
    with torch.no_grad():
        cache = KVCache(max_length=12)
        out = torch.cat([attn(x[:, :5], cache=cache)] + [attn(x[:, t:t + 1], cache=cache) for t in range(5, 9)], 1)
        full = attn(x)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)


def test_kv_cache_update_rotating_under_autograd_rotates_then_appends():
    cache = KVCache(max_length=8)
    k = torch.randn(1, 2, 3, 32, requires_grad=True)
    v = torch.randn(1, 2, 3, 32)
    cos, sin = tables(torch.arange(3))
    keys, _ = cache.update_rotating(k, v, cos, sin)
    keys.sum().backward()
    assert k.grad is not None
    torch.testing.assert_close(keys, ropekit.apply_rotary(k.detach(), cos, sin))
    with pytest.raises(ValueError, match="no autograd"):
        ropekit.rotate_into_cache(k, v, cos, sin, torch.zeros(1, 2, 8, 32), torch.zeros(1, 2, 8, 32), 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("head_dim", [64, 72])  # 72: partial rotary (a copied tail), rows not 32-byte multiples
def test_decode_step_into_a_long_cache_equals_rotate_then_copy(backend, dtype, layout, head_dim):
    """One token per sequence, many heads: the rows land far apart (the kernel streams them to their slots)."""
    gen = torch.Generator().manual_seed(5)
    batch, heads, length = 5, 12, 64
    k = torch.randn(batch, heads, 1, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, heads, 1, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([3, 63, 0, 17, 40])
    inv_freq, _ = ropekit.inv_frequencies(64)
    cos, sin = ropekit.cos_sin(starts[:, None], inv_freq)
    cos, sin = cos[:, None, :, :], sin[:, None, :, :]  # (batch, 1, 1, half)
    if dtype == torch.float64:
        cos, sin = cos.double(), sin.double()
    rotated = ropekit.apply_rotary(k, cos, sin, layout=layout, backend=backend)
    for slots in (starts, 9):
        k_cache, v_cache = caches((batch, heads, length, head_dim), dtype)
        ropekit.rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slots, layout=layout, backend=backend)
        want_k, want_v = caches((batch, heads, length, head_dim), dtype)
        for b in range(batch):
            first = int(slots[b]) if isinstance(slots, torch.Tensor) else slots
            want_k[b, :, first] = rotated[b, :, 0]
            want_v[b, :, first] = v[b, :, 0]
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.skipif("cpu" not in ops.available(), reason="C++ CPU kernel unavailable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_cache_writes_split_over_threads_give_the_bits_of_one_thread(dtype, eps):
    """Over 2 and 3 threads (one start: keys and values each shared among the threads; a start per
    row: the jobs of all rows cut into ranges), the caches hold what one thread writes, and that is
    rotate-then-copy's result."""
    hooks = ops.get("cpu").operators()
    gen = torch.Generator().manual_seed(9)
    batch, heads, length, d = 5, 12, 32, 72
    k = torch.randn(batch, heads, 1, d, generator=gen).to(dtype)
    v = torch.randn(batch, heads, 1, d, generator=gen).to(dtype)
    w = torch.randn(d, generator=gen)
    starts = torch.tensor([3, 31, 0, 17, 20])
    cos, sin = tables(starts[:, None], rotary_dim=64)
    cos, sin = cos[:, None], sin[:, None]  # (batch, 1, 1, half)
    norm = dict(k_weight=w, eps=eps) if eps else {}
    if eps:
        keys = ropekit.rms_norm_rotary(k, w, cos, sin, eps=eps, backend="cpu")
    else:
        keys = ropekit.apply_rotary(k, cos, sin, backend="cpu")
    for slots in (starts, 9):
        written = []
        for threads in (1, 2, 3):
            old = hooks.set_thresholds(-1, 0)  # split even these few bytes
            torch.set_num_threads(threads)
            try:
                k_cache, v_cache = caches((batch, heads, length, d), dtype)
                ropekit.rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slots, backend="cpu", **norm)
            finally:
                torch.set_num_threads(1)
                hooks.set_thresholds(*old)
            written.append((k_cache, v_cache))
        want_k, want_v = caches((batch, heads, length, d), dtype)
        for b in range(batch):
            first = int(slots[b]) if isinstance(slots, torch.Tensor) else slots
            want_k[b, :, first] = keys[b, :, 0]
            want_v[b, :, first] = v[b, :, 0]
        for k_cache, v_cache in written:
            assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
