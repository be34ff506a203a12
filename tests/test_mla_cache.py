"""ropekit.mla.rotate_into_mla_cache: the same bits as the unfused composition, in the right slots, nothing else.

Oracles: the unfused composition written with the public rotation and plain indexing
(``apply_rotary`` then a copy of kv_c and the rotated key into the slots); vLLM's reference
loop for its paged MLA cache (``concat_and_cache_mla``, ported in tests/mla_reference.py);
the float64 rotation matrices. Slots no call may write keep a sentinel value; bad calls raise
before anything is written.
"""

import pytest
import torch

import ropekit
from mla_reference import concat_and_cache_mla_reference
from ropekit import mla, ops

torch.set_num_threads(1)

BACKENDS = [b for b in ("cpu", "torch") if b in ops.available()]
SENTINEL = 7.0
RANK, ROPE = 24, 8  # kv_lora_rank, qk_rope_head_dim


def tables(positions):
    inv_freq, _ = ropekit.inv_frequencies(ROPE)
    return ropekit.cos_sin(positions, inv_freq)


def caches(first_two, dtype=torch.float32):
    return torch.full((*first_two, RANK), SENTINEL, dtype=dtype), torch.full((*first_two, ROPE), SENTINEL, dtype=dtype)


def unfused_key(k_pe, cos, sin, layout, output_layout, backend):
    """The rotated key as the unfused composition makes it: rotate in ``layout``, then reorder."""
    rotated = ropekit.apply_rotary(k_pe, cos, sin, layout=layout, backend=backend)
    return rotated if output_layout in (None, layout) else ropekit.convert_layout(rotated, src=layout,
                                                                                  dst=output_layout)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("output_layout", [None, "half"])
