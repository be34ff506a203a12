"""Moving cached keys: ``rerotate_cache`` and ``context_shift`` against the float64 oracle and direct rotation.

Keys rotated at ``p`` and then re-rotated by ``delta`` must equal, within the bound the module states
(:mod:`ropekit.fused.rerotate`), both the unrotated keys rotated at ``p + delta`` directly (ropekit's
own float32 path) and the float64 rotation matrices at ``p + delta`` (:func:`ropekit.apply_reference`).
The bound is in ulps of each pair's magnitude ``|(k_i, k_j)|`` in the cache's dtype:

- bfloat16 / float16: 1 ulp from the direct rotation (the cached key's rounding, at most half an ulp
  of the pair's larger member, is turned into both members: up to ``0.71`` ulp, plus the two final
  roundings, on a grid of one ulp), 1.25 ulps from the float64 rotation;
- float32: 3 ulps from either (both routes round float32 tables and products; the worst measured
  over 1.6 million random keys, and what hypothesis finds, is 3.0).

A per-element bound in the element's own ulp cannot hold: a small member of a large pair inherits
the large member's rounding error through the rotation.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ropekit
from ropekit import apply_reference, base_inv_freq, cos_sin, ops

LAYOUTS = ("half", "interleaved")
BACKENDS = [name for name in ("torch", "cpu") if name in ops.available()]
MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}
#: (against the direct rotation, against the float64 rotation) in ulps of the pairs' magnitudes
BOUND = {torch.bfloat16: (1.0, 1.25), torch.float16: (1.0, 1.25), torch.float32: (3.0, 3.0)}
B, H, S, D = 2, 2, 12, 16


def pair_ulps(err: torch.Tensor, keys: torch.Tensor, rotary_dim: int, layout: str, dtype: torch.dtype) -> float:
    """The largest ``err`` in ulps (of ``dtype``) of the magnitude of the pair each channel belongs to."""
    k = keys.double()
    half = rotary_dim // 2
    if layout == "half":
        norm = torch.sqrt(k[..., :half] ** 2 + k[..., half:rotary_dim] ** 2)
        norm = torch.cat((norm, norm), -1)
    else:
        norm = k[..., :rotary_dim].unflatten(-1, (half, 2)).square().sum(-1, keepdim=True).sqrt()
        norm = norm.expand(*norm.shape[:-1], 2).flatten(-2)
    ulp = torch.pow(2.0, torch.floor(torch.log2(norm.clamp_min(torch.finfo(dtype).tiny))) - MANTISSA[dtype])
    return float((err[..., :rotary_dim] / ulp).max()) if err.numel() else 0.0


def rotated_at(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, layout: str) -> torch.Tensor:
    """``keys`` (batch, heads, seq, d) rotated at ``positions`` (batch, seq) by ropekit's float32 path."""
    cos, sin = cos_sin(positions, inv_freq)
    return ropekit.apply_rotary(keys, cos[:, None], sin[:, None], layout=layout)


def as_format(cache: torch.Tensor, tensor_format: str) -> torch.Tensor:
    """A (batch, heads, seq, d) cache laid out in ``tensor_format`` (its own storage)."""
    return cache if tensor_format == "bhsd" else cache.transpose(1, 2).contiguous()


def from_format(cache: torch.Tensor, tensor_format: str) -> torch.Tensor:
    return cache if tensor_format == "bhsd" else cache.transpose(1, 2)


def draw_moves(data, batch: int, length: int) -> tuple[torch.Tensor | None, torch.Tensor, int | torch.Tensor]:
    """``(positions argument, full (batch, length) delta grid (0 where nothing moves), delta argument)``."""
    mode = data.draw(st.sampled_from(["all", "run", "scattered"]))
    if mode == "all":
        slots = torch.arange(length).expand(batch, length)
        positions = None
    elif mode == "run":
        first = data.draw(st.integers(0, length - 1))
        last = data.draw(st.integers(first + 1, length))
        slots = torch.arange(first, last).expand(batch, last - first)
        positions = slots[0]
    else:
        rows = [data.draw(st.lists(st.integers(0, length - 1), min_size=3, max_size=3, unique=True))
                for _ in range(batch)]
        slots = torch.tensor(rows)
        if data.draw(st.booleans()):  # padding
            slots[1, 2] = -1
        positions = slots
    n = slots.shape[1]
    kind = data.draw(st.sampled_from(["int", "per_sequence", "per_key"]))
    low = int(torch.where(slots >= 0, slots, length).min())
    high = int(slots.max())
    if kind == "int":  # every key stays inside [0, length)
        value = data.draw(st.integers(-low, length - 1 - high))
        delta, grid = value, torch.full((batch, n), value)
    elif kind == "per_sequence":
        values = [data.draw(st.integers(-int(torch.where(r >= 0, r, length).min()), length - 1 - int(r.max())))
                  for r in slots]
        delta = torch.tensor(values)
        grid = delta[:, None].expand(batch, n)
    else:
        grid = torch.tensor([[data.draw(st.integers(-max(int(p), 0), length - 1 - max(int(p), 0))) for p in row]
                             for row in slots])
        delta = grid
    full = torch.zeros(batch, length, dtype=torch.long)
    for b in range(batch):
        for j in range(n):
            if slots[b, j] >= 0:
                full[b, slots[b, j]] = grid[b, j]
    return positions, full, delta


