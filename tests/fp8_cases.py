"""One FP8 cache write checked against every oracle (a helper shared by the CPU and Triton tests, not a test).

``check_case`` builds keys, values, tables and sentinel-filled caches, calls
``ropekit.rotate_into_cache`` on one backend and asserts:

- the written key entries equal, bit for bit, the one-rounding oracle of the float32 rotation
  (``fp8(clamp(y32 / scale))`` with ``y32`` from ``ropekit.apply_rotary`` / ``rms_norm_rotary`` of
  ``k.float()`` on the eager backend, which every kernel matches bit for bit in float32);
- they lie in the bracket of the float64 rotation-matrix reference (equal to its one rounding
  wherever a few float32 ulps cannot straddle an FP8 rounding boundary, which is nearly everywhere);
- the values are ``fp8(clamp(v.float() / v_scale))`` (or v itself in a cache of v's dtype);
- every other entry (other positions, padding slots) keeps its sentinel bits; k and v are unchanged.
"""

from dataclasses import dataclass

import torch

import ropekit
from fp8_helpers import FP8, bracket, keys64, one_rounding

SENTINEL = 7.0  # exact in every cache dtype


@dataclass
class Case:
    dtype: torch.dtype = torch.bfloat16
    k_cache_dtype: torch.dtype = torch.float8_e4m3fn
    v_cache_dtype: torch.dtype = torch.float8_e4m3fn
    layout: str = "half"
    paged: bool = False
    norm: str | None = None  # None, "per_head" or "per_token" (paged only)
    scale: str = "float"  # "none", "float", "tensor" (0-d) or "per_head"
    batch: int = 2
    heads: int = 3
    seq: int = 3
    head_dim: int = 20  # partial rotary: 16 of 20 channels
    first: int = 0  # first position
    magnitude: float = 1.0
    seed: int = 0


def bits(t):
    return t.contiguous().view(torch.uint8)


def scale_of(case, gen, cache_dtype, name):
    if cache_dtype not in FP8 or case.scale == "none":
        return None, 1.0
    values = (torch.rand(case.heads, generator=gen) * 2 + 0.05) * case.magnitude / 4
    if case.scale == "float":
        return float(values[0]), float(values[0])
    if case.scale == "tensor":
        return values[0].clone(), values[0].clone()
    return values.clone(), values.clone()