@pytest.mark.parametrize("slots_kind", ["int", "scalar_tensor", "per_row"])
def test_contiguous_layout_equals_the_unfused_composition(backend, dtype, output_layout, slots_kind):
    gen = torch.Generator().manual_seed(1)
    batch, seq, length = 3, 4, 16
    kv_c = torch.randn(batch, seq, RANK, generator=gen).to(dtype)
    k_pe = torch.randn(batch, seq, ROPE, generator=gen).to(dtype)
    starts = {"int": [5] * batch, "scalar_tensor": [5] * batch, "per_row": [0, 9, 3]}[slots_kind]
    slots = {"int": 5, "scalar_tensor": torch.tensor(5), "per_row": torch.tensor(starts)}[slots_kind]
    cos, sin = tables(torch.tensor(starts)[:, None] + torch.arange(seq))  # (batch, seq, ROPE // 2)
    kv_cache, pe_cache = caches((batch, length), dtype)
    kv_in, k_in = kv_c.clone(), k_pe.clone()
    mla.rotate_into_mla_cache(kv_c, k_pe, cos, sin, kv_cache, pe_cache, slots, layout="interleaved",
                              output_layout=output_layout, backend=backend)
    assert torch.equal(kv_c, kv_in) and torch.equal(k_pe, k_in)
    rotated = unfused_key(k_pe, cos, sin, "interleaved", output_layout, backend)
    want_kv, want_pe = caches((batch, length), dtype)
    for b, first in enumerate(starts):
        want_kv[b, first:first + seq] = kv_c[b]
        want_pe[b, first:first + seq] = rotated[b]
    assert torch.equal(kv_cache, want_kv) and torch.equal(pe_cache, want_pe)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_cached_key_is_the_float64_rotation(backend):
    gen = torch.Generator().manual_seed(2)
    k_pe = torch.randn(2, 6, ROPE, generator=gen)
    kv_c = torch.randn(2, 6, RANK, generator=gen)
    positions = torch.arange(6) + 3
    inv_freq, _ = ropekit.inv_frequencies(ROPE)
    cos, sin = ropekit.cos_sin(positions, inv_freq)
    kv_cache, pe_cache = caches((2, 12))
    mla.rotate_into_mla_cache(kv_c, k_pe, cos, sin, kv_cache, pe_cache, 3, layout="interleaved",
                              output_layout="half", backend=backend)
    want = ropekit.convert_layout(ropekit.apply_reference(k_pe, positions, inv_freq, layout="interleaved"),
                                  src="interleaved", dst="half")
    torch.testing.assert_close(pe_cache[:, 3:9].double(), want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_then_decode_equals_one_rotation(backend):
    gen = torch.Generator().manual_seed(3)
    kv_c = torch.randn(2, 11, RANK, generator=gen)
    k_pe = torch.randn(2, 11, ROPE, generator=gen)
    cos, sin = tables(torch.arange(11))
    kv_cache, pe_cache = caches((2, 16))
    for first, last in ((0, 4), (4, 9), (9, 10), (10, 11)):  # two prefill chunks, two decode steps
        mla.rotate_into_mla_cache(kv_c[:, first:last], k_pe[:, first:last], cos[first:last], sin[first:last],
                                  kv_cache, pe_cache, first, layout="interleaved", backend=backend)
    assert torch.equal(pe_cache[:, :11], ropekit.apply_rotary(k_pe, cos, sin, layout="interleaved", backend=backend))
    assert torch.equal(kv_cache[:, :11], kv_c) and (pe_cache[:, 11:] == SENTINEL).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("output_layout", [None, "half"])
def test_paged_combined_cache_equals_vllm_concat_and_cache_mla(backend, output_layout):
    """vLLM's one buffer ``[kv_c | k_pe]`` per slot, written through its two slices; padding skipped."""
    gen = torch.Generator().manual_seed(4)
    block_size, blocks = 4, 6
    block_table = torch.tensor([[5, 1, 0], [2, 4, 3]])
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, -1, -1, -1]])  # sequence 1 is padded
    slots = ropekit.slot_mapping(block_table, positions, block_size)
    tokens = slots.numel()
    kv_c = torch.randn(tokens, RANK, generator=gen)
    k_pe = torch.randn(tokens, ROPE, generator=gen)
    cos, sin = tables(positions.clamp_min(0).reshape(-1))  # (tokens, ROPE // 2)
    cache = torch.full((blocks, block_size, RANK + ROPE), SENTINEL)
    mla.rotate_into_mla_cache(kv_c, k_pe, cos, sin, cache[..., :RANK], cache[..., RANK:], slots,
                              layout="interleaved", output_layout=output_layout, block_size=block_size,
                              backend=backend)
    want = torch.full_like(cache, SENTINEL)
    rotated = unfused_key(k_pe, cos, sin, "interleaved", output_layout, backend)
    concat_and_cache_mla_reference(kv_c, rotated, want, slots, block_size, RANK)
    assert torch.equal(cache, want)
    # two caches of their own, int32 slots: the same rows
    kv_cache, pe_cache = caches((blocks, block_size))
    mla.rotate_into_mla_cache(kv_c, k_pe, cos, sin, kv_cache, pe_cache, slots.int(), layout="interleaved",
                              output_layout=output_layout, block_size=block_size, backend=backend)
    assert torch.equal(torch.cat((kv_cache, pe_cache), -1), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_cache_whose_blocks_are_not_evenly_strided(backend):
    """Caches that cannot be viewed as rows (every other block of a buffer, transposed): written by (block, row)."""
    gen = torch.Generator().manual_seed(5)
    block_size = 4
    kv_c, k_pe = torch.randn(5, RANK, generator=gen), torch.randn(5, ROPE, generator=gen)
    slots = torch.tensor([0, 5, 6, 15, -1])
    cos, sin = tables(torch.tensor([0, 1, 2, 3, 0]))
    kv_base = torch.full((block_size, 8, RANK), SENTINEL)
    pe_base = torch.full((block_size, 8, ROPE), SENTINEL)
    kv_cache, pe_cache = kv_base.transpose(0, 1)[::2], pe_base.transpose(0, 1)[::2]  # (4 blocks, 4 rows, channels)
    mla.rotate_into_mla_cache(kv_c, k_pe, cos, sin, kv_cache, pe_cache, slots, layout="half", block_size=block_size,
                              backend=backend)
    rotated = ropekit.apply_rotary(k_pe, cos, sin, backend=backend)
    for t, slot in enumerate(slots.tolist()[:4]):
        assert torch.equal(kv_cache[slot // block_size, slot % block_size], kv_c[t])
        assert torch.equal(pe_cache[slot // block_size, slot % block_size], rotated[t])
    assert (kv_base.transpose(0, 1)[1::2] == SENTINEL).all()
    assert int((kv_cache != SENTINEL).any(-1).sum()) == 4


def test_nothing_to_write():
    kv_cache, pe_cache = caches((2, 4))
    empty_cos = torch.empty(0, ROPE // 2)
    mla.rotate_into_mla_cache(torch.empty(0, RANK), torch.empty(0, ROPE), empty_cos, empty_cos, kv_cache, pe_cache,
                              torch.empty(0, dtype=torch.long), layout="half", block_size=4)
    mla.rotate_into_mla_cache(torch.empty(2, 0, RANK), torch.empty(2, 0, ROPE), empty_cos, empty_cos,
                              *caches((2, 4)), 4, layout="half")
    assert (kv_cache == SENTINEL).all() and (pe_cache == SENTINEL).all()


def bad_calls():
    """``(what the message names, arguments)`` of calls that must raise before writing, and the caches they get."""
    gen = torch.Generator().manual_seed(6)
    kv_c, k_pe = torch.randn(2, 3, RANK, generator=gen), torch.randn(2, 3, ROPE, generator=gen)
    cos, sin = tables(torch.arange(3))
    kv_cache, pe_cache = caches((2, 8))
    base = dict(kv_c=kv_c, k_pe=k_pe, cos=cos, sin=sin, kv_cache=kv_cache, pe_cache=pe_cache, slots=0)
    flat_kv, flat_pe = kv_c[0], k_pe[0]  # 3 tokens, paged
    paged = dict(base, kv_c=flat_kv, k_pe=flat_pe, kv_cache=kv_cache.view(4, 4, RANK),
                 pe_cache=pe_cache.view(4, 4, ROPE), slots=torch.tensor([0, 5, 15]), block_size=4)
    combined = torch.full((2, 8, RANK + ROPE), SENTINEL)
    return [
        ("slots must be starts", dict(base, slots=6)),  # 6 + 3 > 8
        ("slots must be starts", dict(base, slots=torch.tensor([0, 6]))),
        ("slots must be starts", dict(base, slots=-1)),
        ("slots must be below", dict(paged, slots=torch.tensor([0, 5, 16]))),
        ("slots must have shape", dict(paged, slots=torch.tensor([0, 5]))),
        ("slot mapping", dict(paged, slots=3)),
        ("slots must be an int32 or int64", dict(base, slots=torch.tensor([0.0, 1.0]))),
        ("pe_cache must have the 8 channels of k_pe", dict(base, pe_cache=torch.full((2, 8, 6), SENTINEL))),
        ("kv_cache must have the 20 channels of kv_c", dict(base, kv_c=kv_c[..., :20])),
        ("kv_cache must have the dtype of kv_c", dict(base, kv_c=kv_c.double())),
        ("kv_c and k_pe must hold the same tokens", dict(base, kv_c=kv_c[:, :2])),
        ("k_pe must be 2-D for the paged layout", dict(paged, k_pe=k_pe)),
        ("axis 1 must be block_size=2", dict(paged, block_size=2)),
        ("block_size must be a positive int", dict(paged, block_size=0)),
        ("kv_cache must have kv_c's batch", dict(base, kv_cache=torch.full((3, 8, RANK), SENTINEL),
                                                 pe_cache=torch.full((3, 8, ROPE), SENTINEL))),
        ("cos must have rotary_dim // 2", dict(base, cos=cos[..., :2])),
        ("kv_cache and pe_cache are the same tensor", dict(base, kv_c=kv_c[..., :ROPE], kv_cache=pe_cache)),
        ("kv_cache and pe_cache share memory", dict(base, kv_cache=combined[..., :RANK + 2],
                                                    pe_cache=combined[..., RANK:], kv_c=torch.randn(2, 3, RANK + 2))),
        ("pe_cache and k_pe share memory", dict(base, k_pe=pe_cache[:, :3])),
        ("kv_cache and cos share memory", dict(base, cos=kv_cache[0, :3, :ROPE // 2], sin=kv_cache[0, :3, 4:8])),
        ("no autograd", dict(base, k_pe=k_pe.clone().requires_grad_(True))),
        ("layout", dict(base, layout="zigzag")),
        ("output_layout", dict(base, output_layout="zigzag")),
    ]


@pytest.mark.parametrize("case", range(len(bad_calls())))
def test_bad_calls_raise_naming_the_argument_and_write_nothing(case):
    message, call = bad_calls()[case]
    call = {"layout": "interleaved", **call}
    caches_before = [t.clone() for t in (call["kv_cache"], call["pe_cache"])]
    args = [call.pop(n) for n in ("kv_c", "k_pe", "cos", "sin", "kv_cache", "pe_cache", "slots")]
    with pytest.raises((ValueError, TypeError), match=message):
        mla.rotate_into_mla_cache(*args, **call)
    assert torch.equal(args[4], caches_before[0]) and torch.equal(args[5], caches_before[1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_every_backend_writes_the_same_bits_and_an_unknown_one_is_refused_before_writing(dtype):
    gen = torch.Generator().manual_seed(7)
    kv_c, k_pe = torch.randn(2, 2, RANK, generator=gen).to(dtype), torch.randn(2, 2, ROPE, generator=gen).to(dtype)
    cos, sin = tables(torch.arange(2) + 1)
    written = []
    for backend in BACKENDS:
        kv_cache, pe_cache = caches((2, 4), dtype)
        mla.rotate_into_mla_cache(kv_c, k_pe, cos, sin, kv_cache, pe_cache, torch.tensor([1, 2]), layout="half",
                                  backend=backend)
        written.append(torch.cat((kv_cache, pe_cache), -1))
    assert all(torch.equal(w, written[0]) for w in written)
    kv_cache, pe_cache = caches((2, 4), dtype)
    with pytest.raises(ValueError, match="backend"):
        mla.rotate_into_mla_cache(kv_c, k_pe, cos, sin, kv_cache, pe_cache, 1, layout="half", backend="nonesuch")
    assert (kv_cache == SENTINEL).all() and (pe_cache == SENTINEL).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True])
def test_a_warm_call_is_a_cold_call(backend, paged):
    """After a valid call of a signature, calls of the same signature raise (and write) exactly what cold ones do."""
    from ropekit.ops import prepared

    gen = torch.Generator().manual_seed(8)
    kv_c, k_pe = torch.randn(2, 2, RANK, generator=gen), torch.randn(2, 2, ROPE, generator=gen)
    cos, sin = tables(torch.arange(2))
    opts = dict(layout="interleaved", output_layout="half", backend=backend)
    if paged:
        kv_c, k_pe, cos, sin = kv_c.view(4, RANK), k_pe.view(4, ROPE), cos.repeat(2, 1), sin.repeat(2, 1)
        opts["block_size"] = 4
    shape = (3, 4) if paged else (2, 6)
    good = torch.tensor([0, 5, 6, 11]) if paged else torch.tensor([1, 3])
    bad = [torch.tensor([0, 5, 6, 12]) if paged else torch.tensor([1, 5])]  # one slot past the caches
    if not paged:
        bad += [5, -1, torch.tensor([-1, 0])]

    def outcome(slots, warm, kv_cache=None, pe_cache=None, k=None):
        if not warm:
            prepared.clear()
        if kv_cache is None:
            kv_cache, pe_cache = caches(shape)
        try:
            mla.rotate_into_mla_cache(kv_c, k_pe if k is None else k, cos, sin, kv_cache, pe_cache, slots, **opts)
        except (ValueError, TypeError) as error:
            result = (type(error), str(error))
        else:
            result = None
        return result, torch.cat((kv_cache, pe_cache), -1)

    outcome(good, warm=False)  # the signature's call is kept from here on
    for slots in [good, *bad]:
        warm, cold = outcome(slots, warm=True), outcome(slots, warm=False)
        assert warm[0] == cold[0] and torch.equal(warm[1], cold[1])
        assert (warm[0] is None) == (slots is good)
        outcome(good, warm=True)
    # the same signatures with memory shared, on warm calls: two overlapping views of one buffer as the caches
    # (a disjoint pair of the same shapes and strides made the signature warm), then a key inside its own cache
    disjoint, overlapping = (torch.full((*shape, RANK + ROPE), SENTINEL) for _ in range(2))
    assert outcome(good, warm=False, kv_cache=disjoint[..., :RANK], pe_cache=disjoint[..., RANK:])[0] is None
    result = outcome(good, warm=True, kv_cache=overlapping[..., :RANK], pe_cache=overlapping[..., RANK - ROPE:RANK])
    assert result[0] == (ValueError, result[0][1]) and "kv_cache and pe_cache share memory" in result[0][1]
    assert (overlapping == SENTINEL).all()
    kv_cache, pe_cache = caches(shape)
    assert outcome(good, warm=False, kv_cache=kv_cache, pe_cache=pe_cache)[0] is None
    inside = pe_cache.view(-1)[:k_pe.numel()].view(k_pe.shape)  # contiguous, like k_pe: the same signature
    before = pe_cache.clone()
    result = outcome(good, warm=True, kv_cache=kv_cache, pe_cache=pe_cache, k=inside)
    assert result[0][0] is ValueError and "pe_cache and k_pe share memory" in result[0][1]
    assert torch.equal(pe_cache, before)
