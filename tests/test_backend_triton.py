"""The Triton backend against the float64 oracle, run in Triton's CPU interpreter.

``TRITON_INTERPRET=1`` must be in the environment before triton is imported; the
interpreter is slow, so shapes stay small. The kernel itself is also compiled ahead of
time for sm_90 (no GPU needed) so that code the interpreter accepts but the compiler
would reject is caught here; ``test_cuda_*`` runs the real kernel where a GPU exists.
"""

import importlib.util
import inspect
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ropekit
from ropekit import apply_reference, base_inv_freq, cos_sin
from triton_interpreter import count_calls, import_interpreted

triton, (triton_rotary,) = import_interpreted("ropekit.ops.triton_kernel")

torch.set_num_threads(1)

LAYOUTS = ("half", "interleaved")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TABLE_ROWS = 64


class triton_api:  # noqa: N801 - the Triton backend's forms through the public API and the operators
    """``apply_rotary``/``rotate_qk`` on ``backend="triton"`` (``conjugate`` through the operators)."""

    @staticmethod
    def apply_rotary(x, cos, sin, *, layout, conjugate=False, inplace=False):
        if conjugate:
            return torch.ops.ropekit.apply_rotary(x, cos, sin, layout, True, "triton")
        return ropekit.apply_rotary(x, cos, sin, layout=layout, inplace=inplace, backend="triton")

    @staticmethod
    def rotate_qk(q, k, cos, sin, *, positions=None, offsets=0, cu_seqlens=None, max_seqlen=None, seq_dim, layout,
                  conjugate=False, inplace=False):
        if not conjugate:
            return ropekit.rotate_qk(q, k, cos, sin, positions=positions, offsets=offsets, cu_seqlens=cu_seqlens,
                                     max_seqlen=max_seqlen, seq_dim=seq_dim, layout=layout, inplace=inplace,
                                     backend="triton")
        offset, offsets_t = (offsets, None) if isinstance(offsets, int) else (0, offsets.reshape(-1))
        args = (cos, sin, positions, offsets_t, offset, cu_seqlens, max_seqlen, seq_dim, layout, True, "triton")
        if inplace:
            torch.ops.ropekit.rotate_qk_(q, k, *args)
            return q, k
        return torch.ops.ropekit.rotate_qk(q, k, *args)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def launches(monkeypatch):
    """Count kernel launches."""
    return count_calls(monkeypatch, triton_rotary, "launch")


def tables(rotary_dim, rows=TABLE_ROWS, device="cpu"):
    inv_freq = base_inv_freq(rotary_dim)
    cos, sin = cos_sin(torch.arange(rows, device=device), inv_freq)
    return inv_freq, cos, sin


def assert_matches(out, x, positions, inv_freq, layout, *, negate=False):
    """``out`` equals the float64 rotation of ``x`` within the rounding of ``out.dtype``.

    One ulp of ``out.dtype`` plus float32 arithmetic: GPUs round float32 -> bfloat16 to
    nearest (half an ulp), but Triton's interpreter truncates, which costs up to one ulp.
    """
    ref = apply_reference(x, positions.cpu(), -inv_freq if negate else inv_freq, layout=layout)
    err = (out.detach().cpu().double() - ref).abs()
    eps = torch.finfo(out.dtype).eps
    bound = eps * ref.abs() + 8 * torch.finfo(torch.float32).eps * x.detach().abs().max().double().cpu() + 1e-30
    assert out.shape == x.shape and out.dtype == x.dtype
    assert (err <= bound).all(), f"max error {err.max():.3g} (bound {bound.max():.3g}) for {out.dtype}"


def make_qk(form, batch, seq, heads_q, heads_k, head_dim, dtype, gen):
    """q, k in ``form``, their seq_dim, and how to view per-token (batch, seq) positions against them."""
    shape = {"bshd": lambda h: (batch, seq, h, head_dim), "bhsd": lambda h: (batch, seq, h, head_dim),
             "packed": lambda h: (seq, h, head_dim)}[form]
    q, k = (torch.randn(shape(h), generator=gen).to(dtype) for h in (heads_q, heads_k))
    if form == "bhsd":  # a transposed view of (b, s, h, d) storage: arbitrary strides, no copy
        return q.transpose(1, 2), k.transpose(1, 2), 2, lambda p: p.reshape(batch, 1, seq)
    if form == "packed":
        return q, k, 0, lambda p: p.reshape(seq, 1)
    return q, k, 1, lambda p: p.reshape(batch, seq, 1)


