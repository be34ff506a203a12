"""``inverse=True``: every public rotation form rotates by ``-theta``, forward and backward, on every backend.

Oracles: the float64 rotation matrices (:func:`ropekit.apply_reference`) at ``-positions``, and the
round trip ``inverse(rotate(x)) == x`` within the dtype's rounding. The gradient of an inverse
rotation is the forward rotation (gradcheck in float64, and the adjoint against the oracle). The
Triton backend's forms are tested in Triton's interpreter (``tests/test_inverse_triton.py``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ropekit
from ropekit import apply_reference, base_inv_freq, cos_sin, ops
from ropekit.multiaxis import named_plan
from ropekit.nn import MixedRotaryEmbedding, MultiAxisRotaryEmbedding
from ropekit.ops import Backend, prepared

LAYOUTS = ("half", "interleaved")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
BACKENDS = [name for name in ("torch", "cpu") if name in ops.available()]
FORMS = ("apply_rotary", "apply_rotary_qk", "rotate", "rotate_qk", "module", "module_one")
MAX_POSITION = 10**5


def ulp_scale(dtype: torch.dtype) -> float:
    """A tolerance unit relative to a pair's magnitude: the dtype's epsilon, float32's for float64 (float32 tables)."""
    return max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)


def pair_norms(x: torch.Tensor, rotary_dim: int, layout: str) -> torch.Tensor:
    """float64 magnitude of the pair each channel belongs to (``|x|`` for channels past rotary_dim), x's shape."""
    x64 = x.double()
    half = rotary_dim // 2
    out = x64.abs().clone()
    if layout == "half":
        first, second = x64[..., :half], x64[..., half:rotary_dim]
        norm = torch.sqrt(first**2 + second**2)
        out[..., :half], out[..., half:rotary_dim] = norm, norm
    else:
        pairs = x64[..., :rotary_dim].unflatten(-1, (half, 2))
        norm = pairs.square().sum(-1, keepdim=True).sqrt()
        out[..., :rotary_dim] = norm.expand_as(pairs).flatten(-2)
    return out


def assert_within(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, units: float, dtype: torch.dtype):
    """``|got - want| <= units * eps(dtype) * scale`` elementwise (scale: the pairs' magnitudes)."""
    err = (got.double() - want.double()).abs()
    bound = units * ulp_scale(dtype) * scale + torch.finfo(dtype).tiny
    worst = float((err / bound).max()) if err.numel() else 0.0
    assert worst <= 1.0, f"error {worst:.3f} x the bound ({units} eps of the pairs' magnitude)"


def run_form(form, q, k, positions, inv_freq, *, layout, inplace, inverse, backend):
    """One public form on q (and k): ``(q_out, k_out)``; positions ``(seq,)`` of axis 2 of ``(b, h, seq, d)``."""
    rows = int(positions.max()) + 1
    cos_table, sin_table = cos_sin(torch.arange(rows), inv_freq)
    cos, sin = cos_table[positions], sin_table[positions]
    opts = dict(layout=layout, inplace=inplace, inverse=inverse, backend=backend)
    if form == "apply_rotary":
        return ropekit.apply_rotary(q, cos, sin, **opts), None
    if form == "apply_rotary_qk":
        return ropekit.apply_rotary_qk(q, k, cos, sin, **opts)
    if form == "rotate":
        return ropekit.rotate(q, cos_table, sin_table, positions=positions, tensor_format="bhsd", **opts), None
    if form == "rotate_qk":
        return ropekit.rotate_qk(q, k, cos_table, sin_table, positions=positions, tensor_format="bhsd", **opts)
    module = ropekit.RotaryEmbedding(q.shape[-1], rotary_dim=2 * inv_freq.numel(), layout=layout, backend=backend)
    if form == "module":
        return module(q, k, positions, inplace=inplace, inverse=inverse)
    return module.rotate_one(q, positions, inplace=inplace, inverse=inverse), None