def scatter(cache, entries, slots, case):
    """``entries`` (k's shape) written into ``cache`` where the call writes them (a plain-indexing copy)."""
    if not case.paged:
        for b, first in enumerate(slots):
            cache[b, :, first:first + case.seq] = entries[b]
        return cache
    block_size = cache.shape[1]
    for t, slot in enumerate(slots):
        if slot >= 0:
            cache[slot // block_size, slot % block_size] = entries[t]
    return cache


def gather(cache, slots, case):
    """The entries the call wrote, in k's shape (padding tokens: their rows of zeros)."""
    if not case.paged:
        return torch.stack([cache[b, :, first:first + case.seq] for b, first in enumerate(slots)])
    block_size = cache.shape[1]
    rows = [cache[s // block_size, s % block_size] if s >= 0 else torch.zeros_like(cache[0, 0]) for s in slots]
    return torch.stack(rows)


def build(case):
    gen = torch.Generator().manual_seed(case.seed)
    h, d, rotary = case.heads, case.head_dim, 16
    inv_freq, _ = ropekit.inv_frequencies(rotary, base=10000.0)
    if not case.paged:
        shape = (case.batch, h, case.seq, d)
        length = case.seq + 5
        starts = [(3 * b + 1) % 6 for b in range(case.batch)]
        positions = torch.tensor(starts)[:, None] + torch.arange(case.seq) + case.first  # (batch, seq)
        cos, sin = ropekit.cos_sin(positions, inv_freq)
        cos, sin = cos[:, None], sin[:, None]
        ref_positions = positions[:, None, :]
        cache_shape = (case.batch, h, length, d)
        slots_arg, slots = torch.tensor(starts), starts
        block_size = None
    else:
        tokens, block_size, blocks = case.batch * case.seq, 4, case.batch * case.seq
        shape = (tokens, h, d)
        perm = torch.randperm(blocks * block_size, generator=gen)[:tokens]
        perm[0] = -1  # a padding token
        slots = perm.tolist()
        positions = torch.arange(tokens) + case.first
        cos, sin = ropekit.cos_sin(positions, inv_freq)
        cos, sin = cos[:, None], sin[:, None]
        ref_positions = positions[:, None]
        cache_shape = (blocks, block_size, h, d)
        slots_arg = perm
    k = (torch.randn(shape, generator=gen) * case.magnitude).to(case.dtype)
    v = (torch.randn(shape, generator=gen) * case.magnitude).to(case.dtype)
    weight = (torch.rand((h, d) if case.norm == "per_token" else (d,), generator=gen) + 0.5) if case.norm else None
    k_scale, k_scale_copy = scale_of(case, gen, case.k_cache_dtype, "k")
    v_scale, v_scale_copy = scale_of(case, gen, case.v_cache_dtype, "v")
    return dict(k=k, v=v, cos=cos, sin=sin, inv_freq=inv_freq, ref_positions=ref_positions, cache_shape=cache_shape,
                slots_arg=slots_arg, slots=slots, block_size=block_size, weight=weight, k_scale=k_scale,
                v_scale=v_scale, k_scale_copy=k_scale_copy, v_scale_copy=v_scale_copy)


def own_float32(case, k, cos, sin, weight):
    """The keys rotated (normalised) in float32 on the eager backend: the x every kernel quantises."""
    if case.norm is None:
        return ropekit.apply_rotary(k.float(), cos, sin, layout=case.layout, backend="torch")
    return ropekit.rms_norm_rotary(k.float(), weight, cos, sin, eps=1e-6, norm=case.norm, layout=case.layout,
                                   backend="torch")


def check_case(case, backend):
    """Run the case on ``backend``; assert every property of the module docstring. Returns the k cache."""
    p = build(case)
    k, v = p["k"], p["v"]
    k_cache = torch.full(p["cache_shape"], SENTINEL).to(case.k_cache_dtype)
    v_cache = torch.full(p["cache_shape"], SENTINEL).to(case.v_cache_dtype)
    k_in, v_in = k.clone(), v.clone()
    ropekit.rotate_into_cache(k, v, p["cos"], p["sin"], k_cache, v_cache, p["slots_arg"], layout=case.layout,
                              k_weight=p["weight"], eps=1e-6 if case.norm else None, norm=case.norm or "per_head",
                              block_size=p["block_size"], backend=backend, k_scale=p["k_scale"],
                              v_scale=p["v_scale"])
    assert torch.equal(k, k_in) and torch.equal(v, v_in)
    y32 = own_float32(case, k, p["cos"], p["sin"], p["weight"])
    if case.k_cache_dtype in FP8:
        want_k = one_rounding(y32, p["k_scale_copy"], case.k_cache_dtype)
    else:
        want_k = y32.to(case.k_cache_dtype)
    if case.v_cache_dtype in FP8:
        want_v = one_rounding(v.float(), p["v_scale_copy"], case.v_cache_dtype)
    else:
        want_v = v
    sentinel_k = torch.full(p["cache_shape"], SENTINEL).to(case.k_cache_dtype)
    sentinel_v = torch.full(p["cache_shape"], SENTINEL).to(case.v_cache_dtype)
    assert torch.equal(bits(k_cache), bits(scatter(sentinel_k, want_k, p["slots"], case))), "keys"
    assert torch.equal(bits(v_cache), bits(scatter(sentinel_v, want_v, p["slots"], case))), "values (or sentinels)"
    if case.k_cache_dtype in FP8:  # the float64 rotation-matrix reference: the same entries up to its bracket
        y64, tol = keys64(k, p["ref_positions"], p["inv_freq"], layout=case.layout, eps=1e-6 if case.norm else None,
                          weight=p["weight"], per_token=case.norm == "per_token")
        low, high = bracket(y64, tol, p["k_scale_copy"], case.k_cache_dtype)
        got = gather(k_cache, p["slots"], case).double()
        keep = torch.ones_like(got, dtype=torch.bool)
        if case.paged:
            keep[torch.tensor(p["slots"]) < 0] = False
        assert bool(((got >= low) & (got <= high) | ~keep).all()), "outside the float64 reference's bracket"
        exact = (low == high) & keep
        assert int(exact.sum()) >= 0.95 * int(keep.sum()), "the bracket is too wide to test anything"
    return k_cache
