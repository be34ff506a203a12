"""The fused Triton kernels (``ops/triton_fused.py``) in Triton's CPU interpreter, and compiled for sm_90.

Same oracles as tests/test_fused_norm.py. Triton's interpreter rounds float32 to bfloat16/float16
by truncation where a GPU rounds to nearest: up to one more ulp, so the 16-bit bound here is 2 ulps
at the pair's magnitude (1 on a GPU); float32 keeps its bound of 8.
"""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ropekit
from fused_helpers import exact64, normalized64, radius_ulps, unfused
from triton_interpreter import count_calls, import_interpreted

triton, (triton_fused,) = import_interpreted("ropekit.ops.triton_fused")

torch.set_num_threads(1)
BOUND = {torch.bfloat16: 2.0, torch.float16: 2.0, torch.float32: 8.0}


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def launches(monkeypatch):
    """Count the fused kernel's launches (a fallback to the composite launches nothing)."""
    return count_calls(monkeypatch, triton_fused, "launch_norm_rotate")


def tables(rotary_dim, positions):
    inv_freq, _ = ropekit.inv_frequencies(rotary_dim, base=1e6)
    return ropekit.cos_sin(positions, inv_freq)


@settings(max_examples=20)
@given(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), st.sampled_from(["half", "interleaved"]),
       st.booleans(), st.sampled_from([(32, 32), (40, 24), (64, 64)]), st.sampled_from(["plain", "gemma", "none"]),
       st.booleans(), st.integers(0, 2**16))
def test_fused_triton_equals_unfused(dtype, layout, per_token, dims, weight_kind, transposed, seed):
    gen = torch.Generator().manual_seed(seed)
    head_dim, rotary_dim = dims
    x = (torch.randn(2, 5, 3, head_dim, generator=gen) * 4).to(dtype)
    offset = 1.0 if weight_kind == "gemma" else 0.0
    weight = None if weight_kind == "none" else torch.randn((3, head_dim) if per_token else (head_dim,),
                                                            generator=gen).to(dtype)
    cos, sin = tables(rotary_dim, torch.arange(5) + 50)
    cos, sin = cos[:, None], sin[:, None]
    if transposed and not per_token:
        x, cos, sin = x.transpose(1, 2), cos.transpose(0, 1), sin.transpose(0, 1)
    options = dict(eps=1e-6, layout=layout, weight_offset=offset)
    got = ropekit.rms_norm_rotary(x, weight, cos, sin, norm="per_token" if per_token else "per_head",
                                  backend="triton", **options)
    want = unfused(x, weight, cos, sin, per_token=per_token, **options)
    y64 = normalized64(x, weight, eps=1e-6, weight_offset=offset, per_token=per_token)
    assert radius_ulps(got, want, y64, rotary_dim, layout).max() <= BOUND[dtype]
    if dtype == torch.float32:  # no truncation: as close to the exact result as the composition
        exact = exact64(x, weight, cos, sin, per_token=per_token, **options)
        assert radius_ulps(got, exact, y64, rotary_dim, layout).mean() <= radius_ulps(
            want, exact, y64, rotary_dim, layout).mean()


def test_pair_inplace_and_gradients_run_the_kernels(launches):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 6, 32, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, 6, 32, generator=gen, dtype=torch.float64)
    wq, wk = torch.randn(32, generator=gen, dtype=torch.float64), torch.randn(32, generator=gen, dtype=torch.float64)
    cos, sin = tables(32, torch.arange(6))
    grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)

    def run(backend, dtype):
        leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, wq, wk)]
        out = ropekit.rms_norm_rotary_qk(*leaves[:2], *leaves[2:], cos, sin, eps=1e-6, weight_offset=1.0,
                                         backend=backend)
        ((out[0] * grad_q.to(dtype)).sum() + (out[1] * grad_k.to(dtype)).sum()).backward()
        return [o.detach().double() for o in out] + [t.grad.double() for t in leaves]

    got, want = run("triton", torch.float32), run("torch", torch.float64)
    assert len(launches) == 2  # q and k, the forward on the kernel
    for a, b in zip(got, want, strict=True):
        assert ((a - b).abs().max() / b.abs().max()) < 1e-5
    inplace = [t.to(torch.float32) for t in (q, k)]
    ropekit.rms_norm_rotary_qk(*inplace, wq.float(), wk.float(), cos, sin, eps=1e-6, weight_offset=1.0,
                               inplace=True, backend="triton")
    for a, b in zip(inplace, got[:2], strict=True):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=0)