@given(data=st.data(), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       layout=st.sampled_from(LAYOUTS), tensor_format=st.sampled_from(["bhsd", "bshd"]),
       backend=st.sampled_from(BACKENDS), by_tables=st.booleans(), partial=st.booleans(),
       origin=st.integers(0, 10**6), seed=st.integers(0, 2**16))
def test_rerotated_keys_equal_the_keys_rotated_at_the_new_positions(data, dtype, layout, tensor_format, backend,
                                                                    by_tables, partial, origin, seed):
    """Slot ``s`` holds the key of position ``origin + s``; moved by delta, that of ``origin + s + delta``."""
    gen = torch.Generator().manual_seed(seed)
    rotary_dim = 8 if partial else D
    inv_freq = base_inv_freq(rotary_dim, 1e4)
    scale = torch.pow(10.0, torch.rand(B, H, S, D, generator=gen) * 4 - 2)  # pairs of very unequal members too
    keys = (torch.randn(B, H, S, D, generator=gen) * scale).to(dtype)
    slots = torch.arange(S).expand(B, S)
    cache = as_format(rotated_at(keys, origin + slots, inv_freq, layout), tensor_format)
    before = cache.clone()
    positions, full, delta = draw_moves(data, B, S)
    tables = dict(inv_freq=inv_freq)
    if by_tables:  # the origin's rows are no business of the move: tables of the slots' range do
        cos_table, sin_table = cos_sin(torch.arange(S), inv_freq)
        tables = dict(cos_table=cos_table, sin_table=sin_table)
    out = ropekit.rerotate_cache(cache, delta, positions=positions, tensor_format=tensor_format, layout=layout,
                                 backend=backend, **tables)
    assert out is cache
    got = from_format(cache, tensor_format)
    direct = rotated_at(keys, origin + slots + full, inv_freq, layout)
    exact = apply_reference(keys, (origin + slots + full)[:, None], inv_freq, layout=layout)
    to_direct, to_exact = BOUND[dtype]
    assert pair_ulps((got.double() - direct.double()).abs(), keys, rotary_dim, layout, dtype) <= to_direct
    assert pair_ulps((got.double() - exact).abs(), keys, rotary_dim, layout, dtype) <= to_exact
    assert torch.equal(got[..., rotary_dim:], from_format(before, tensor_format)[..., rotary_dim:])
    still = (full == 0)[:, None, :, None].expand_as(got)  # keys not moved (or by 0): the same bits
    assert torch.equal(got[still], from_format(before, tensor_format)[still])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_float64_caches_move_within_float32_tables(layout):
    gen = torch.Generator().manual_seed(1)
    inv_freq = base_inv_freq(D)
    keys = torch.randn(B, H, S, D, generator=gen, dtype=torch.float64)
    slots = torch.arange(S).expand(B, S)
    cache = apply_reference(keys, slots[:, None] + 500, inv_freq, layout=layout)
    ropekit.rerotate_cache(cache, -3, inv_freq=inv_freq, positions=torch.arange(3, S), layout=layout)
    want = apply_reference(keys, torch.where(slots >= 3, slots - 3, slots)[:, None] + 500, inv_freq, layout=layout)
    torch.testing.assert_close(cache, want, rtol=0, atol=1e-12)  # float64 angles of |delta|, float64 arithmetic


def test_tables_and_inv_freq_give_the_same_bits():
    gen = torch.Generator().manual_seed(2)
    inv_freq = base_inv_freq(D)
    cache = torch.randn(B, H, S, D, generator=gen).to(torch.bfloat16)
    by_tables, by_freq = cache.clone(), cache.clone()
    delta = torch.randint(-2, 3, (B, S - 4), generator=gen)
    cos_table, sin_table = cos_sin(torch.arange(64), inv_freq)
    ropekit.rerotate_cache(by_tables, delta, cos_table=cos_table, sin_table=sin_table, positions=torch.arange(2, S - 2))
    ropekit.rerotate_cache(by_freq, delta, inv_freq=inv_freq, positions=torch.arange(2, S - 2))
    assert torch.equal(by_tables, by_freq)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv_blocks", [False, True])
