"""``apply_rotary`` against the float64 matrix oracle ``apply_reference``, plus in-place and autograd.

The oracle multiplies each token by its explicit ``R(m Theta)`` (RoFormer eq. 15) in float64;
it shares nothing with the fast path but the frequencies (tested on their own in
``test_frequencies.py``).
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ropekit import apply_reference, apply_rotary, base_inv_freq, cos_sin, ops
from ropekit.ops import eager as torch_eager

LAYOUTS = ["half", "interleaved"]
EPS = {
    torch.float64: torch.finfo(torch.float64).eps,
    torch.float32: torch.finfo(torch.float32).eps,
    torch.bfloat16: torch.finfo(torch.bfloat16).eps,
    torch.float16: torch.finfo(torch.float16).eps,
}


def tables64(positions, inv_freq):
    """float64 tables computed here (not by ropekit.cos_sin) for the float64 path."""
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(torch.float64)
    return angles.cos(), angles.sin()


@st.composite
def rotary_cases(draw):
    """x of 1-4 leading dims (maybe non-contiguous), tables broadcast against x, positions for the oracle."""
    n_lead = draw(st.integers(1, 4))
    lead = [draw(st.integers(1, 3)) for _ in range(n_lead)]
    head_dim = draw(st.sampled_from([2, 4, 6, 8, 10, 16, 32]))
    rotary_dim = draw(st.sampled_from([r for r in range(2, head_dim + 1, 2)]))
    layout = draw(st.sampled_from(LAYOUTS))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]))
    memory = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    # table leading shape: right-aligned against x.shape[:-1], each axis either full or 1, maybe fewer axes
    n_table = draw(st.integers(1, n_lead))
    table_lead = [draw(st.sampled_from([n, 1])) for n in lead[n_lead - n_table:]]
    max_pos = draw(st.sampled_from([10, 1000, 10**6]))
    seed = draw(st.integers(0, 2**16))
    return lead, head_dim, rotary_dim, layout, dtype, memory, table_lead, max_pos, seed


def make_x(lead, head_dim, dtype, memory, generator):
    if memory == "transposed" and len(lead) >= 2:
        # allocate (..., s, h, d) and view it as (..., h, s, d)
        shape = lead[:-2] + [lead[-1], lead[-2], head_dim]
        x = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype).transpose(-2, -3)
    elif memory == "strided":
        x = torch.randn(lead + [2 * head_dim], generator=generator, dtype=torch.float64).to(dtype)[..., ::2]
    else:
        x = torch.randn(lead + [head_dim], generator=generator, dtype=torch.float64).to(dtype)
    assert list(x.shape) == lead + [head_dim]
    return x


def tolerance(dtype, x):
    scale = float(x.double().abs().max()) if x.numel() else 1.0
    if dtype == torch.float64:
        return 1e-12 * max(scale, 1.0)
    if dtype == torch.float32:
        return 8 * EPS[torch.float32] * max(scale, 1.0)
    return 2 * EPS[dtype] * max(scale, 1.0)


@given(case=rotary_cases())
def test_apply_matches_reference(case):
    lead, head_dim, rotary_dim, layout, dtype, memory, table_lead, max_pos, seed = case
    g = torch.Generator().manual_seed(seed)
    x = make_x(lead, head_dim, dtype, memory, g)
    inv_freq = base_inv_freq(rotary_dim)
    positions = torch.randint(0, max_pos, table_lead, generator=g)
    if dtype == torch.float64:
        cos, sin = tables64(positions, inv_freq)
    else:
        cos, sin = cos_sin(positions, inv_freq)
    x_before = x.clone()
    out = apply_rotary(x, cos, sin, layout=layout)
    ref = apply_reference(x, positions, inv_freq, layout=layout)

    assert out.shape == x.shape and out.dtype == dtype
    assert torch.equal(x, x_before), "out-of-place apply modified its input"
    err = (out.double() - ref).abs().max()
    assert err <= tolerance(dtype, x), f"max error {float(err)}"
    # partial rotary: the tail is copied bit for bit
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])

    # in place: same values, same object, same storage
    y = x.clone()
    ptr = y.data_ptr()
    res = apply_rotary(y, cos, sin, layout=layout, inplace=True)
    assert res is y and res.data_ptr() == ptr
    assert torch.equal(res, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "x_shape,table_shape,pos_view",
    [
        ((2, 3, 5, 16), (5,), (5,)),  # (b, h, s, d) with (s, r/2)
        ((2, 3, 5, 16), (2, 1, 5), (2, 1, 5)),  # (b, h, s, d) with (b, 1, s, r/2)
        ((2, 5, 16), (2, 5), (2, 5)),  # (b, s, d) with (b, s, r/2)
        ((2, 5, 3, 16), (2, 5, 1), (2, 5, 1)),  # (b, s, h, d) with (b, s, 1, r/2)
        ((7, 3, 16), (7, 1), (7, 1)),  # packed (tokens, h, d) with (tokens, 1, r/2)
    ],
)
def test_table_shapes(dtype, layout, x_shape, table_shape, pos_view):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(x_shape, generator=g, dtype=torch.float64).to(dtype)
    positions = torch.randint(0, 50000, table_shape, generator=g)
    inv_freq = base_inv_freq(12)  # partial rotary: 12 of 16 channels
    cos, sin = tables64(positions, inv_freq) if dtype == torch.float64 else cos_sin(positions, inv_freq)
    out = apply_rotary(x, cos, sin, layout=layout)
    ref = apply_reference(x, positions.reshape(pos_view), inv_freq, layout=layout)
    assert (out.double() - ref).abs().max() <= tolerance(dtype, x)
    assert torch.equal(out[..., 12:], x[..., 12:])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_oracle_against_python(layout):
    """The oracle itself: each token is R(m Theta) @ x with R built from math.cos/math.sin in the test."""
    import math

    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 10, generator=g, dtype=torch.float64)
    positions = torch.tensor([0, 17, 123456])
    thetas = [10000.0 ** (-(2 * i) / 6) for i in range(3)]  # rotary_dim 6 of 10
    got = apply_reference(x, positions, torch.tensor(thetas, dtype=torch.float64), layout=layout,
                          attention_scale=0.5)
    for row, m in enumerate(positions.tolist()):
        y = x[row].tolist()
        for i, theta in enumerate(thetas):
            a, b = (2 * i, 2 * i + 1) if layout == "interleaved" else (i, i + 3)
            c, s = math.cos(m * theta), math.sin(m * theta)
            y[a], y[b] = 0.5 * (c * x[row, a].item() - s * x[row, b].item()), 0.5 * (
                s * x[row, a].item() + c * x[row, b].item()
            )
        torch.testing.assert_close(got[row], torch.tensor(y, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_half_precision_is_rounded_once(dtype, layout):
    """Half-precision output is the float32 result rounded once: within half an ulp of the exact value.

    Half-precision arithmetic (products and sum rounded separately) fails this bound.
    """
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, 32, generator=g).to(dtype)
    positions = torch.arange(1000, 1064)
    inv_freq = base_inv_freq(32)
    cos, sin = cos_sin(positions, inv_freq)
    out = apply_rotary(x, cos, sin, layout=layout).double()
    ref = apply_reference(x, positions, inv_freq, layout=layout)
    unit_roundoff = EPS[dtype] / 2
    bound = unit_roundoff * ref.abs() * (1 + 1e-3) + 16 * EPS[torch.float32] + 2.0**-24
    assert bool(((out - ref).abs() <= bound).all())

    # the same bound rejects computing in the low precision itself
    x1, x2 = x[..., :16], x[..., 16:]
    c, s = cos.to(dtype), sin.to(dtype)
    naive = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).double()
    if layout == "half":
        assert not bool(((naive - ref).abs() <= bound).all())


def test_seed_worked_example_apply():
    """Seed 002 section 4: q=[1,0,0,1], d=4, base 10000, position 2."""
    q = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    cos, sin = cos_sin(torch.tensor([2]), base_inv_freq(4, 10000.0))
    inter = apply_rotary(q, cos, sin, layout="interleaved")[0]
    half = apply_rotary(q, cos, sin, layout="half")[0]
    torch.testing.assert_close(inter, torch.tensor([-0.4161, 0.9093, -0.0200, 0.9998]), atol=1e-4, rtol=0)
    torch.testing.assert_close(half, torch.tensor([-0.4161, -0.0200, 0.9093, 0.9998]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_seed_2d_score_via_apply_rotary(layout):
    """Seed 002: q=[1,2] at m=1, k=[3,4] at n=2, theta=1: score 7.62626733416533 in float64."""
    q = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    k = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    theta = torch.tensor([1.0], dtype=torch.float64)
    cq, sq = tables64(torch.tensor([1]), theta)
    ck, sk = tables64(torch.tensor([2]), theta)
    score = (apply_rotary(q, cq, sq, layout=layout) * apply_rotary(k, ck, sk, layout=layout)).sum()
    assert abs(float(score) - 7.62626733416533) < 1e-12


def test_inplace_on_view_writes_through_to_base():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(2, 5, 3, 8, generator=g)  # (b, s, h, d)
    view = base.transpose(1, 2)  # (b, h, s, d), non-contiguous
    positions = torch.arange(5) + 11
    inv_freq = base_inv_freq(8)
    cos, sin = cos_sin(positions, inv_freq)
    expected = apply_reference(view, positions, inv_freq)
    res = apply_rotary(view, cos, sin, inplace=True)
    assert res is view
    assert (base.transpose(1, 2).double() - expected).abs().max() < 1e-6
    assert (base.double() - expected.transpose(1, 2)).abs().max() < 1e-6


def test_out_of_place_keeps_strides_of_transposed_input():
    x = torch.randn(2, 5, 3, 8).transpose(1, 2)
    cos, sin = cos_sin(torch.arange(5), base_inv_freq(8))
    assert apply_rotary(x, cos, sin).stride() == x.stride()


@pytest.mark.parametrize("chunk", [1, 5, 24, 100])
@pytest.mark.parametrize("table_shape", ["seq", "batch_seq", "full"])
@pytest.mark.parametrize("inplace", [False, True])
def test_chunked_kernel_equals_unchunked(monkeypatch, chunk, table_shape, inplace):
    """The kernel splits big tensors along leading axes; every split must give the same bits."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 5, 12, generator=g)
    shape = {"seq": (5,), "batch_seq": (3, 1, 5), "full": (3, 4, 5)}[table_shape]
    positions = torch.randint(0, 500, shape, generator=g)
    cos, sin = cos_sin(positions, base_inv_freq(8))
    whole = apply_rotary(x, cos, sin, layout="interleaved")
    monkeypatch.setattr(torch_eager, "CHUNK_ELEMENTS", chunk)
    y = x.clone()
    split = apply_rotary(y, cos, sin, layout="interleaved", inplace=inplace)
    assert torch.equal(split, whole)
    ref = apply_reference(x, positions, base_inv_freq(8), layout="interleaved")
    assert (split.double() - ref).abs().max() < 1e-5