def test_backward_kernel_matches_the_composite(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 7, 3, 40, generator=gen)
    w = torch.randn(3, 40, generator=gen)
    grad = torch.randn(x.shape, generator=gen)
    cos, sin = tables(24, torch.arange(7))
    cos, sin = cos[:, None], sin[:, None]
    calls = []
    real = triton_fused.launch_backward
    monkeypatch.setattr(triton_fused, "launch_backward", lambda *a, **k: calls.append(1) or real(*a, **k))
    options = dict(eps=1e-5, weight_offset=0.0, per_token=True, layout="interleaved")
    got = ropekit.ops.get("triton").rms_norm_rotary_backward(grad, x, w, cos, sin, **options)
    want = ropekit.ops.get("torch").rms_norm_rotary_backward(grad.double(), x.double(), w.double(), cos.double(),
                                                             sin.double(), **options)
    assert calls
    for a, b in zip(got, want, strict=True):
        assert ((a.double() - b).abs().max() / b.abs().max()) < 1e-5


@pytest.mark.parametrize("kind", ["int", "per_row", "paged"])
@pytest.mark.parametrize("norm", [None, "per_head", "per_token"])
def test_cache_write_on_the_kernel_equals_the_composite(kind, norm, launches):
    gen = torch.Generator().manual_seed(3)
    if kind == "paged":
        k = torch.randn(5, 2, 32, generator=gen)
        slots, block_size = torch.tensor([9, 10, -1, 3, 0]), 4
        cos, sin = tables(32, torch.arange(5))
        cos, sin = cos[:, None], sin[:, None]
        shape = (3, 4, 2, 32)
    else:
        k = torch.randn(2, 2, 3, 32, generator=gen)
        slots, block_size = (4 if kind == "int" else torch.tensor([1, 5])), None
        cos, sin = tables(32, torch.arange(3))
        shape = (2, 2, 8, 32)
    v = torch.randn(k.shape, generator=gen)
    weight = None if norm is None else torch.randn((2, 32) if norm == "per_token" else (32,), generator=gen)
    options = dict(block_size=block_size, k_weight=weight, eps=None if norm is None else 1e-6,
                   norm=norm or "per_head")
    results = []
    for backend in ("triton", "torch"):
        k_cache, v_cache = torch.full(shape, 7.0), torch.full(shape, 7.0)
        ropekit.rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slots, backend=backend, **options)
        results.append((k_cache, v_cache))
    assert len(launches) == 2  # keys, then values, on the kernel
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    assert torch.equal(results[0][1], results[1][1])
    with pytest.raises(ValueError, match="slots"):
        bad = torch.tensor([0, 12, 1, 2, 3]) if kind == "paged" else 6
        ropekit.rotate_into_cache(k, v, cos, sin, *results[0], bad, backend="triton", **options)


COMPILE_SCRIPT = r"""
import inspect, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from ropekit.ops import triton_fused

forward, backward = triton_fused._jit(False)
pointers = dict(X="*bf16", OUT="*bf16", GRAD="*bf16", GRAD_X="*bf16", COS="*fp32", SIN="*fp32", GAINS="*fp32",
                SLOTS="*i64", PARTIAL="*fp32", SCALE="*fp32")
unscaled = dict(SCALED=False, FP8_MAX=0.0, MANT=0, EMIN=0)
forward_flags = [dict(INTERLEAVED=i, NORM=True, PER_TOKEN=p, HAS_GAINS=True, DEST=d, HAS_SLOTS=d > 0, INT64=i,
                      **unscaled) for i in (False, True) for p in (False, True) for d in (0, 1, 2)]
forward_flags.append(dict(INTERLEAVED=False, NORM=False, PER_TOKEN=False, HAS_GAINS=False, DEST=2, HAS_SLOTS=True,
                          INT64=False, **unscaled))
for out, limit, mant, emin in (("*fp8e4nv", 448.0, 3, -6), ("*fp8e5", 57344.0, 2, -14)):  # FP8 caches
    for d in (1, 2):
        forward_flags.append(dict(INTERLEAVED=False, NORM=True, PER_TOKEN=False, HAS_GAINS=True, DEST=d,
                                  HAS_SLOTS=True, INT64=False, SCALED=True, FP8_MAX=limit, MANT=mant, EMIN=emin,
                                  OUT_TYPE=out))
backward_flags = [dict(INTERLEAVED=i, PER_TOKEN=p, HAS_GAINS=g, INT64=i) for i in (False, True)
                  for p in (False, True) for g in (False, True)]
count = 0
for kernel, source, flag_sets in ((forward, triton_fused._forward_kernel, forward_flags),
                                  (backward, triton_fused._backward_kernel, backward_flags)):
    names = list(inspect.signature(source).parameters)
    for flags in flag_sets:
        flags = dict(flags)
        types = dict(pointers, OUT=flags.pop("OUT_TYPE", pointers["OUT"]))
        constants = dict(BLOCK_S=4, BLOCK_H=8 if flags["PER_TOKEN"] else 1, BLOCK_R=64, BLOCK_T=1, **flags)
        signature = {n: types.get(n, "constexpr" if n in constants else "fp32" if n == "eps" else "i32")
                     for n in names}
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
        except (RuntimeError, OSError) as exc:
            if "ptxas" in str(exc):
                print("SKIP no ptxas"); sys.exit(0)
            raise
        assert compiled.asm["ptx"]
        count += 1
print("compiled", count)
"""