@given(
    form=st.sampled_from(FORMS),
    backend=st.sampled_from(BACKENDS),
    dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(LAYOUTS),
    inplace=st.booleans(),
    partial=st.booleans(),
    positions=st.lists(st.integers(0, MAX_POSITION), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_inverse_undoes_the_rotation_and_is_the_reference_at_minus_positions(form, backend, dtype, layout, inplace,
                                                                            partial, positions, seed):
    gen = torch.Generator().manual_seed(seed)
    head_dim = 16
    rotary_dim = 8 if partial else head_dim
    inv_freq = base_inv_freq(rotary_dim)
    pos = torch.tensor(positions)
    q = (torch.randn(2, 3, len(positions), head_dim, generator=gen) * 4).to(dtype)
    k = (torch.randn(2, 1, len(positions), head_dim, generator=gen) * 4).to(dtype)
    options = dict(layout=layout, inplace=inplace, backend=backend)

    q_inv, k_inv = run_form(form, q.clone(), k.clone(), pos, inv_freq, inverse=True, **options)
    for x, out in ((q, q_inv), (k, k_inv)):
        if out is None:
            continue
        assert out.dtype == dtype and out.shape == x.shape
        want = apply_reference(x, -pos, inv_freq, layout=layout)  # (seq,) against axis 2
        assert_within(out, want, pair_norms(x, rotary_dim, layout), 2.0, dtype)
        assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])

    q_rot, k_rot = run_form(form, q.clone(), k.clone(), pos, inv_freq, inverse=False, **options)
    q_back, k_back = run_form(form, q_rot.clone(), None if k_rot is None else k_rot.clone(), pos, inv_freq,
                              inverse=True, **options)
    for x, back in ((q, q_back), (k, k_back)):
        if back is not None:  # two roundings of dtype, each within ~1 eps of the pair's magnitude
            assert_within(back, x, pair_norms(x, rotary_dim, layout), 3.0, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_inverse_equals_the_forward_rotation_at_negated_angles_bit_for_bit(backend, layout):
    """``inverse=True`` is the rotation with ``sin -> -sin``: the same kernel, the same bits."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 7, 32, generator=gen).to(torch.bfloat16)
    cos, sin = cos_sin(torch.randint(0, 10**4, (7,), generator=gen), base_inv_freq(32))
    got = ropekit.apply_rotary(x, cos, sin, layout=layout, inverse=True, backend=backend)
    assert torch.equal(got, ropekit.apply_rotary(x, cos, -sin, layout=layout, backend=backend))


# -- autograd -----------------------------------------------------------------------------------------


def _float64_problem(seed: int, shape=(1, 2, 3, 8)):
    """float64 q, k, positions and float64 tables (angles and their cos/sin in float64 throughout)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(shape[0], 1, *shape[2:], generator=gen, dtype=torch.float64, requires_grad=True)
    positions = torch.randint(0, 10**4, (shape[-2],), generator=gen)
    angles = ropekit.rotation_angles(torch.arange(10**4), base_inv_freq(shape[-1]))
    return q, k, positions, torch.cos(angles), torch.sin(angles)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ("apply_rotary", "apply_rotary_qk", "rotate", "rotate_qk"))
@pytest.mark.parametrize("inplace", [False, True])
def test_gradcheck_of_the_inverse(backend, form, inplace):
    q, k, positions, cos_table, sin_table = _float64_problem(1)
    cos, sin = cos_table[positions], sin_table[positions]
    opts = dict(layout="interleaved", inverse=True, backend=backend, inplace=inplace)

    def f(a, b):
        if inplace:
            a, b = a * 1.0, b * 1.0  # non-leaves to rotate in place
        if form == "apply_rotary":
            return ropekit.apply_rotary(a, cos, sin, **opts)
        if form == "apply_rotary_qk":
            return ropekit.apply_rotary_qk(a, b, cos, sin, **opts)
        if form == "rotate":
            return ropekit.rotate(a, cos_table, sin_table, positions=positions, tensor_format="bhsd", **opts)
        return ropekit.rotate_qk(a, b, cos_table, sin_table, positions=positions, tensor_format="bhsd", **opts)

    assert torch.autograd.gradcheck(f, (q, k), eps=1e-6, atol=1e-8)
    if not inplace:
        assert torch.autograd.gradgradcheck(f, (q, k), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_gradient_of_the_inverse_is_the_forward_rotation(backend, layout):
    """``d/dx <w, R(-theta) x> = R(-theta)^T w = R(theta) w``, against the float64 matrices."""
    q, _, positions, cos_table, sin_table = _float64_problem(2)
    w = torch.randn_like(q)
    out = ropekit.rotate(q, cos_table, sin_table, positions=positions, tensor_format="bhsd", layout=layout,
                         inverse=True, backend=backend)
    (grad,) = torch.autograd.grad((out * w).sum(), q)
    want = apply_reference(w.detach(), positions, base_inv_freq(q.shape[-1]), layout=layout)
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-12)


