"""FP8 KV caches: ``rotate_into_cache`` into ``float8_e4m3fn`` / ``float8_e5m2`` caches with vLLM's scales.

The convention (vLLM ``csrc/quantization/fp8/nvidia/quant_utils.cuh``, ``scaled_vec_conversion``
to ``uint8_t``: ``__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, ...)``, used by
``reshape_and_cache_flash`` in ``csrc/cache_kernels.cu``): an entry is ``fp8(clamp(x / scale,
-max, max))`` (a division, saturated to the largest finite value), read back as ``float(q) *
scale``. Here ``x`` is the rotated key in float32, rounded once to FP8.

Oracles (tests/fp8_cases.py, tests/fp8_helpers.py): the one-rounding formula written with torch
ops on the eager float32 rotation (bit for bit: the kernels' float32 results equal it), the
float64 rotation-matrix reference (equal up to a bracket of a few float32 ulps), and vLLM's own
test reference for ``reshape_and_cache_flash`` ported to pure torch.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ropekit
from fp8_cases import SENTINEL, Case, bits, build, check_case
from fp8_helpers import FP8, FP8_MAX, convert_fp8_back, vllm_reference_cache
from ropekit import ops
from ropekit.fused.cache_scales import dequantize_cache

torch.set_num_threads(1)
BACKENDS = [b for b in ("cpu", "torch") if b in ops.available()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("norm", [None, "per_head"])
def test_every_layout_and_norm_equals_the_one_rounding_oracle(backend, paged, layout, norm):
    check_case(Case(paged=paged, layout=layout, norm=norm, scale="per_head"), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_token_norm_over_the_heads_paged(backend):
    check_case(Case(paged=True, norm="per_token", scale="tensor"), backend)


@settings(max_examples=25, deadline=None)
@given(backend=st.sampled_from(BACKENDS), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       k_fp8=st.sampled_from(FP8), v_fp8=st.sampled_from(FP8), layout=st.sampled_from(["half", "interleaved"]),
       paged=st.booleans(), norm=st.sampled_from([None, "per_head"]),
       scale=st.sampled_from(["none", "float", "tensor", "per_head"]), batch=st.integers(1, 3),
       heads=st.integers(1, 4), seq=st.integers(1, 5), first=st.sampled_from([0, 7, 4093, 131_000]),
       magnitude=st.sampled_from([1e-3, 1.0, 30.0]), seed=st.integers(0, 2**16))
def test_hypothesis_cases_equal_the_oracles(backend, dtype, k_fp8, v_fp8, layout, paged, norm, scale, batch, heads,
                                            seq, first, magnitude, seed):
    check_case(Case(dtype=dtype, k_cache_dtype=k_fp8, v_cache_dtype=v_fp8, layout=layout, paged=paged, norm=norm,
                    scale=scale, batch=batch, heads=heads, seq=seq, first=first, magnitude=magnitude, seed=seed),
               backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k_dtype, v_dtype", [(torch.float8_e4m3fn, torch.bfloat16),
                                              (torch.bfloat16, torch.float8_e5m2)])
def test_one_cache_fp8_the_other_in_the_input_dtype(backend, k_dtype, v_dtype):
    check_case(Case(k_cache_dtype=k_dtype, v_cache_dtype=v_dtype, paged=True, scale="per_head"), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", FP8)
def test_no_double_rounding_through_the_input_dtype(backend, fp8):
    """A key whose float32 rotation lies just above an FP8 midpoint, and rounds to bfloat16 exactly on it.

    Table entry ``c = m/2 + 2^-13`` (sin 0), key channel 1.0 (bfloat16), scale 0.5: the rotated key is
    ``c`` in float32 and ``2c = m + 2^-12`` is the quotient, which rounds up in one rounding; through
    bfloat16 (spacing 2^-8 at c) it becomes ``m/2`` exactly, a tie that rounds to even: down.
    """
    mid = 1.0625 if fp8 == torch.float8_e4m3fn else 1.125  # midpoints of the grid in [1, 2): 1 + 2^-4, 1 + 2^-3
    up = 1.125 if fp8 == torch.float8_e4m3fn else 1.25
    c = mid / 2 + 2.0**-13
    heads, d = 2, 8
    k = torch.zeros(1, heads, 1, d, dtype=torch.bfloat16)
    k[..., 0] = 1.0
    cos = torch.full((1, 1, 1, d // 2), c, dtype=torch.float32)
    sin = torch.zeros_like(cos)
    quotient = torch.tensor(c, dtype=torch.float32) / 0.5
    assert float(quotient.to(fp8)) == up  # one rounding: up
    assert float((torch.tensor(c).bfloat16().float() / 0.5).to(fp8)) == 1.0  # through bfloat16: down (the trap)
    k_cache = torch.zeros(1, heads, 4, d, dtype=fp8)
    v_cache = torch.zeros(1, heads, 4, d, dtype=fp8)
    ropekit.rotate_into_cache(k, torch.zeros_like(k), cos, sin, k_cache, v_cache, 2, backend=backend, k_scale=0.5)
    assert k_cache[0, :, 2, 0].float().tolist() == [up] * heads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", FP8)
def test_saturation_at_the_largest_finite_value(backend, fp8):
    limit = FP8_MAX[fp8]
    k = torch.tensor([1e30, -1e30, 3 * limit, -3 * limit, 0.5 * limit, 1.0, -0.0, 0.0]).reshape(1, 1, 1, 8)
    k = k.expand(1, 2, 1, 8).clone()
    cos, sin = torch.ones(1, 1, 1, 0), torch.zeros(1, 1, 1, 0)  # rotary_dim 0: the keys as they are
    k_cache = torch.zeros(1, 2, 2, 8, dtype=fp8)
    v_cache = torch.zeros(1, 2, 2, 8, dtype=fp8)
    ropekit.rotate_into_cache(k, k.clone(), cos, sin, k_cache, v_cache, 1, backend=backend, k_scale=2.0,
                              v_scale=torch.tensor([1.0, 4.0]))
    want_k = [limit, -limit, limit, -limit, float((torch.tensor(0.25 * limit)).to(fp8)), 0.5, -0.0, 0.0]
    assert k_cache[0, 0, 1].float().tolist() == want_k
    assert not k_cache.float().isnan().any() and not v_cache.float().isinf().any()
    assert v_cache[0, 0, 1, :4].float().tolist() == [limit, -limit, limit, -limit]
    assert v_cache[0, 1, 1, 4].float().item() == float(torch.tensor(0.5 * limit / 4).to(fp8))
    assert torch.signbit(k_cache[0, 0, 1, 6].float()) and not torch.signbit(k_cache[0, 0, 1, 7].float())


@pytest.mark.parametrize("backend", BACKENDS)
def test_vllm_reference_agrees(backend):
    """vLLM's ``test_reshape_and_cache_flash`` reference (ported, tests/fp8_helpers.py) on our paged write.

    vLLM scatters its key (already rotated, in the model dtype) into a float16 clone and compares it
    with the FP8 cache read back, ``atol=1e-3, rtol=0.1``, per-tensor scale ``amax / 64``; here the
    key is the rotated one, from the float64 reference.
    """
    case = Case(paged=True, scale="tensor", batch=4, seq=4, heads=4, head_dim=32, dtype=torch.float16)
    p = build(case)
    k, v = p["k"], p["v"]
    rotated = ropekit.apply_reference(k.double()[..., :16], p["ref_positions"].expand(k.shape[:-1]), p["inv_freq"])
    key = torch.cat((rotated, k.double()[..., 16:]), -1)
    k_scale = (key.abs().amax() / 64.0).float()
    v_scale = (v.float().abs().amax() / 64.0).float()
    slots = p["slots_arg"].clone()
    slots[0] = 5  # vLLM's slot mapping has no padding
    k_cache = torch.zeros(p["cache_shape"], dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros(p["cache_shape"], dtype=torch.float8_e4m3fn)
    if int(slots[0]) in slots[1:].tolist():
        slots[0] = int(torch.tensor([s for s in range(k_cache.shape[0] * 4) if s not in slots.tolist()][0]))
    ropekit.rotate_into_cache(k, v, p["cos"], p["sin"], k_cache, v_cache, slots, block_size=4, backend=backend,
                              k_scale=k_scale, v_scale=v_scale)
    want_k = vllm_reference_cache(key, slots, p["cache_shape"], 4, k_scale, torch.float8_e4m3fn)
    want_v = vllm_reference_cache(v, slots, p["cache_shape"], 4, v_scale, torch.float8_e4m3fn)
    torch.testing.assert_close(convert_fp8_back(k_cache, k_scale), want_k, atol=0.001, rtol=0.1)
    torch.testing.assert_close(convert_fp8_back(v_cache, v_scale), want_v, atol=0.001, rtol=0.1)
    # and ropekit's reader agrees with vLLM's convert_fp8 (up to its float16 rounding)
    torch.testing.assert_close(dequantize_cache(k_cache, k_scale, torch.float16, block_size=4),
                               convert_fp8_back(k_cache, k_scale), atol=0, rtol=0)


@pytest.mark.parametrize("paged", [False, True])
def test_dequantize_cache_per_head(paged):
    gen = torch.Generator().manual_seed(3)
    heads = 3
    scale = torch.tensor([0.5, 2.0, 0.125])
    shape = (4, 2, heads, 8) if paged else (2, heads, 4, 8)
    cache = (torch.randn(shape, generator=gen) * 10).to(torch.float8_e5m2)
    got = dequantize_cache(cache, scale, block_size=2 if paged else None)
    axis = 2 if paged else 1
    for h in range(heads):
        want = cache.select(axis, h).float() * float(scale[h])
        assert torch.equal(got.select(axis, h), want)
    assert got.dtype == torch.float32
    assert torch.equal(dequantize_cache(cache, 0.5), cache.float() * 0.5)
    assert dequantize_cache(cache, 1.0, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
@pytest.mark.parametrize("bad, error", [(0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                        (float("inf"), ValueError), (1e-50, ValueError), (1e50, ValueError),
                                        ("zero", ValueError), ("nan_head", ValueError), ("shape", ValueError),
                                        (True, TypeError), ("int_tensor", TypeError)])
def test_bad_scales_raise_naming_the_argument_before_writing(backend, name, bad, error):
    k = torch.randn(1, 2, 1, 8)
    cos, sin = torch.ones(1, 1, 1, 4), torch.zeros(1, 1, 1, 4)
    k_cache = torch.full((1, 2, 3, 8), SENTINEL).to(torch.float8_e4m3fn)
    v_cache = k_cache.clone()
    bad = {"zero": torch.tensor(0.0), "nan_head": torch.tensor([1.0, float("nan")]), "shape": torch.ones(3),
           "int_tensor": torch.tensor([1, 2])}.get(bad, bad) if isinstance(bad, str) else bad
    with pytest.raises(error, match=name):
        ropekit.rotate_into_cache(k, k.clone(), cos, sin, k_cache, v_cache, 0, backend=backend, **{name: bad})
    assert (k_cache.float() == SENTINEL).all() and (v_cache.float() == SENTINEL).all()


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_a_scale_for_a_cache_that_is_not_fp8_raises(name):
    k = torch.randn(1, 2, 1, 8)
    cos, sin = torch.ones(1, 1, 1, 4), torch.zeros(1, 1, 1, 4)
    caches = torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match=f"{name} is given but {name[0]}_cache is torch.float32"):
        ropekit.rotate_into_cache(k, k.clone(), cos, sin, *caches, 0, **{name: 1.0})


def test_float64_keys_into_fp8_raise():
    k = torch.randn(1, 2, 1, 8, dtype=torch.float64)
    cos, sin = torch.ones(1, 1, 1, 4), torch.zeros(1, 1, 1, 4)
    caches = torch.zeros(1, 2, 3, 8, dtype=torch.float8_e4m3fn), torch.zeros(1, 2, 3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="FP8 k_cache takes k of dtype float32, bfloat16 or float16"):
        ropekit.rotate_into_cache(k, k.clone(), cos, sin, *caches, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_values_into_a_float64_cache_beside_fp8_keys(backend):
    """Each cache on its own: FP8 keys beside float64 values (copied bit for bit, never through float32)."""
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(2, 2, 1, 8, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(2, 2, 1, 8, generator=gen, dtype=torch.float64) * (1 + 2.0**-40)
    cos, sin = torch.ones(2, 1, 1, 4), torch.zeros(2, 1, 1, 4)  # angle 0: the keys stay as they are
    k_cache = torch.full((2, 2, 4, 8), SENTINEL).to(torch.float8_e4m3fn)
    v_cache = torch.full((2, 2, 4, 8), SENTINEL, dtype=torch.float64)
    ropekit.rotate_into_cache(k, v, cos, sin, k_cache, v_cache, 1, k_scale=0.5, backend=backend)
    assert torch.equal(v_cache[:, :, 1:2], v) and (v_cache[:, :, [0, 2, 3]] == SENTINEL).all()
    assert torch.equal(bits(k_cache[:, :, 1:2]), bits((k.float() / 0.5).to(torch.float8_e4m3fn)))


@pytest.mark.skipif("cpu" not in ops.available(), reason="the C++ kernel is not built here")
def test_cpu_operator_refuses_a_float64_cache_before_writing_the_other():
    """The C++ entry point stores from float32: a float64 cache is refused before the FP8 keys are written."""
    from ropekit.ops import dispatch

    module = dispatch.get("cpu").module
    k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8, dtype=torch.float64)
    cos, sin = torch.ones(1, 1, 1, 4), torch.zeros(1, 1, 1, 4)
    k_cache = torch.zeros(1, 2, 3, 8, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros(1, 2, 3, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="caches of dtype float8_e4m3fn, float8_e5m2, bfloat16, float16 or float32"):
        module.rotate_into_cache_scaled(k, v, cos, sin, k_cache, v_cache, None, 0, None, None, 0.0, False, 0, False,
                                        torch.ones(2), None)
    assert not bits(k_cache).any() and not v_cache.any()


def test_dequantize_cache_bad_input():
    cache = torch.zeros(2, 2, 2, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="cache must be a float8"):
        dequantize_cache(cache.float(), 1.0)
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        dequantize_cache(cache, 0.0)
    with pytest.raises(ValueError, match="scale must have shape"):
        dequantize_cache(cache, torch.ones(3))
    with pytest.raises(ValueError, match="block_size"):
        dequantize_cache(cache, 1.0, block_size=3)
    with pytest.raises(TypeError, match="dtype"):
        dequantize_cache(cache, 1.0, torch.int32)


@pytest.mark.skipif("cpu" not in ops.available(), reason="the C++ kernel is not built here")
def test_cpu_operator_checks_its_scales_itself():
    """The C++ entry point is reachable through torch.ops: it checks the scales it indexes by."""
    from ropekit.ops import dispatch

    module = dispatch.get("cpu").module
    k = torch.randn(1, 2, 1, 8)
    cos, sin = torch.ones(1, 1, 1, 4), torch.zeros(1, 1, 1, 4)
    k_cache = torch.zeros(1, 2, 3, 8, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros(1, 2, 3, 8, dtype=torch.float8_e4m3fn)
    args = (k, k.clone(), cos, sin, k_cache, v_cache, None, 0, None, None, 0.0, False, 0, False)
    for k_scale, message in ((torch.ones(1), "k_scale must be a float32 CPU tensor of shape"),
                             (torch.tensor([1.0, 0.0]), "k_scale must be finite and > 0"),
                             (None, "k_scale: an FP8 cache needs a scale")):
        with pytest.raises(ValueError, match=message):
            module.rotate_into_cache_scaled(*args, k_scale, torch.ones(2))
    assert not bits(k_cache).any()


def _dense_float32_sample(fp8: torch.dtype) -> torch.Tensor:
    """Float32 values where a conversion to ``fp8`` can go wrong, both signs, as a 1-D tensor.

    Every finite FP8 value and every midpoint between neighbours (the rounding boundaries, ties
    included), each with its float32 neighbours up to 4 ulps either side; the float32 subnormals'
    and normals' ends, zeros, infinities, NaNs with several payloads, values past the largest FP8
    value; and 2**16 random bit patterns.
    """
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].sort().values.double()
    mids = (grid[1:] + grid[:-1]) / 2
    beyond = torch.tensor([FP8_MAX[fp8] * 1.0625, FP8_MAX[fp8] * 1.125, FP8_MAX[fp8] * 2, 1e30, 3.4028234663852886e38])
    anchors = torch.cat([grid, mids, beyond]).float().view(torch.int32)
    near = (anchors[:, None] + torch.arange(-4, 5, dtype=torch.int32)).reshape(-1)
    special = torch.tensor([0, 1, 2, 0x007FFFFF, 0x00800000, 0x00800001, 0x7F7FFFFF, 0x7F800000, 0x7F800001,
                            0x7FC00000, 0x7FFFFFFF], dtype=torch.int32)
    gen = torch.Generator().manual_seed(11)
    random = torch.randint(-2**31, 2**31, (2**16,), dtype=torch.int64, generator=gen).to(torch.int32)
    positive = torch.cat([near[near >= 0], special])
    return torch.cat([positive, positive | torch.tensor(-2**31, dtype=torch.int32), random]).view(torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", FP8)
def test_store_conversion_equals_torch_on_a_dense_sample_of_float32(backend, fp8):
    """The kernels' own float32 -> FP8 store (branch-free in C++) gives torch's ``.to()`` of the clamped value.

    The values go in as v with a scale of 1 (no rotation, an exact division): every entry must be
    ``clamp(x, -max, max).to(fp8)`` bit for bit, NaN included.
    """
    x = _dense_float32_sample(fp8)
    heads, d = 4, 64
    n = -(-x.numel() // (heads * d)) * heads * d
    x = torch.cat([x, torch.zeros(n - x.numel())]).reshape(1, heads, -1, d)
    k = torch.zeros_like(x)
    cos, sin = torch.ones(x.shape[2], d // 2), torch.zeros(x.shape[2], d // 2)
    k_cache = torch.zeros(1, heads, x.shape[2], d, dtype=fp8)
    v_cache = torch.zeros(1, heads, x.shape[2], d, dtype=fp8)
    ropekit.rotate_into_cache(k, x, cos, sin, k_cache, v_cache, 0, k_scale=1.0, v_scale=1.0, backend=backend)
    want = x.clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8)
    assert torch.equal(v_cache.view(torch.uint8), want.view(torch.uint8))