def test_paged_keys_move_through_the_block_table(backend, layout, kv_blocks):
    """Each sequence's keys at their slots (``slot_mapping``), padding skipped, other slots untouched.

    ``kv_blocks``: keys and values share each block (FlashInfer's ``(num_blocks, 2, block_size,
    kv_heads, head_dim)``), so the key cache's blocks do not merge into one axis of rows.
    """
    gen = torch.Generator().manual_seed(3)
    block_size, num_blocks, seq = 4, 16, 10
    inv_freq = base_inv_freq(D)
    block_table = torch.randperm(num_blocks, generator=gen)[: 2 * 3].reshape(2, 3)  # 12 positions per sequence
    keys = torch.randn(2 * seq, H, D, generator=gen).to(torch.bfloat16)
    positions = torch.arange(seq).expand(2, seq)
    slots = ropekit.slot_mapping(block_table, positions, block_size)
    k_cache = torch.randn(num_blocks, 2 if kv_blocks else 1, block_size, H, D, generator=gen).to(torch.bfloat16)[:, 0]
    assert k_cache.is_contiguous() != kv_blocks
    cos, sin = cos_sin(positions.reshape(-1), inv_freq)
    ropekit.rotate_into_cache(keys, torch.zeros_like(keys), cos[:, None], sin[:, None], k_cache,
                              torch.zeros_like(k_cache), slots, block_size=block_size, layout=layout)
    before = k_cache.clone()
    moved = torch.tensor([[2, 3, 4, 5, 6, 7, 8, 9], [0, 1, 2, 5, 6, -1, -1, -1]])
    delta = torch.tensor([[-2, -2, -2, -2, -2, -2, -2, -2], [1, 1, 1, 6, 5, 0, 0, 0]])
    ropekit.rerotate_cache(k_cache, delta, inv_freq=inv_freq, positions=moved, block_table=block_table,
                           layout=layout, backend=backend)
    new_positions = positions.clone()
    for b in range(2):
        for p, d in zip(moved[b].tolist(), delta[b].tolist(), strict=True):
            if p >= 0:
                new_positions[b, p] += d
    got = k_cache.reshape(-1, H, D)[slots]
    direct = ropekit.apply_rotary(keys, *(t[:, None] for t in cos_sin(new_positions.reshape(-1), inv_freq)),
                                  layout=layout)
    exact = apply_reference(keys, new_positions.reshape(-1, 1), inv_freq, layout=layout)
    assert pair_ulps((got.double() - direct.double()).abs(), keys, D, layout, torch.bfloat16) <= 1.0
    assert pair_ulps((got.double() - exact).abs(), keys, D, layout, torch.bfloat16) <= 1.25
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[(new_positions != positions).reshape(-1)]] = False
    assert torch.equal(k_cache.reshape(-1, H, D)[untouched], before.reshape(-1, H, D)[untouched])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tensor_format", ["bhsd", "bshd"])
@pytest.mark.parametrize("per_row", [False, True])
def test_context_shift_equals_recomputing_the_keys_at_their_new_positions(backend, tensor_format, per_row):
    """StreamingLLM: keep the sinks, drop the next tokens, move the rest left; keys as if rotated there."""
    gen = torch.Generator().manual_seed(4)
    inv_freq = base_inv_freq(D)
    n_keep, n_discard, length = 2, 5, 32
    lengths = torch.tensor([20, 13]) if per_row else 20
    keys = torch.randn(B, H, length, D, generator=gen).to(torch.bfloat16)
    k_cache = as_format(rotated_at(keys, torch.arange(length).expand(B, length), inv_freq, "half"), tensor_format)
    v_cache = as_format(torch.randn(B, H, length, D, generator=gen).to(torch.bfloat16), tensor_format)
    k_before, v_before = from_format(k_cache, tensor_format).clone(), from_format(v_cache, tensor_format).clone()
    cos_table, sin_table = cos_sin(torch.arange(length), inv_freq)
    new = ropekit.context_shift(k_cache, v_cache, n_keep, n_discard, lengths=lengths, cos_table=cos_table,
                                sin_table=sin_table, tensor_format=tensor_format, backend=backend)
    each = lengths.tolist() if per_row else [lengths] * B
    assert (new.tolist() if per_row else [new] * B) == [n - n_discard for n in each]
    k_after, v_after = from_format(k_cache, tensor_format), from_format(v_cache, tensor_format)
    for b, n in enumerate(each):
        kept = list(range(n_keep)) + list(range(n_keep + n_discard, n))
        m = len(kept)
        recomputed = rotated_at(keys[b:b + 1, :, kept], torch.arange(m)[None], inv_freq, "half")[0]
        err = (k_after[b, :, :m].double() - recomputed.double()).abs()
        assert pair_ulps(err, keys[b, :, kept], D, "half", torch.bfloat16) <= 1.0
        assert torch.equal(k_after[b, :, :n_keep], k_before[b, :, :n_keep])  # the sinks, bit for bit
        assert torch.equal(v_after[b, :, :m], v_before[b, :, kept])  # values moved as they were
        assert torch.equal(k_after[b, :, n:], k_before[b, :, n:])  # past the old length: untouched