def test_learned_tables_inverse_differentiates_the_tables_too():
    q, _, positions, cos_table, sin_table = _float64_problem(4, shape=(1, 2, 5, 6))
    cos = cos_table[positions][:, :3].clone().requires_grad_(True)
    sin = sin_table[positions][:, :3].clone().requires_grad_(True)

    def f(x, c, s):
        return ropekit.apply_rotary(x, c, s, inverse=True)

    assert torch.autograd.gradcheck(f, (q, cos, sin), eps=1e-6, atol=1e-8)
    with torch.no_grad():
        assert torch.equal(f(q, cos, sin), ropekit.apply_rotary(q, cos, -sin))


# -- modules ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_rotary_embedding_inverse_undoes_forward_decode_loop_warm_and_cold(backend):
    """A decode loop's prepared calls keep forward and inverse apart (the option is part of the signature)."""
    module = ropekit.RotaryEmbedding(32, backend=backend)
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 4, 1, 32, generator=gen), torch.randn(1, 2, 1, 32, generator=gen)
    inv_freq = module.inv_freq
    for step in range(4):  # the same signature every step: warm after the first
        q_rot, k_rot = module(q, k, offset=step)
        q_back, k_back = module(q_rot, k_rot, offset=step, inverse=True)
        pos = torch.tensor([step])
        torch.testing.assert_close(q_rot, apply_reference(q, pos, inv_freq).float(), rtol=0, atol=1e-5)
        torch.testing.assert_close(q_back, q, rtol=0, atol=1e-5)
        torch.testing.assert_close(k_back, k, rtol=0, atol=1e-5)


def test_multi_axis_inverse_is_the_reference_at_minus_positions():
    plan = named_plan("qwen2-vl", head_dim=32, section=(4, 6, 6))
    module = MultiAxisRotaryEmbedding(plan, layout="half")
    gen = torch.Generator().manual_seed(6)
    q, k = torch.randn(1, 2, 5, 32, generator=gen), torch.randn(1, 1, 5, 32, generator=gen)
    positions = torch.randint(0, 50, (5, 3), generator=gen)
    q_inv, k_inv = module(q, k, positions, inverse=True)
    torch.testing.assert_close(q_inv.double(), apply_reference(q, -positions, plan, layout="half"), rtol=0,
                               atol=1e-5)
    q_back, _ = module(*module(q, k, positions), positions, inverse=True)
    torch.testing.assert_close(q_back, q, rtol=0, atol=1e-5)


def test_mixed_inverse_undoes_forward_and_reaches_the_frequencies():
    module = MixedRotaryEmbedding(16, 2)
    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn(1, 2, 6, 16, generator=gen), torch.randn(1, 2, 6, 16, generator=gen)
    positions = torch.randint(0, 8, (6, 2), generator=gen)
    q_back, k_back = module(*module(q, k, positions), positions, inverse=True)
    torch.testing.assert_close(q_back, q, rtol=0, atol=1e-5)
    q_inv, _ = module(q, k, positions, inverse=True)
    (q_inv * torch.randn(q_inv.shape, generator=gen)).sum().backward()
    assert module.freqs.grad is not None and bool(module.freqs.grad.abs().sum() > 0)