# -- the backend contract: rotate(x, cos, sin) ------------------------------------------------------
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rotate_contract_matches_reference(layout, dtype, inplace):
    gen = torch.Generator().manual_seed(1)
    inv_freq, cos, sin = tables(24)
    x = torch.randn(2, 8, 3, 40, generator=gen).to(dtype).transpose(1, 2)  # (b, h, s, d) view
    x0 = x.clone()
    c, s = cos[3:11].reshape(1, 1, 8, 12), sin[3:11].reshape(1, 1, 8, 12)
    out = triton_api.apply_rotary(x, c, s, layout=layout, inplace=inplace)
    assert (out is x) == inplace
    assert_matches(out, x0, torch.arange(3, 11).reshape(1, 1, 8), inv_freq, layout)
    assert torch.equal(out[..., 24:], x0[..., 24:])


@pytest.mark.parametrize("case", ["packed", "expanded_tables", "qkv_slice", "five_dims", "per_head_tables"])
def test_rotate_contract_strides(case, launches):
    gen = torch.Generator().manual_seed(2)
    inv_freq, cos, sin = tables(16)
    if case == "packed":
        x, pos = torch.randn(10, 3, 16, generator=gen), torch.arange(10).reshape(10, 1)
    elif case == "expanded_tables":
        x, pos = torch.randn(2, 5, 3, 20, generator=gen), torch.arange(5).reshape(1, 5, 1).expand(2, 5, 3)
    elif case == "qkv_slice":
        x, pos = torch.randn(2, 6, 3 * 20, generator=gen).unflatten(-1, (3, 20))[:, :, 1], torch.arange(6).reshape(1, 6)
    elif case == "five_dims":
        # positions vary along axes 0 and 2 only: no two leading axes merge, axis 0 is looped
        x, pos = torch.randn(2, 3, 2, 5, 20, generator=gen), torch.randint(0, 64, (2, 1, 2, 1), generator=gen)
    else:
        x, pos = torch.randn(2, 4, 3, 20, generator=gen), (torch.arange(4).reshape(1, 4, 1) * 3 + torch.arange(3))
    pos = pos.expand(x.shape[:-1]) if case == "expanded_tables" else pos
    c, s = cos[pos], sin[pos]  # gathered: (..., 8), fancy-indexing keeps expanded positions' shape
    out = triton_api.apply_rotary(x, c, s, layout="interleaved")
    assert_matches(out, x, pos, inv_freq, "interleaved")
    assert len(launches) == (2 if case == "five_dims" else 1)


def test_apply_rotary_through_backend_registry():
    inv_freq, cos, sin = tables(16)
    x = torch.randn(1, 2, 6, 16, requires_grad=True)
    out = ropekit.apply_rotary(x, cos[:6], sin[:6], layout="half", backend="triton")
    assert_matches(out, x, torch.arange(6).reshape(1, 1, 6), inv_freq, "half")
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    assert_matches(grad, torch.ones_like(x), torch.arange(6).reshape(1, 1, 6), inv_freq, "half", negate=True)