def test_context_shift_by_inv_freq_and_nothing_to_move():
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(1, 1, 8, D, generator=gen)
    v_cache = torch.randn(1, 1, 8, D, generator=gen)
    before = k_cache.clone()
    assert ropekit.context_shift(k_cache, v_cache, 2, 6, lengths=8, inv_freq=base_inv_freq(D)) == 2
    assert torch.equal(k_cache, before)  # the sinks alone remain
    assert ropekit.context_shift(k_cache, v_cache, 2, 0, lengths=8, inv_freq=base_inv_freq(D)) == 8


# -- bad input: a ValueError / TypeError naming the argument, before anything is written ---------------

def _cache_and_tables(rows=S):
    cache = torch.randn(B, H, S, D)
    cos_table, sin_table = cos_sin(torch.arange(rows), base_inv_freq(D))
    return cache, dict(cos_table=cos_table, sin_table=sin_table)


@pytest.mark.parametrize("case, error, match", [
    ("below_zero", ValueError, "delta moves the key at position 1 of sequence 0 by -2 to -1, below 0"),
    ("past_tables", ValueError, "past the tables"),
    ("past_cache", ValueError, "past the cache"),
    ("delta_beyond_rows", ValueError, "delta of magnitude"),
    ("position_outside", ValueError, "positions must be slots of k_cache"),
    ("position_twice", ValueError, "positions: two keys"),
    ("shared_block", ValueError, "block_table: two keys"),
    ("float_delta", TypeError, "delta must be an integer tensor"),
    ("bool_delta", TypeError, "delta must be an int"),
    ("delta_shape", ValueError, "delta must be an int, or an integer tensor of shape"),
    ("float_positions", TypeError, "positions must be an integer tensor"),
    ("positions_shape", ValueError, "positions must have shape"),
    ("half_tables", TypeError, "cos_table must be float32 or float64"),
    ("scaled_tables", ValueError, "attention scale"),
    ("both_sources", ValueError, "exactly one of the two"),
    ("no_source", ValueError, "exactly one of the two"),
    ("one_table", ValueError, "cos_table and sin_table go together"),
    ("int_cache", TypeError, "k_cache must have a floating dtype"),
    ("cache_3d", ValueError, "k_cache must be 4-D"),
    ("expanded_cache", ValueError, "k_cache has elements that share memory"),
    ("alias", ValueError, "k_cache and cos_table share memory"),
    ("grad", ValueError, "k_cache requires grad"),
    ("format", ValueError, "tensor_format must be 'bhsd'"),
    ("format_paged", ValueError, "tensor_format must be None with block_table"),
    ("paged_no_positions", ValueError, "positions is required with block_table"),
    ("float_block_table", TypeError, "block_table must be an integer tensor"),
    ("block_past_table", ValueError, "positions reach block"),
    ("block_past_cache", ValueError, "block_table addresses slot"),
    ("wide_tables", ValueError, "rotary_dim = 32 exceeds k_cache's head_dim 16"),
    ("huge_delta", ValueError, "delta must lie within"),
    ("backend", ValueError, "backend"),
])
def test_bad_input_is_refused_before_anything_is_written(case, error, match):
    cache, tables = _cache_and_tables()
    kwargs = dict(tables)
    delta: object = 1
    if case == "below_zero":
        kwargs["positions"], delta = torch.tensor([1, 2]), -2
    elif case == "past_tables":
        delta = 1  # slot S - 1 would move to S, past S rows
    elif case == "past_cache":
        kwargs = dict(inv_freq=base_inv_freq(D))
    elif case == "delta_beyond_rows":
        cache = torch.randn(B, H, 3 * S, D)
        kwargs["positions"], delta = torch.tensor([2 * S]), -S - 2
    elif case == "position_outside":
        kwargs["positions"] = torch.tensor([0, S])
    elif case == "position_twice":
        kwargs["positions"] = torch.tensor([[1, 1], [2, 3]])
    elif case in ("shared_block", "block_past_table", "block_past_cache", "format_paged", "paged_no_positions",
                  "float_block_table"):
        cache = torch.randn(4, 4, H, D)
        table = {"shared_block": [[0, 1], [1, 2]], "block_past_cache": [[0, 1], [2, 7]]}.get(case, [[0, 1], [2, 3]])
        kwargs["block_table"] = torch.tensor(table, dtype=torch.float32 if case == "float_block_table" else None)
        positions = {"block_past_table": [[9], [0]], "block_past_cache": [[4, 5], [4, 5]]}.get(case, [[4, 5], [0, 1]])
        kwargs["positions"] = torch.tensor(positions)
        delta = 0
        if case == "format_paged":
            kwargs["tensor_format"] = "bhsd"
        if case == "paged_no_positions":
            del kwargs["positions"]
    elif case == "float_delta":
        delta = torch.tensor(1.0)
    elif case == "bool_delta":
        delta = True
    elif case == "delta_shape":
        delta = torch.zeros(3, dtype=torch.long)
    elif case == "float_positions":
        kwargs["positions"] = torch.tensor([0.0])
    elif case == "positions_shape":
        kwargs["positions"] = torch.zeros(3, 1, dtype=torch.long)
    elif case == "half_tables":
        kwargs = {n: t.half() for n, t in tables.items()}
    elif case == "scaled_tables":
        kwargs = {n: t * 1.1 for n, t in tables.items()}
    elif case == "both_sources":
        kwargs["inv_freq"] = base_inv_freq(D)
    elif case == "no_source":
        kwargs = {}
    elif case == "one_table":
        del kwargs["sin_table"]
    elif case == "int_cache":
        cache = torch.zeros(B, H, S, D, dtype=torch.int32)
    elif case == "cache_3d":
        cache = cache[0]
    elif case == "expanded_cache":
        cache = torch.randn(1, H, S, D).expand(B, H, S, D)
    elif case == "alias":
        buffer = torch.zeros(B * H * S * D + 2 * S * (D // 2))
        cache = buffer[: B * H * S * D].view(B, H, S, D)
        table = buffer[B * H * S * D - S * (D // 2):][: S * (D // 2)].view(S, D // 2)
        table[0].fill_(1.0)
        kwargs = dict(cos_table=table, sin_table=torch.zeros(S, D // 2))
    elif case == "grad":
        cache.requires_grad_(True)
    elif case == "format":
        kwargs["tensor_format"] = "sbhd"
    elif case == "wide_tables":
        kwargs = dict(inv_freq=base_inv_freq(2 * D))
    elif case == "huge_delta":
        delta = 2**70
    elif case == "backend":
        kwargs["backend"] = "triton-missing"
    before = cache.detach().clone()
    with pytest.raises(error, match=match):
        ropekit.rerotate_cache(cache, delta, **kwargs)
    assert torch.equal(cache.detach(), before)


@pytest.mark.parametrize("case, match", [
    ("short", "lengths: sequence 1 holds 6 tokens"),
    ("long", "lengths: sequence 0 holds 13 tokens"),
    ("negative", "n_discard must be an int >= 0"),
    ("rows", "n_discard = 5 needs row 5 of cos_table, which has 4 rows"),
    ("geometry", "k_cache and v_cache must hold the same sequences"),
    ("same", "k_cache and v_cache are the same tensor"),
    ("lengths_shape", "lengths must have shape"),
])
def test_context_shift_refuses_bad_input(case, match):
    k_cache, v_cache = torch.randn(B, H, S, D), torch.randn(B, H, S, D)
    cos_table, sin_table = cos_sin(torch.arange(4 if case == "rows" else S), base_inv_freq(D))
    args, kwargs = [k_cache, v_cache, 2, 5], dict(lengths=torch.tensor([10, 6]), cos_table=cos_table,
                                                  sin_table=sin_table)
    if case == "long":
        kwargs["lengths"] = torch.tensor([13, 10])
    elif case == "negative":
        args[3] = -1
    elif case == "rows":
        kwargs["lengths"] = 10
    elif case == "geometry":
        args[1] = torch.randn(B, H, S - 1, D)
    elif case == "same":
        args[1] = k_cache
    elif case == "lengths_shape":
        kwargs["lengths"] = torch.tensor([10])
    before = k_cache.clone()
    with pytest.raises(ValueError, match=match):
        ropekit.context_shift(*args, **kwargs)
    assert torch.equal(k_cache, before)