# -- options ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ("apply_rotary", "apply_rotary_qk", "rotate", "rotate_qk", "module"))
@pytest.mark.parametrize("bad", (1, "yes", None))
def test_inverse_must_be_a_bool_warm_as_cold(form, bad):
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    for _ in range(2):
        run_form(form, q, k, torch.arange(3), base_inv_freq(8), layout="half", inplace=False, inverse=False,
                 backend="auto")  # a valid call of the same signature first
        with pytest.raises(TypeError, match="inverse must be a bool"):
            run_form(form, q, k, torch.arange(3), base_inv_freq(8), layout="half", inplace=False, inverse=bad,
                     backend="auto")


@pytest.mark.parametrize("backend", BACKENDS)
def test_prepared_calls_of_forward_and_inverse_stay_apart(backend):
    prepared.clear()
    x = torch.randn(2, 2, 3, 8)
    cos, sin = cos_sin(torch.arange(3) + 11, base_inv_freq(8))
    table_cos, table_sin = cos_sin(torch.arange(20), base_inv_freq(8))
    for _ in range(3):  # cold, then warm: the same outcome every time
        fwd = ropekit.apply_rotary(x, cos, sin, backend=backend)
        inv = ropekit.apply_rotary(x, cos, sin, inverse=True, backend=backend)
        assert torch.equal(inv, ropekit.apply_rotary(x, cos, -sin, backend=backend))
        assert not torch.equal(fwd, inv)
        q_fwd, _ = ropekit.rotate_qk(x, x.clone(), table_cos, table_sin, offsets=11, tensor_format="bhsd",
                                     backend=backend)
        q_inv, _ = ropekit.rotate_qk(x, x.clone(), table_cos, table_sin, offsets=11, tensor_format="bhsd",
                                     inverse=True, backend=backend)
        assert torch.equal(q_fwd, fwd) and torch.equal(q_inv, inv)


def test_a_backend_whose_prepared_predates_inverse_still_runs_it():
    """A subclass overriding ``prepared`` without the ``conjugate`` keyword gets the base call for inverse calls."""
    calls = []

    class Older(Backend):
        name = "older"

        def apply_rotary(self, x, cos, sin, *, layout, conjugate, inplace):
            calls.append(conjugate)
            return ops.get("torch").apply_rotary(x, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)

        def prepared(self, tensors, *, layout, inplace):  # the signature before conjugate existed
            return lambda x, cos, sin: self.apply_rotary(x, cos, sin, layout=layout, conjugate=False,
                                                         inplace=inplace)

    from ropekit.ops import dispatch

    ops.register("older", Older())
    try:
        x = torch.randn(1, 1, 2, 8)
        cos, sin = cos_sin(torch.arange(2) + 3, base_inv_freq(8))
        want = ropekit.apply_rotary(x, cos, sin, inverse=True, backend="torch")
        for _ in range(3):
            assert torch.equal(ropekit.apply_rotary(x, cos, sin, inverse=True, backend="older"), want)
        assert calls and all(calls)
    finally:  # a backend left registered would be measured by every later report and bench
        dispatch._BACKENDS.pop("older", None)


def test_inverse_traces_fullgraph_forward_and_backward():
    """``torch.compile(fullgraph=True)`` keeps the inverse as the operator with ``conjugate=True``; the same values."""
    inv_freq = base_inv_freq(16)
    cos_table, sin_table = cos_sin(torch.arange(32), inv_freq)
    positions = torch.tensor([3, 9, 27])

    def f(q, k):
        return ropekit.rotate_qk(q, k, cos_table, sin_table, positions=positions, tensor_format="bhsd", inverse=True)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    q = torch.randn(1, 2, 3, 16, requires_grad=True)
    k = torch.randn(1, 1, 3, 16, requires_grad=True)
    got = compiled(q, k)
    want = f(q, k)
    for a, b, x in zip(got, want, (q, k), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert (a.double() - apply_reference(x, -positions, inv_freq)).abs().max() < 1e-5
    (grad_q,) = torch.autograd.grad(got[0].sum(), q)
    ones = torch.ones_like(q)
    torch.testing.assert_close(grad_q, ropekit.rotate(ones, cos_table, sin_table, positions=positions,
                                                      tensor_format="bhsd"), rtol=0, atol=1e-6)
