"""FP8 caches written by the Triton kernels (``ops/triton_fused.py``) in Triton's CPU interpreter.

The same oracles as tests/test_fp8_cache.py (tests/fp8_cases.py): bit for bit the one rounding of
the float32 rotation, inside the float64 reference's bracket, nothing else written. The kernel
rounds to the FP8 grid in float32 itself before the store: the interpreter's own float32 -> FP8
conversion does not carry a rounding into the exponent (125.6 -> 64 for e4m3) and turns NaN into
384, so the conversion a GPU does is not what is tested here; NaN keys are not tested here.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ropekit
from fp8_cases import Case, check_case
from fp8_helpers import FP8
from triton_interpreter import count_calls, import_interpreted

triton, (triton_fused,) = import_interpreted("ropekit.ops.triton_fused")

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def launches(monkeypatch):
    return count_calls(monkeypatch, triton_fused, "launch_norm_rotate")


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("norm", [None, "per_head"])
def test_triton_equals_the_one_rounding_oracle(paged, layout, norm, launches):
    check_case(Case(paged=paged, layout=layout, norm=norm, scale="per_head"), "triton")
    assert len(launches) == 2 and launches[0]["scale"] is not None  # the kernel ran, not a fallback


def test_triton_per_token_norm_and_mixed_caches(launches):
    check_case(Case(paged=True, norm="per_token", scale="tensor", v_cache_dtype=torch.bfloat16), "triton")
    assert len(launches) == 2 and launches[1]["scale"] is None


@settings(max_examples=10, deadline=None)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), k_fp8=st.sampled_from(FP8),
       v_fp8=st.sampled_from(FP8), layout=st.sampled_from(["half", "interleaved"]), paged=st.booleans(),
       scale=st.sampled_from(["none", "float", "per_head"]), first=st.sampled_from([0, 4093, 131_000]),
       magnitude=st.sampled_from([1e-3, 1.0, 30.0]), seed=st.integers(0, 2**16))
def test_triton_hypothesis_cases(dtype, k_fp8, v_fp8, layout, paged, scale, first, magnitude, seed):
    check_case(Case(dtype=dtype, k_cache_dtype=k_fp8, v_cache_dtype=v_fp8, layout=layout, paged=paged, scale=scale,
                    first=first, magnitude=magnitude, seed=seed, batch=2, heads=2, seq=3), "triton")


@pytest.mark.parametrize("fp8", FP8)
def test_triton_saturates_and_rounds_subnormals(fp8):
    """Every float32 magnitude class at once: saturation, normals, subnormals, signed zeros."""
    signs = (-1.0) ** torch.arange(124)
    values = torch.cat([torch.tensor([1e30, -1e30, 0.0, -0.0]), torch.logspace(-12, 6, 124, base=2.0) * signs])
    k = values.reshape(1, 1, 1, 128).expand(1, 2, 1, 128).contiguous()
    cos, sin = torch.ones(1, 1, 1, 0), torch.zeros(1, 1, 1, 0)
    k_cache = torch.zeros(1, 2, 2, 128, dtype=fp8)
    v_cache = torch.zeros(1, 2, 2, 128, dtype=fp8)
    scale = torch.tensor([0.75, 3.0])
    ropekit.rotate_into_cache(k, k.clone(), cos, sin, k_cache, v_cache, 1, backend="triton", k_scale=scale,
                              v_scale=scale)
    limit = torch.finfo(fp8).max
    want = (k / scale.view(1, 2, 1, 1)).clamp(-limit, limit).to(fp8)
    assert torch.equal(k_cache[:, :, 1:].view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(v_cache[:, :, 1:].view(torch.uint8), want.view(torch.uint8))