def test_fused_kernels_compile_for_sm90(tmp_path):
    """The interpreter accepts code the compiler rejects: compile ahead of time for sm_90, no GPU needed.

    In a fresh process: triton.language imported under the interpreter (as this module does)
    cannot compile kernels that call its standard library (``tl.sum``).
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    if done.stdout.startswith("SKIP"):
        pytest.skip(done.stdout)
    assert done.stdout.split() == ["compiled", "25"]  # 21 kernels, 4 of them again into FP8 caches


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fused_kernels_match_the_cpu(monkeypatch, launches):
    """On a GPU (rounding to nearest): within 1 ulp at the pair's magnitude of the unfused composition."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(11)
    q = (torch.randn(2, 64, 8, 128, generator=gen) * 3).to(torch.bfloat16)
    k = (torch.randn(2, 64, 2, 128, generator=gen) * 3).to(torch.bfloat16)
    wq = torch.randn(128, generator=gen).to(torch.bfloat16)
    wk = torch.randn(128, generator=gen).to(torch.bfloat16)
    cos, sin = tables(128, torch.arange(64))
    cos, sin = cos[:, None], sin[:, None]
    got = ropekit.rms_norm_rotary_qk(q.cuda(), k.cuda(), wq.cuda(), wk.cuda(), cos.cuda(), sin.cuda(), eps=1e-6,
                                     weight_offset=1.0)
    assert launches
    for x, w, out in ((q, wq, got[0]), (k, wk, got[1])):
        want = unfused(x, w, cos, sin, eps=1e-6, layout="half", weight_offset=1.0)
        y64 = normalized64(x, w, eps=1e-6, weight_offset=1.0)
        assert radius_ulps(out.cpu(), want, y64, 128, "half").max() <= 1.0
    k_cache, v_cache = torch.zeros(2, 2, 96, 128, device="cuda"), torch.zeros(2, 2, 96, 128, device="cuda")
    kt, vt = k.float().transpose(1, 2).cuda(), k.float().transpose(1, 2).cuda()
    ropekit.rotate_into_cache(kt, vt, cos.transpose(0, 1).cuda(), sin.transpose(0, 1).cuda(), k_cache, v_cache,
                              torch.tensor([0, 32], device="cuda"))
    want = ropekit.apply_rotary(kt.cpu(), cos.transpose(0, 1), sin.transpose(0, 1))
    torch.testing.assert_close(k_cache[0, :, :64].cpu(), want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_cache[1, :, 32:].cpu(), want[1], rtol=1e-6, atol=1e-6)


def test_jitted_kernels_know_their_constexpr_arguments(monkeypatch):
    """A launch on a GPU compiles the tile sizes and flags as constants: the jitted copies of the kernels
    must keep the ``tl.constexpr`` annotations (tl.arange needs them), which a bare function copy drops."""
    from ropekit.ops import triton_kernel

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for jitted, source in ((triton_fused._jit(False)[0], triton_fused._forward_kernel),
                           (triton_fused._jit(False)[1], triton_fused._backward_kernel),
                           (triton_kernel._jit(False), triton_kernel._rotary_kernel)):
        annotated = {name for name, kind in source.__annotations__.items() if "constexpr" in str(kind)}
        assert annotated and {jitted.arg_names[i] for i in jitted.constexprs} == annotated