# -- rotate_qk ------------------------------------------------------------------------------------
@settings(max_examples=15)
@given(
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from(DTYPES),
    form=st.sampled_from(["bshd", "bhsd", "packed"]),
    head_dim=st.sampled_from([8, 40, 64]),
    rotary_frac=st.floats(0.01, 1.0),
    heads=st.sampled_from([(1, 1), (3, 1), (4, 2), (2, 3)]),
    batch=st.integers(1, 2),
    seq=st.integers(1, 12),
    mode=st.sampled_from(["default", "int_offset", "tensor_offsets", "positions_1d", "positions_2d"]),
    inplace=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rotate_qk_matches_reference(layout, dtype, form, head_dim, rotary_frac, heads, batch, seq, mode, inplace,
                                     seed):
    gen = torch.Generator().manual_seed(seed)
    batch = 1 if form == "packed" else batch
    rotary_dim = max(2, int(rotary_frac * head_dim) // 2 * 2)
    inv_freq, cos, sin = tables(rotary_dim)
    q, k, seq_dim, view = make_qk(form, batch, seq, *heads, head_dim, dtype, gen)
    kwargs, pos = {}, torch.arange(seq).expand(batch, seq)
    if mode == "int_offset":
        kwargs["offsets"] = 17
        pos = pos + 17
    elif mode == "tensor_offsets":
        kwargs["offsets"] = torch.randint(0, 40, (batch,), generator=gen)
        pos = pos + kwargs["offsets"][:, None]
    elif mode == "positions_1d":
        kwargs["positions"] = torch.randint(0, TABLE_ROWS, (seq,), generator=gen)
        pos = kwargs["positions"].expand(batch, seq)
    elif mode == "positions_2d":
        pos = kwargs["positions"] = torch.randint(0, TABLE_ROWS, (batch, seq), generator=gen)
    q0, k0 = q.clone(), k.clone()
    q_out, k_out = triton_api.rotate_qk(q, k, cos, sin, seq_dim=seq_dim, layout=layout, inplace=inplace, **kwargs)
    assert (q_out is q and k_out is k) == inplace
    assert_matches(q_out, q0, view(pos), inv_freq, layout)
    assert_matches(k_out, k0, view(pos), inv_freq, layout)
    assert q_out.stride() == q.stride()  # the output keeps q's layout (dense inputs)
    if not inplace:
        assert torch.equal(q, q0) and torch.equal(k, k0)


@pytest.mark.parametrize("heads_k", [1, 2])
def test_gqa_q_and_k_in_one_launch(heads_k, launches):
    gen = torch.Generator().manual_seed(3)
    inv_freq, cos, sin = tables(24)
    q, k, seq_dim, view = make_qk("bshd", 2, 7, 4, heads_k, 40, torch.bfloat16, gen)
    q_out, k_out = triton_api.rotate_qk(q, k, cos, sin, seq_dim=seq_dim, layout="half", offsets=5)
    assert len(launches) == 1
    pos = view(torch.arange(5, 12).expand(2, 7))
    assert_matches(q_out, q, pos, inv_freq, "half")
    assert_matches(k_out, k, pos, inv_freq, "half")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_varlen_matches_each_sequence_alone(layout, launches):
    gen = torch.Generator().manual_seed(4)
    inv_freq, cos, sin = tables(24)
    cu_seqlens = torch.tensor([0, 3, 3, 10, 16], dtype=torch.int32)
    q, k = torch.randn(16, 3, 40, generator=gen).half(), torch.randn(16, 1, 40, generator=gen).half()
    offsets = torch.tensor([0, 9, 2, 30])
    q_out, k_out = triton_api.rotate_qk(q, k, cos, sin, offsets=offsets, cu_seqlens=cu_seqlens, seq_dim=0,
                                        layout=layout)
    assert len(launches) == 1 and launches[0]["seqlen"] == 7  # max_seqlen computed from cu_seqlens
    pos = torch.cat([torch.arange(n) + int(o) for n, o in zip(cu_seqlens.diff(), offsets, strict=True)])
    assert_matches(q_out, q, pos.reshape(16, 1), inv_freq, layout)
    assert_matches(k_out, k, pos.reshape(16, 1), inv_freq, layout)
    for b in range(4):
        lo, hi = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        alone = triton_api.rotate_qk(q[lo:hi], k[lo:hi], cos, sin, offsets=int(offsets[b]), seq_dim=0, layout=layout)
        assert torch.equal(alone[0], q_out[lo:hi]) and torch.equal(alone[1], k_out[lo:hi])
    # per-token positions and an explicit max_seqlen take the same path
    q2, _ = triton_api.rotate_qk(q, k, cos, sin, positions=pos, cu_seqlens=cu_seqlens, max_seqlen=8, seq_dim=0,
                                 layout=layout, inplace=True)
    assert torch.equal(q2, q_out)


def test_out_of_range_positions_are_caught_before_launch(launches):
    inv_freq, cos, sin = tables(8, rows=16)
    q, k = torch.randn(2, 6, 2, 8), torch.randn(2, 6, 1, 8)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    packed = torch.randn(12, 2, 8)
    bad = [
        dict(positions=torch.tensor([0, 1, 2, 3, 4, 16])),
        dict(positions=torch.tensor([0, 1, 2, -1, 4, 5])),
        dict(offsets=11),
        dict(offsets=torch.tensor([0, 11])),
        dict(offsets=torch.tensor([-1, 0])),
    ]
    for kwargs in bad:
        with pytest.raises(ValueError, match="positions"):
            triton_api.rotate_qk(q, k, cos, sin, seq_dim=1, layout="half", **kwargs)
    with pytest.raises(ValueError, match="positions"):
        triton_api.rotate_qk(packed, packed, cos, sin, cu_seqlens=cu, offsets=torch.tensor([0, 10]), seq_dim=0,
                             layout="half")
    for bad_cu in ([0, 5, 11], [1, 5, 12], [0, 7, 5, 12]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            triton_api.rotate_qk(packed, packed, cos, sin, cu_seqlens=torch.tensor(bad_cu, dtype=torch.int32),
                                 seq_dim=0, layout="half")
    with pytest.raises(ValueError, match="max_seqlen"):
        triton_api.rotate_qk(packed, packed, cos, sin, cu_seqlens=cu, max_seqlen=5, seq_dim=0, layout="half")
    assert launches == []


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (dict(k=torch.randn(2, 6, 1, 8).half()), TypeError),
        (dict(seq_dim=-1), ValueError),
        (dict(seq_dim=3), ValueError),
        (dict(cos=torch.zeros(16, 5), sin=torch.zeros(16, 5)), ValueError),
        (dict(positions=torch.arange(6), offsets=2), ValueError),
        (dict(positions=torch.arange(6.0)), TypeError),
        (dict(positions=torch.arange(5)), ValueError),
        (dict(offsets=torch.tensor([1, 2, 3])), ValueError),
        (dict(cu_seqlens=torch.tensor([0, 6], dtype=torch.int32)), ValueError),
        (dict(layout="spiral"), ValueError),
        (dict(q="same", inplace=True), ValueError),
    ],
)
def test_bad_arguments_raise(change, error):
    _, cos, sin = tables(8, rows=16)
    args = dict(q=torch.randn(2, 6, 2, 8), k=torch.randn(2, 6, 1, 8), cos=cos, sin=sin, seq_dim=1, layout="half")
    args.update(change)
    if isinstance(args["q"], str):
        args["q"] = args["k"]
    q, k, cos, sin = (args.pop(name) for name in ("q", "k", "cos", "sin"))
    with pytest.raises(error):
        triton_api.rotate_qk(q, k, cos, sin, **args)


def test_inplace_on_a_fused_qkv_view_writes_only_its_window():
    gen = torch.Generator().manual_seed(5)
    inv_freq, cos, sin = tables(24)
    qkv = torch.randn(2, 5, 3, 2, 40, generator=gen).bfloat16()  # (b, s, {q,k,v}, h, d)
    before = qkv.clone()
    q, k = qkv[:, :, 0], qkv[:, :, 1]
    out = triton_api.rotate_qk(q, k, cos, sin, seq_dim=1, layout="interleaved", inplace=True)
    assert out[0].data_ptr() == q.data_ptr() and out[1].data_ptr() == k.data_ptr()
    pos = torch.arange(5).reshape(1, 5, 1)
    assert_matches(qkv[:, :, 0], before[:, :, 0], pos, inv_freq, "interleaved")
    assert_matches(qkv[:, :, 1], before[:, :, 1], pos, inv_freq, "interleaved")
    assert torch.equal(qkv[:, :, 2], before[:, :, 2])  # v untouched
    assert torch.equal(qkv[..., 24:], before[..., 24:])  # the tail past rotary_dim untouched


@pytest.mark.parametrize("layout", LAYOUTS)
def test_conjugate_undoes_the_rotation(layout):
    gen = torch.Generator().manual_seed(6)
    _, cos, sin = tables(30)
    q, k = torch.randn(1, 3, 9, 32, generator=gen), torch.randn(1, 1, 9, 32, generator=gen)
    rq, rk = triton_api.rotate_qk(q, k, cos, sin, offsets=20, seq_dim=2, layout=layout)
    bq, bk = triton_api.rotate_qk(rq, rk, cos, sin, offsets=20, seq_dim=2, layout=layout, conjugate=True)
    torch.testing.assert_close(bq, q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(bk, k, atol=1e-6, rtol=1e-6)
    x = triton_api.apply_rotary(q, cos[None, None, 20:29], sin[None, None, 20:29], layout=layout)
    torch.testing.assert_close(x, rq)
    y = triton_api.apply_rotary(x, cos[None, None, 20:29], sin[None, None, 20:29], layout=layout, conjugate=True)
    torch.testing.assert_close(y, q, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("inplace", [False, True])
def test_gradient_is_the_inverse_rotation(inplace):
    gen = torch.Generator().manual_seed(7)
    inv_freq, cos, sin = tables(24)
    q_leaf = torch.randn(2, 6, 3, 40, generator=gen, requires_grad=True)
    k_leaf = torch.randn(2, 6, 1, 40, generator=gen, requires_grad=True)
    positions = torch.randint(0, TABLE_ROWS, (2, 6), generator=gen)
    q, k = (q_leaf * 1, k_leaf * 1) if inplace else (q_leaf, k_leaf)
    q_out, k_out = triton_api.rotate_qk(q, k, cos, sin, positions=positions, seq_dim=1, layout="interleaved",
                                        inplace=inplace)
    gq, gk = torch.randn(q_out.shape, generator=gen), torch.randn(k_out.shape, generator=gen)
    grad_q, grad_k = torch.autograd.grad((q_out * gq).sum() + (k_out * gk).sum(), (q_leaf, k_leaf))
    view = positions.reshape(2, 6, 1)
    assert_matches(grad_q, gq, view, inv_freq, "interleaved", negate=True)  # R(-theta) = R(theta)^T
    assert_matches(grad_k, gk, view, inv_freq, "interleaved", negate=True)
    # gradcheck-like adjoint identity in float32: <g, J v> = <J^T g, v> for a random direction v
    v = torch.randn(q_leaf.shape, generator=gen)
    jv, _ = triton_api.rotate_qk(v, k_leaf.detach(), cos, sin, positions=positions, seq_dim=1, layout="interleaved")
    torch.testing.assert_close((gq * jv).sum(), (grad_q * v).sum(), rtol=1e-5, atol=1e-4)


def test_int64_indexing(monkeypatch):
    meta = torch.empty(2**21, 32, 32, device="meta", dtype=torch.bfloat16)  # 2**31 elements, no memory
    assert triton_rotary.needs_int64(*triton_rotary._extents(meta))
    assert triton_rotary.needs_int64(*triton_rotary._extents(torch.empty(2, 8, device="meta").as_strided((2, 8),
                                                                                                         (2**31, 1))))
    assert not triton_rotary.needs_int64(*triton_rotary._extents(torch.empty(2**20, 32, 32, device="meta")))
    gen = torch.Generator().manual_seed(8)
    _, cos, sin = tables(24)
    q, k = torch.randn(10, 3, 40, generator=gen).half(), torch.randn(10, 2, 40, generator=gen).half()
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    expected = triton_api.rotate_qk(q, k, cos, sin, cu_seqlens=cu, offsets=torch.tensor([3, 8]), seq_dim=0,
                                    layout="half")
    x = q.transpose(0, 1)
    expected_x = triton_api.apply_rotary(x, cos[None, :10], sin[None, :10], layout="half")
    flags = []
    monkeypatch.setattr(triton_rotary, "needs_int64", lambda *extents: flags.append(True) or True)
    got = triton_api.rotate_qk(q, k, cos, sin, cu_seqlens=cu, offsets=torch.tensor([3, 8]), seq_dim=0, layout="half")
    assert flags and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert torch.equal(triton_api.apply_rotary(x, cos[None, :10], sin[None, :10], layout="half"), expected_x)


def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch of every op."""
    _, cos, sin = tables(16)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 5, 3, 24, generator=gen, requires_grad=True)
    k = torch.randn(2, 5, 1, 24, generator=gen, requires_grad=True)
    packed = torch.randn(10, 2, 24, generator=gen, requires_grad=True)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    c, s = cos[:5].reshape(1, 5, 1, 8), sin[:5].reshape(1, 5, 1, 8)
    ops = torch.ops.ropekit
    cases = [
        (ops.rotate_qk, (q, k, cos, sin, None, torch.tensor([1, 3]), 2, None, None, 1, "half", False, "triton")),
        (ops.rotate_qk_, (q.detach().clone(), k.detach().clone(), cos, sin, None, None, 4, None, None, 1,
                          "interleaved", True, "triton")),
        (ops.rotate_qk, (packed, packed, cos, sin, None, None, 0, cu, None, 0, "interleaved", False, "triton")),
        (ops.rotate, (packed, cos, sin, None, None, 3, cu, None, 0, "half", True, "triton")),
        (ops.rotate_, (packed.detach().clone(), cos, sin, None, None, 0, cu, None, 0, "half", False, "triton")),
        (ops.apply_rotary, (q, c, s, "interleaved", False, "triton")),
        (ops.apply_rotary_, (q.detach().clone(), c, s, "half", True, "triton")),
        (ops.apply_rotary_qk, (q, k, c, s, "interleaved", False, "triton")),
        (ops.apply_rotary_qk_, (q.detach().clone(), k.detach().clone(), c, s, "half", True, "triton")),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_compile_fullgraph_traces_the_custom_ops():
    torch._dynamo.reset()
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    _, cos, sin = tables(24)

    def step(q, k, offsets):
        q, k = triton_api.rotate_qk(q, k, cos, sin, offsets=offsets, seq_dim=1, layout="half")
        return triton_api.rotate_qk(q, k, cos, sin, offsets=offsets, seq_dim=1, layout="half", conjugate=True,
                                    inplace=True)

    q, k = torch.randn(2, 5, 3, 40), torch.randn(2, 5, 1, 40)
    offsets = torch.tensor([1, 4])
    got = torch.compile(step, fullgraph=True, backend=recording)(q.clone(), k.clone(), offsets)
    torch.testing.assert_close(got, (q, k), atol=1e-6, rtol=1e-6)
    assert len(graphs) == 1 and "rotate_qk" in graphs[0] and "rotate_qk_" in graphs[0]


def test_compile_fullgraph_backward_and_apply_rotary(monkeypatch):
    torch._dynamo.reset()
    _, cos, sin = tables(16)

    def loss(q, k, x):
        q, k = triton_api.rotate_qk(q, k, cos, sin, seq_dim=0, layout="interleaved")
        y = ropekit.apply_rotary(x, cos[:4], sin[:4], layout="half", backend="triton")
        return (q * q.detach()).sum() + k.sum() + y.sum()

    inputs = [torch.randn(4, 2, 16, requires_grad=True), torch.randn(4, 1, 16, requires_grad=True),
              torch.randn(2, 4, 16, requires_grad=True)]
    expected = torch.autograd.grad(loss(*inputs), inputs)
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(*inputs), inputs)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_compile_fullgraph_traces_the_pair_op(monkeypatch):
    torch._dynamo.reset()
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    _, cos, sin = tables(16)
    step = lambda q, k: ropekit.apply_rotary_qk(q, k, cos[:5], sin[:5], backend="triton")  # noqa: E731
    q, k = torch.randn(2, 4, 5, 24), torch.randn(2, 1, 5, 24)
    got = torch.compile(step, fullgraph=True, backend=recording)(q, k)
    for a, b in zip(got, step(q, k), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert len(graphs) == 1 and "ropekit.apply_rotary_qk" in graphs[0]


def test_without_interpreter_cpu_tensors_are_refused(monkeypatch, launches):
    """Explicit backend="triton" never runs another kernel: CPU tensors without the interpreter, float64: refused."""
    gen = torch.Generator().manual_seed(9)
    inv_freq, cos, sin = tables(24)
    q, k = torch.randn(2, 7, 3, 40, generator=gen).bfloat16(), torch.randn(2, 7, 1, 40, generator=gen).bfloat16()
    triton_api.rotate_qk(q, k, cos, sin, offsets=torch.tensor([2, 9]), seq_dim=1, layout="half")
    assert len(launches) == 1
    x64 = torch.randn(12, 2, 40, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^backend='triton' cannot run q \(torch.float64 on cpu\)"):
        triton_api.rotate_qk(x64, x64.clone(), cos, sin, cu_seqlens=cu, seq_dim=0, layout="interleaved")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"^backend='triton' cannot run q \(torch.bfloat16 on cpu\)"):
        triton_api.rotate_qk(q, k, cos, sin, offsets=torch.tensor([2, 9]), seq_dim=1, layout="half")
    assert len(launches) == 1
    pos = torch.cat([torch.arange(5), torch.arange(7)]).reshape(12, 1)
    out, _ = ropekit.rotate_qk(x64, x64.clone(), cos, sin, cu_seqlens=cu, seq_dim=0, layout="interleaved")
    torch.testing.assert_close(out, apply_reference(x64, pos, inv_freq, layout="interleaved"), atol=1e-6, rtol=0)


def test_module_imports_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("ropekit.ops._triton_probe", triton_rotary.__file__)
    probe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, probe)
    spec.loader.exec_module(probe)
    assert not probe.is_available() and not probe.interpreting() and not probe.can_launch(torch.zeros(1))


def test_kernel_compiles_for_sm90(monkeypatch):
    """The interpreter accepts code the compiler rejects: compile ahead of time, no GPU needed."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:  # pragma: no cover
        pytest.skip(f"no ahead-of-time compiler: {exc}")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kernel = triton_rotary._jit(False)
    names = list(inspect.signature(triton_rotary._rotary_kernel).parameters)
    pointers = dict(Q="*bf16", Q_OUT="*bf16", K="*bf16", K_OUT="*bf16", COS="*fp32", SIN="*fp32",
                    POSITIONS="*i64", OFFSETS="*i32", CU_SEQLENS="*i32")
    all_on = dict(INTERLEAVED=True, CONJUGATE=True, GATHER=True, HAS_POSITIONS=True, HAS_OFFSETS=False, VARLEN=True,
                  COPY_TAIL=True, INT64=True)
    contract = dict(INTERLEAVED=False, CONJUGATE=False, GATHER=False, HAS_POSITIONS=False, HAS_OFFSETS=False,
                    VARLEN=False, COPY_TAIL=False, INT64=False)
    offsets = dict(contract, GATHER=True, HAS_OFFSETS=True)
    for flags in (all_on, contract, offsets):
        constants = dict(BLOCK_S=16, BLOCK_R=16, BLOCK_T=8, sq_d=1, soq_d=1, sk_d=1, sok_d=1, **flags)
        signature = {n: pointers.get(n, "constexpr" if n in constants else "i32") for n in names}
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
        except (RuntimeError, OSError) as exc:  # pragma: no cover - e.g. ptxas missing
            if "ptxas" in str(exc):
                pytest.skip(f"no ptxas: {exc}")
            raise
        assert compiled.asm["ptx"]


# -- the real kernel, where a GPU exists --------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_kernel_matches_reference(dtype, monkeypatch, launches):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(10)
    inv_freq, cos, sin = tables(40, rows=4096, device="cuda")
    for form, layout in (("bshd", "half"), ("bhsd", "interleaved"), ("packed", "half")):
        batch = 1 if form == "packed" else 3
        q, k, seq_dim, view = make_qk(form, batch, 300, 8, 2, 72, dtype, gen)
        q, k = q.cuda(), k.cuda()
        offsets = torch.tensor([7, 1000, 3000][:batch], device="cuda")
        q_out, k_out = triton_api.rotate_qk(q, k, cos, sin, offsets=offsets, seq_dim=seq_dim, layout=layout)
        pos = view(torch.arange(300).expand(batch, 300) + offsets.cpu()[:, None])
        assert_matches(q_out, q, pos, inv_freq, layout)
        assert_matches(k_out, k, pos, inv_freq, layout)
    cu = torch.tensor([0, 100, 101, 600], dtype=torch.int32, device="cuda")
    packed = torch.randn(600, 4, 64, generator=gen).to(dtype).cuda().requires_grad_()
    positions = torch.randint(0, 4096, (600,), generator=gen).cuda()
    out, _ = triton_api.rotate_qk(packed, packed, cos, sin, positions=positions, cu_seqlens=cu, seq_dim=0,
                                  layout="interleaved")
    assert_matches(out, packed, positions.reshape(600, 1), inv_freq, "interleaved")
    (grad,) = torch.autograd.grad(out, packed, torch.ones_like(out))
    assert_matches(grad, torch.ones_like(packed), positions.reshape(600, 1), inv_freq, "interleaved", negate=True)
    assert launches and all(call["int64"] is False for call in launches)


# -- apply_rotary_qk on the Triton backend: q and k in one launch with broadcast tables -------------
@pytest.mark.parametrize("form", ["bhsd", "bshd", "packed", "five_dims", "same_heads"])
@pytest.mark.parametrize("inplace", [False, True])
def test_apply_rotary_qk_is_one_launch(form, inplace, launches):
    gen = torch.Generator().manual_seed(24)
    inv_freq, cos, sin = tables(24)
    q_shape, k_shape, table = {
        "bhsd": ((2, 6, 5, 40), (2, 2, 5, 40), lambda t: t[:5]),
        "bshd": ((2, 5, 6, 40), (2, 5, 3, 40), lambda t: t[:5, None]),
        "packed": ((7, 4, 40), (7, 1, 40), lambda t: t[:7, None]),
        "five_dims": ((3, 2, 4, 5, 40), (3, 2, 1, 5, 40), lambda t: t[:5]),
        "same_heads": ((2, 3, 5, 40), (2, 3, 5, 40), lambda t: t[:5]),
    }[form]
    q = torch.randn(q_shape, generator=gen).bfloat16()
    k = torch.randn(k_shape, generator=gen).bfloat16()
    q_in, k_in = (q.clone(), k.clone()) if inplace else (q, k)
    q_out, k_out = ropekit.apply_rotary_qk(q_in, k_in, table(cos), table(sin), layout="interleaved", inplace=inplace,
                                           backend="triton")
    assert len(launches) == 1 and launches[0]["gather"] is False
    assert (q_out is q_in and k_out is k_in) == inplace
    seq_axis = {"bhsd": 2, "bshd": 1, "packed": 0, "five_dims": 3, "same_heads": 2}[form]
    for x, out in ((q, q_out), (k, k_out)):
        view = [1] * (x.dim() - 1)
        view[seq_axis] = x.shape[seq_axis]
        assert_matches(out, x, torch.arange(x.shape[seq_axis]).reshape(view), inv_freq, "interleaved")


def test_apply_rotary_qk_triton_gradients_and_fallbacks(launches):
    gen = torch.Generator().manual_seed(25)
    _, cos, sin = tables(16)
    q = torch.randn(2, 4, 6, 24, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 6, 24, generator=gen, requires_grad=True)
    out = ropekit.apply_rotary_qk(q, k, cos[:6], sin[:6], backend="triton")
    want = ropekit.apply_rotary_qk(q, k, cos[:6], sin[:6], backend="torch")
    weights = torch.randn(q.shape, generator=gen), torch.randn(k.shape, generator=gen)
    got = torch.autograd.grad((out[0] * weights[0]).sum() + (out[1] * weights[1]).sum(), (q, k))
    expected = torch.autograd.grad((want[0] * weights[0]).sum() + (want[1] * weights[1]).sum(), (q, k))
    for a, b in zip((*out, *got), (*want, *expected), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert len(launches) == 2  # forward and backward, one launch each
    # per-head tables (heads merge with the tokens): still one launch
    launches.clear()
    per_head = cos[:12].reshape(1, 2, 6, 8), sin[:12].reshape(1, 2, 6, 8)
    q2, k2 = q.detach()[:, :2], k.detach()
    got = ropekit.apply_rotary_qk(q2, k2, *per_head, backend="triton")
    assert len(launches) == 1
    for a, b in zip(got, ropekit.apply_rotary_qk(q2, k2, *per_head, backend="torch"), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # q and k differing along two axes (batch and heads) cannot share one: one launch per tensor
    launches.clear()
    k3 = k.detach()[:1]
    got = ropekit.apply_rotary_qk(q.detach(), k3, cos[:6], sin[:6], backend="triton")
    assert len(launches) == 2
    for a, b in zip(got, ropekit.apply_rotary_qk(q.detach(), k3, cos[:6], sin[:6], backend="torch"), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


# -- RotaryEmbedding on the Triton backend: one launch, rows gathered in the kernel -------------------
@pytest.mark.parametrize("form", ["bhsd", "bshd", "packed"])
@pytest.mark.parametrize("mode", ["default", "int_offset", "tensor_offset", "positions_1d", "positions_2d"])
def test_rotary_embedding_is_one_launch(form, mode, launches):
    """q and k of a RotaryEmbedding forward: a single kernel launch, equal to the eager module."""
    if form == "packed" and mode in ("tensor_offset", "positions_2d"):
        pytest.skip("packed tokens have no batch axis")
    gen = torch.Generator().manual_seed(21)
    q, k, seq_dim, _ = make_qk(form, 2, 5, 4, 2, 40, torch.bfloat16, gen)
    kwargs = {"int_offset": {"offset": 300}, "tensor_offset": {"offset": torch.tensor([3, 700])},
              "positions_1d": {"positions": torch.tensor([9, 0, 4, 4, 1000])},
              "positions_2d": {"positions": torch.tensor([[9, 0, 4, 4, 1000], [1, 2, 3, 5, 8]])}}.get(mode, {})
    fused = ropekit.RotaryEmbedding(40, rotary_dim=24, layout="interleaved", backend="triton")
    eager = ropekit.RotaryEmbedding(40, rotary_dim=24, layout="interleaved", backend="torch")
    got = fused(q, k, seq_dim=seq_dim, **kwargs)
    assert len(launches) == 1 and launches[0]["gather"] is True
    for a, b in zip(got, eager(q, k, seq_dim=seq_dim, **kwargs), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), atol=2**-6, rtol=2**-7)  # interpreter truncates


def test_rotary_embedding_triton_inplace_gradients_and_errors(launches):
    gen = torch.Generator().manual_seed(22)
    dynamic = ropekit.scaling.DynamicNTK(factor=2.0, original_max_position_embeddings=8)
    rope = ropekit.RotaryEmbedding(16, backend="triton", scaling=dynamic)
    eager = ropekit.RotaryEmbedding(16, backend="torch", scaling=dynamic)
    q = torch.randn(1, 2, 12, 16, generator=gen, requires_grad=True)  # past the original length: dynamic
    k = torch.randn(1, 1, 12, 16, generator=gen, requires_grad=True)
    out = rope(q, k)
    want = eager(q, k)
    for a, b in zip(out, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out[0].sum() + out[1].sum(), (q, k))
    expected = torch.autograd.grad(want[0].sum() + want[1].sum(), (q, k))
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    q2, k2 = q.detach().clone(), k.detach().clone()
    result = rope(q2, k2, offset=3, inplace=True)
    assert result[0] is q2 and result[1] is k2
    with pytest.raises(ValueError, match="batched positions"):
        rope(q[0, 0], k[0, 0], positions=torch.arange(12)[None], seq_dim=0)
    with pytest.raises(ValueError, match="positions has batch 3"):
        rope(q, k, positions=torch.arange(12).expand(3, 12))
    with pytest.raises(ValueError, match="offset must be"):
        rope(q, k, offset=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rotary_embedding_and_apply_rotary_qk(monkeypatch, launches):
    """The module's default ("auto") path on a GPU: one launch for q and k, against the float64 oracle."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(23)
    rope = ropekit.RotaryEmbedding(128, base=500000.0)
    q = torch.randn(4, 32, 1, 128, generator=gen).to(torch.bfloat16).cuda()
    k = torch.randn(4, 8, 1, 128, generator=gen).to(torch.bfloat16).cuda()
    offsets = torch.tensor([5, 70, 4000, 9000])
    q_out, k_out = rope(q, k, offset=offsets.cuda())  # a decode step, one position per sequence
    assert len(launches) == 1
    pos = offsets.reshape(4, 1, 1)
    assert_matches(q_out, q, pos, rope.inv_freq, "half")
    assert_matches(k_out, k, pos, rope.inv_freq, "half")
    cos, sin = rope.cos_sin(pos.cuda())
    q2, k2 = ropekit.apply_rotary_qk(q, k, cos, sin)
    torch.testing.assert_close(q2, q_out, atol=0, rtol=0)
    torch.testing.assert_close(k2, k_out, atol=0, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_compile_inductor_and_int64(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch._dynamo.reset()
    inv_freq, cos, sin = tables(64, rows=1024, device="cuda")
    q = torch.randn(2, 128, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 128, 2, 128, device="cuda", dtype=torch.bfloat16)
    fn = lambda q, k: triton_api.rotate_qk(q, k, cos, sin, offsets=3, seq_dim=1, layout="half")  # noqa: E731
    for a, b in zip(torch.compile(fn, fullgraph=True)(q, k), fn(q, k), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    free, _ = torch.cuda.mem_get_info()
    if free < 12 * 2**30:
        pytest.skip("the 2**31-element check needs 12 GiB of free GPU memory")
    tokens = 2**31 // (8 * 128) + 8  # q has more than 2**31 elements
    big = torch.empty(tokens, 8, 128, device="cuda", dtype=torch.bfloat16).normal_()
    small = torch.randn(tokens, 1, 128, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(tokens, device="cuda") % 1024
    rows = torch.tensor([0, tokens // 2, tokens - 1], device="cuda")  # the last row lies past element 2**31
    before = big[rows].clone()
    triton_api.rotate_qk(big, small, cos, sin, positions=positions, seq_dim=0, layout="half", inplace=True)
    assert_matches(big[rows], before, positions[rows].reshape(3, 1), inv_freq, "half")
