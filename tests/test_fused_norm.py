"""The fused q/k RMSNorm + rotation against the unfused composition and the float64 oracle, on every backend.

Promises (``ropekit.rms_norm_rotary_qk``'s docstring), measured at the rotated pair's magnitude
(``fused_helpers.radius_ulps``): within 1 ulp of the unfused ``apply_rotary(F.rms_norm(...))``
for bfloat16/float16 and within 8 for float32; against the exact result of the same inputs at
least as close as the unfused composition (largest and mean error). Gradients against autograd
through the float64 composition. The Triton kernel runs in Triton's interpreter (tests/
test_fused_triton.py); here the C++ kernel (``cpu``) and the torch composite (``torch``).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ropekit
from fused_helpers import exact64, normalized64, radius_ulps, unfused
from ropekit import ops

torch.set_num_threads(1)

BACKENDS = [b for b in ("cpu", "torch") if b in ops.available()]
BOUND = {torch.bfloat16: 1.0, torch.float16: 1.0, torch.float32: 8.0}


def tables(rotary_dim, positions, dtype=torch.float32):
    inv_freq, _ = ropekit.inv_frequencies(rotary_dim, base=1e6)
    cos, sin = ropekit.cos_sin(positions, inv_freq)
    if dtype == torch.float64:  # float64 inputs rotate with float64 tables (the exact values)
        angles = positions.double()[..., None] * inv_freq
        cos, sin = angles.cos(), angles.sin()
    return inv_freq, cos, sin


@st.composite
def cases(draw):
    per_token = draw(st.booleans())
    head_dim = draw(st.sampled_from([16, 40, 64, 80, 128]))
    return dict(
        dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
        layout=draw(st.sampled_from(["half", "interleaved"])),
        per_token=per_token,
        head_dim=head_dim,
        rotary_dim=draw(st.sampled_from([head_dim, head_dim // 2 - (head_dim // 2) % 2])),
        heads=draw(st.integers(1, 5)),
        seq=draw(st.integers(1, 24)),
        weight=draw(st.sampled_from(["plain", "gemma", "none"])),
        scale=draw(st.sampled_from([1.0, 30.0, 1e-3])),
        start=draw(st.sampled_from([0, 100_000])),
        transposed=draw(st.booleans()),
        backend=draw(st.sampled_from(BACKENDS)),
        seed=draw(st.integers(0, 2**16)),
    )


def make(case):
    gen = torch.Generator().manual_seed(case["seed"])
    heads, seq, d = case["heads"], case["seq"], case["head_dim"]
    x = (torch.randn(2, seq, heads, d, generator=gen) * case["scale"]).to(case["dtype"])  # (batch, seq, heads, dim)
    weight_shape = (heads, d) if case["per_token"] else (d,)
    offset = 1.0 if case["weight"] == "gemma" else 0.0
    weight = None if case["weight"] == "none" else (
        torch.randn(weight_shape, generator=gen) * 0.3 + (0.0 if offset else 1.0)).to(case["dtype"])
    positions = torch.arange(seq) + case["start"]
    inv_freq, cos, sin = tables(case["rotary_dim"], positions)
    cos, sin = cos[:, None], sin[:, None]  # (seq, 1, half): broadcast over heads
    if case["transposed"] and not case["per_token"]:  # (batch, heads, seq, dim) view of the same storage
        x, cos, sin = x.transpose(1, 2), cos.transpose(0, 1), sin.transpose(0, 1)
    return x, weight, offset, cos, sin, positions, inv_freq


@settings(max_examples=80)
@given(cases())
def test_fused_equals_unfused_and_is_closer_to_the_exact_result(case):
    x, weight, offset, cos, sin, _, _ = make(case)
    norm = "per_token" if case["per_token"] else "per_head"
    options = dict(eps=1e-6, layout=case["layout"], weight_offset=offset)
    fused = ropekit.rms_norm_rotary(x, weight, cos, sin, norm=norm, backend=case["backend"], **options)
    reference = unfused(x, weight, cos, sin, per_token=case["per_token"], **options)
    exact = exact64(x, weight, cos, sin, per_token=case["per_token"], **options)
    y64 = normalized64(x, weight, eps=1e-6, weight_offset=offset, per_token=case["per_token"])
    assert fused.shape == x.shape and fused.dtype == x.dtype
    assert radius_ulps(fused, reference, y64, case["rotary_dim"], case["layout"]).max() <= BOUND[x.dtype]
    fused_error = radius_ulps(fused, exact, y64, case["rotary_dim"], case["layout"])
    unfused_error = radius_ulps(reference, exact, y64, case["rotary_dim"], case["layout"])
    assert fused_error.max() <= unfused_error.max()
    assert fused_error.mean() <= unfused_error.mean()
    if x.dtype != torch.float32:  # one rounding of a float32 value within a few float32 ulps of the exact one
        assert fused_error.max() <= 0.5 + 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_float64_matches_the_oracle_with_rotation_matrices(backend, per_token, layout):
    """float64 in, float64 out: the fused op is the norm followed by the paper's rotation matrices."""
    from fused_helpers import reference64

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 7, 4, 48, generator=gen, dtype=torch.float64)
    weight = torch.randn((4, 48) if per_token else (48,), generator=gen, dtype=torch.float64)
    positions = torch.arange(7)[:, None] * 13
    inv_freq, cos, sin = tables(32, positions, torch.float64)
    out = ropekit.rms_norm_rotary(x, weight, cos, sin, eps=1e-5, layout=layout, backend=backend,
                                  norm="per_token" if per_token else "per_head")
    want = reference64(x, weight, positions, inv_freq, eps=1e-5, layout=layout, per_token=per_token)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qk_pair_gqa_equals_one_tensor_each_and_inplace_equals_out_of_place(backend, dtype):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 8, 6, 64, generator=gen).to(dtype)
    k = torch.randn(2, 2, 6, 64, generator=gen).to(dtype)
    wq, wk = torch.randn(64, generator=gen).to(dtype), torch.randn(64, generator=gen).to(dtype)
    _, cos, sin = tables(64, torch.arange(6))
    q_in, k_in = q.clone(), k.clone()
    q_out, k_out = ropekit.rms_norm_rotary_qk(q, k, wq, wk, cos, sin, eps=1e-6, backend=backend)
    assert torch.equal(q, q_in) and torch.equal(k, k_in)  # inputs untouched out of place
    assert torch.equal(q_out, ropekit.rms_norm_rotary(q, wq, cos, sin, eps=1e-6, backend=backend))
    assert torch.equal(k_out, ropekit.rms_norm_rotary(k, wk, cos, sin, eps=1e-6, backend=backend))
    strided_q = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (b, s, h, d) storage
    q2, k2 = ropekit.rms_norm_rotary_qk(strided_q, k.clone(), wq, wk, cos, sin, eps=1e-6, inplace=True,
                                        backend=backend)
    assert q2.data_ptr() == strided_q.data_ptr() and torch.equal(q2, q_out) and torch.equal(k2, k_out)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("weight", ["plain", "gemma", "none"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_gradients_match_autograd_of_the_float64_composition(backend, per_token, weight, layout):
    gen = torch.Generator().manual_seed(9)
    d, heads = 40, 3
    x = torch.randn(2, 5, heads, d, generator=gen, dtype=torch.float64)
    offset = 1.0 if weight == "gemma" else 0.0
    w = None if weight == "none" else torch.randn((heads, d) if per_token else (d,), generator=gen,
                                                  dtype=torch.float64)
    _, cos, sin = tables(24, torch.arange(5), torch.float64)  # partial rotary: 24 of 40 channels
    cos, sin = cos[:, None], sin[:, None]
    norm = "per_token" if per_token else "per_head"
    grad_out = torch.randn(x.shape, generator=gen, dtype=torch.float64)

    def grads(fn):
        xr = x.clone().requires_grad_()
        wr = None if w is None else w.clone().requires_grad_()
        (fn(xr, wr) * grad_out).sum().backward()
        return xr.grad, (None if wr is None else wr.grad)

    got = grads(lambda a, b: ropekit.rms_norm_rotary(a, b, cos, sin, eps=1e-5, norm=norm, layout=layout,
                                                     weight_offset=offset, backend=backend))

    def composition(a, b):
        shape = (heads, d) if per_token else (d,)
        normed = torch.nn.functional.rms_norm(a, shape, None if b is None else b + offset, 1e-5)
        return ropekit.apply_rotary(normed, cos, sin, layout=layout, backend="torch")

    want = grads(composition)
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    if w is not None:
        torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_and_bfloat16_gradients_are_near_the_float64_ones(backend):
    gen = torch.Generator().manual_seed(3)
    x64 = torch.randn(2, 4, 6, 64, generator=gen, dtype=torch.float64)
    w64 = torch.randn(64, generator=gen, dtype=torch.float64)
    _, cos, sin = tables(64, torch.arange(6))
    grad_out = torch.randn(x64.shape, generator=gen, dtype=torch.float64)
    results = {}
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        x = x64.to(dtype).clone().requires_grad_()
        w = w64.to(dtype).clone().requires_grad_()
        c, s = (cos.double(), sin.double()) if dtype == torch.float64 else (cos, sin)
        out = ropekit.rms_norm_rotary_qk(x, x.detach().clone(), w, w.detach(), c, s, eps=1e-6, backend=backend)[0]
        (out * grad_out.to(dtype)).sum().backward()
        results[dtype] = (x.grad.double(), w.grad.double())
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for got, want in zip(results[dtype], results[torch.float64], strict=True):
            assert ((got - want).abs().max() / want.abs().max()) < tol


def test_gradcheck_on_the_cpu_kernel():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, 3, 2, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, generator=gen, dtype=torch.float64, requires_grad=True)
    _, cos, sin = tables(16, torch.arange(3), torch.float64)
    cos, sin = cos[:, None], sin[:, None]
    for backend in BACKENDS:
        assert torch.autograd.gradcheck(
            lambda a, b, backend=backend: ropekit.rms_norm_rotary(a, b, cos, sin, eps=1e-3, weight_offset=0.5,
                                                                  backend=backend), (x, w))


@pytest.mark.skipif("cpu" not in ops.available(), reason="C++ CPU kernel unavailable")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_results_do_not_depend_on_threads(dtype):
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(1, 16, 512, 128, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(128, generator=gen).to(dtype).requires_grad_()
    _, cos, sin = tables(128, torch.arange(512))
    runs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            q.grad = w.grad = None
            out = ropekit.rms_norm_rotary(q, w, cos, sin, eps=1e-6, backend="cpu")
            out.float().square().sum().backward()
            runs.append((out.detach(), q.grad.clone(), w.grad.clone()))
        finally:
            torch.set_num_threads(1)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_keeps_the_fused_operator_in_the_graph(backend):
    _, cos, sin = tables(32, torch.arange(5))
    q, k = torch.randn(2, 4, 5, 32), torch.randn(2, 2, 5, 32)
    w = torch.randn(32)
    targets = []

    def record(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    fn = torch.compile(lambda a, b: ropekit.rms_norm_rotary_qk(a, b, w, w, cos, sin, eps=1e-6, backend=backend),
                       fullgraph=True, backend=record)
    got = fn(q, k)
    assert any("ropekit.rms_norm_rotary_qk" in t for t in targets), targets
    for a, b in zip(got, ropekit.rms_norm_rotary_qk(q, k, w, w, cos, sin, eps=1e-6, backend=backend), strict=True):
        assert torch.equal(a, b)