def test_empty_input():
    x = torch.empty(0, 3, 8)
    cos, sin = cos_sin(torch.arange(3), base_inv_freq(8))
    assert apply_rotary(x, cos, sin).shape == (0, 3, 8)


# -- autograd ------------------------------------------------------------------------------


def _problem(layout, rotary_dim, seed=0, shape=(2, 3, 4, 8)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    positions = torch.randint(0, 10**4, (shape[-2],), generator=g)
    cos, sin = tables64(positions, base_inv_freq(rotary_dim))
    return x, positions, cos, sin


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rotary_dim", [8, 4])
@pytest.mark.parametrize("inplace", [False, True])
def test_gradcheck(layout, rotary_dim, inplace):
    x, _, cos, sin = _problem(layout, rotary_dim)

    def f(t):
        if inplace:
            t = t * 1.0  # a non-leaf to rotate in place
        return apply_rotary(t, cos, sin, layout=layout, inplace=inplace)

    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rotary_dim", [8, 6])
@pytest.mark.parametrize("inplace", [False, True])
def test_gradgradcheck(layout, rotary_dim, inplace):
    """Double backward (create_graph=True: Hessian-vector products, gradient penalties) works."""
    x, _, cos, sin = _problem(layout, rotary_dim, seed=7, shape=(2, 5, 8))

    def f(t):
        if inplace:
            t = t * 1.0
        return apply_rotary(t, cos, sin, layout=layout, inplace=inplace)

    assert torch.autograd.gradgradcheck(f, (x,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("inplace", [False, True])
def test_gradcheck_learned_tables(layout, inplace):
    """Tables that require grad (learned frequencies): gradients reach x, cos and sin."""
    x, _, cos, sin = _problem(layout, 4, seed=4, shape=(2, 3, 6))
    cos = cos.clone().requires_grad_(True)
    sin = sin.clone().requires_grad_(True)

    def f(t, c, s):
        if inplace:
            t = t * 1.0
        return apply_rotary(t, c, s, layout=layout, inplace=inplace)

    assert torch.autograd.gradcheck(f, (x, cos, sin), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rotary_dim", [8, 6])
def test_backward_is_inverse_rotation(layout, rotary_dim):
    """d/dx sum(w * RoPE(x)) = R^T w = RoPE^{-1}(w), computed with the matrix oracle."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, 10, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 7, 10, generator=g, dtype=torch.float64)
    positions = torch.randint(0, 10**5, (7,), generator=g)
    inv_freq = base_inv_freq(rotary_dim)
    cos, sin = tables64(positions, inv_freq)
    (apply_rotary(x, cos, sin, layout=layout) * w).sum().backward()
    # R(m)^{-1} = R(-m): the reference evaluated on negated angles (inv_freq -> -inv_freq)
    expected = apply_reference(w, positions, -inv_freq, layout=layout)
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=1e-12)
    # sanity: the gradient is not the forward rotation
    forward = apply_reference(w, positions, inv_freq, layout=layout)
    assert (x.grad - forward).abs().max() > 1e-3


def test_backward_float32_matches_float64():
    g = torch.Generator().manual_seed(6)
    x64 = torch.randn(2, 4, 5, 16, generator=g, dtype=torch.float64)
    w = torch.randn(2, 4, 5, 16, generator=g, dtype=torch.float64)
    cos, sin = cos_sin(torch.arange(5) * 1000, base_inv_freq(16))
    grads = []
    for dtype in (torch.float32, torch.float64):
        x = x64.to(dtype).requires_grad_(True)
        (apply_rotary(x, cos.to(dtype), sin.to(dtype)) * w.to(dtype)).sum().backward()
        grads.append(x.grad.double())
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "torch", "cpu"])
def test_inplace_bumps_the_version_so_autograd_sees_the_change(backend):
    """A tensor saved for a backward pass, then rotated in place: backward must refuse, as after
    any in-place torch op (the native kernel writes through a raw pointer; the version is bumped
    by hand)."""
    if backend not in ("auto", *ops.available()):
        pytest.skip(f"backend {backend} unavailable")
    cos, sin = cos_sin(torch.arange(4), base_inv_freq(8))
    for _ in range(2):  # the second call takes the decode fast path
        w = torch.randn(2, 4, 8, requires_grad=True)
        q = torch.randn(2, 4, 8)
        loss = (q * w).sum()  # saves q for w's gradient
        before = q._version
        apply_rotary(q, cos, sin, inplace=True, backend=backend)
        assert q._version > before
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_repeated_call_takes_the_fast_path_and_still_checks_new_signatures(monkeypatch):
    from ropekit import functional
    from ropekit.ops import prepared

    cos, sin = cos_sin(torch.arange(3), base_inv_freq(8))
    x = torch.randn(2, 3, 8)
    prepared.clear()
    first = apply_rotary(x, cos, sin)
    real = functional.check_tables
    monkeypatch.setattr(functional, "check_tables", lambda *args: pytest.fail("checks ran again"))
    torch.testing.assert_close(apply_rotary(x, cos, sin), first, rtol=0, atol=0)  # fast path
    monkeypatch.setattr(functional, "check_tables", real)
    with pytest.raises(ValueError, match="do not broadcast"):  # another signature: checked
        apply_rotary(torch.randn(2, 4, 8), cos, sin)
    with pytest.raises(ValueError, match="layout"):
        apply_rotary(x, cos, sin, layout="spiral")
    x.requires_grad_(True)  # a gradient to record: the autograd path, not the fast one
    assert apply_rotary(x, cos, sin).grad_fn is not None
