"""``inverse=True`` on the Triton backend, in Triton's CPU interpreter, against the float64 oracle.

Every public form through ``backend="triton"`` (the kernel's ``conjugate`` flag): the rotation by
``-theta`` equals the float64 matrices at ``-positions``, undoes the forward rotation, and its
gradient is the forward rotation. Shapes stay small: the interpreter is slow.
"""

import pytest
import torch

import ropekit
from ropekit import apply_reference, base_inv_freq, cos_sin
from triton_interpreter import count_calls, import_interpreted

triton, (triton_rotary,) = import_interpreted("ropekit.ops.triton_kernel")

torch.set_num_threads(1)

FORMS = ("apply_rotary", "apply_rotary_qk", "rotate", "rotate_qk", "module")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def run(form, q, k, positions, *, inverse, inplace=False, layout="half"):
    """One public form on ``backend="triton"``: ``(q_out, k_out)`` (``k_out`` None for one-tensor forms)."""
    head_dim = q.shape[-1]
    cos_table, sin_table = cos_sin(torch.arange(64), base_inv_freq(head_dim))
    opts = dict(layout=layout, inplace=inplace, inverse=inverse, backend="triton")
    if form == "apply_rotary":
        return ropekit.apply_rotary(q, cos_table[positions], sin_table[positions], **opts), None
    if form == "apply_rotary_qk":
        return ropekit.apply_rotary_qk(q, k, cos_table[positions], sin_table[positions], **opts)
    if form == "rotate":
        return ropekit.rotate(q, cos_table, sin_table, positions=positions, tensor_format="bhsd", **opts), None
    if form == "rotate_qk":
        return ropekit.rotate_qk(q, k, cos_table, sin_table, positions=positions, tensor_format="bhsd", **opts)
    module = ropekit.RotaryEmbedding(head_dim, layout=layout, backend="triton")
    return module(q, k, positions, inplace=inplace, inverse=inverse)


def bound(x: torch.Tensor) -> float:
    """A tolerance for ``x``'s dtype: the interpreter truncates to 16-bit dtypes (one ulp), plus float32 arithmetic."""
    return 2 * torch.finfo(x.dtype).eps * float(x.abs().max()) + 1e-6


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("inplace", (False, True))
def test_inverse_on_triton_is_the_reference_at_minus_positions_and_undoes_the_rotation(form, dtype, inplace,
                                                                                       monkeypatch):
    launches = count_calls(monkeypatch, triton_rotary, "launch")
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 2, 5, 16, generator=gen).to(dtype)
    k = torch.randn(1, 1, 5, 16, generator=gen).to(dtype)
    positions = torch.randint(0, 64, (5,), generator=gen)
    layout = "interleaved" if inplace else "half"
    q_inv, k_inv = run(form, q.clone(), k.clone(), positions, inverse=True, inplace=inplace, layout=layout)
    assert launches, "the Triton kernel ran"
    for x, out in ((q, q_inv), (k, k_inv)):
        if out is not None:
            want = apply_reference(x, -positions, base_inv_freq(16), layout=layout)
            assert float((out.double() - want).abs().max()) <= bound(x)
    q_rot, k_rot = run(form, q.clone(), k.clone(), positions, inverse=False, layout=layout)
    q_back, k_back = run(form, q_rot, k_rot, positions, inverse=True, layout=layout)
    assert float((q_back.double() - q.double()).abs().max()) <= 2 * bound(q)
    if k_back is not None:
        assert float((k_back.double() - k.double()).abs().max()) <= 2 * bound(k)


@pytest.mark.parametrize("form", ("apply_rotary", "rotate_qk"))
def test_the_gradient_of_the_inverse_on_triton_is_the_forward_rotation(form):
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(1, 2, 4, 16, generator=gen, requires_grad=True)
    k = torch.randn(1, 1, 4, 16, generator=gen, requires_grad=True)
    positions = torch.randint(0, 64, (4,), generator=gen)
    q_out, _ = run(form, q, k, positions, inverse=True)
    w = torch.randn(q_out.shape, generator=gen)
    (grad,) = torch.autograd.grad((q_out * w).sum(), q)
    want = apply_reference(w, positions, base_inv_freq(16))
    assert float((grad.double() - want).abs().max()) <= 1e-5


@pytest.mark.parametrize("case", ("run", "scattered", "paged"))
def test_rerotate_cache_on_triton_matches_the_eager_backend(case, monkeypatch):
    """Moving cached keys runs the Triton kernel (``apply_rotary`` in place on the cache or the gathered rows)."""
    launches = count_calls(monkeypatch, triton_rotary, "launch")
    gen = torch.Generator().manual_seed(13)
    inv_freq = base_inv_freq(16)
    if case == "paged":
        cache = torch.randn(6, 4, 2, 16, generator=gen).to(torch.bfloat16)
        where = dict(block_table=torch.tensor([[3, 0], [5, 1]]), positions=torch.tensor([[1, 2, 6], [0, 4, -1]]))
        delta = torch.tensor([[-1, 3, 1], [2, 2, 0]])
    else:
        cache = torch.randn(2, 2, 10, 16, generator=gen).to(torch.bfloat16)
        where = dict(positions=torch.arange(3, 9)) if case == "run" else dict(positions=torch.tensor([[7, 2], [5, 9]]))
        delta = -3 if case == "run" else torch.tensor([[-7, 4], [1, -9]])
    eager = cache.clone()
    ropekit.rerotate_cache(cache, delta, inv_freq=inv_freq, backend="triton", **where)
    ropekit.rerotate_cache(eager, delta, inv_freq=inv_freq, backend="torch", **where)
    assert launches, "the Triton kernel ran"
    assert float((cache.double() - eager.double()).abs().max()) <= bound(eager)
