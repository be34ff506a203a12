"""Multi-axis tables on the C++ CPU kernel: forward and backward, equal to eager and to the float64 reference.

Every multi-axis scheme ends in the half-width float32 tables the kernels already take, so these
tests run the real kernel (counted, so a silent fall-back to eager fails) with M-RoPE, axial and
pixel tables built from vector positions (fractional and negative), through ``apply_rotary``,
``apply_rotary_qk``, ``rotate_qk`` (per-token tables of packed images) and the module.
"""

import pytest
import torch

import ropekit
from multiaxis_cases import PLANS, assert_close_to_reference, positions_for
from ropekit import ops
from ropekit.nn import MultiAxisRotaryEmbedding
from ropekit.ops import prepared

pytestmark = pytest.mark.skipif("cpu" not in ops.available(), reason="C++ CPU kernel unavailable (no compiler)")


@pytest.fixture
def kernel_calls(monkeypatch):
    """Count the C++ kernel calls (apply_rotary and apply_rotary_qk, in place or not)."""
    backend = ops.get("cpu")
    backend.is_available()
    calls = []
    for name in ("_one", "_one_", "_qk", "_qk_"):
        real = getattr(backend, name)

        def counting(*args, _real=real, _name=name):
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(backend, name, counting)
    prepared.clear()  # calls prepared before the spy would bypass it
    yield calls
    prepared.clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("name", sorted(PLANS))
def test_forward_and_backward_on_the_cpp_kernel(name, layout, dtype, kernel_calls):
    plan = PLANS[name]()
    gen = torch.Generator().manual_seed(3)
    positions = positions_for(plan, 12, gen)
    cos, sin = plan.cos_sin(positions)  # (12, pairs)
    q = torch.randn(2, 4, 12, 18, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(2, 2, 12, 18, generator=gen).to(dtype).requires_grad_()
    q_out, k_out = ropekit.apply_rotary_qk(q, k, cos, sin, layout=layout, backend="cpu")
    assert kernel_calls, "the C++ kernel did not run"
    eager = ropekit.apply_rotary_qk(q.detach(), k.detach(), cos, sin, layout=layout, backend="torch")
    assert torch.equal(q_out.detach(), eager[0]) and torch.equal(k_out.detach(), eager[1])
    assert_close_to_reference(q_out, q, positions, plan, layout)
    assert_close_to_reference(k_out, k, positions, plan, layout)
    # backward: the rotation by -theta, i.e. R(p)^T = R(-p) applied to the incoming gradient
    wq, wk = torch.randn(q.shape, generator=gen).to(dtype), torch.randn(k.shape, generator=gen).to(dtype)
    calls = len(kernel_calls)
    torch.autograd.backward((q_out, k_out), (wq, wk))
    assert len(kernel_calls) > calls, "the backward did not run on the C++ kernel"
    assert_close_to_reference(q.grad, wq, -positions, plan, layout)
    assert_close_to_reference(k.grad, wk, -positions, plan, layout)


def test_rotate_qk_with_per_token_tables_of_packed_images(kernel_calls):
    # two images of different grids packed into one sequence: each token's row is its own position vector
    plan = PLANS["eva02"]()
    first, second = positions_for(plan, 8, torch.Generator().manual_seed(1)), positions_for(plan, 6, None)
    positions = torch.cat([first, second])
    cos_table, sin_table = plan.cos_sin(positions)
    q, k = torch.randn(14, 3, 16), torch.randn(14, 1, 16)
    cu_seqlens = torch.tensor([0, 8, 14], dtype=torch.int32)
    rows = torch.cat([torch.arange(8), torch.arange(8, 14)])
    q_out, k_out = ropekit.rotate_qk(q, k, cos_table, sin_table, positions=rows, cu_seqlens=cu_seqlens, seq_dim=0,
                                     layout="interleaved", backend="cpu")
    assert kernel_calls
    assert_close_to_reference(q_out, q, positions[:, None], plan, "interleaved")
    assert_close_to_reference(k_out, k, positions[:, None], plan, "interleaved")


@pytest.mark.parametrize("seq_dim", [-2, -3])
def test_the_module_rotates_on_the_kernel_in_place_too(seq_dim, kernel_calls):
    plan = PLANS["qwen3-vl"]()
    module = MultiAxisRotaryEmbedding(plan, head_dim=18, backend="cpu")
    positions = positions_for(plan, 10, torch.Generator().manual_seed(5))
    shape = (2, 3, 10, 18) if seq_dim == -2 else (2, 10, 3, 18)
    q, k = torch.randn(shape), torch.randn(shape)
    q_ref, k_ref = q.clone(), k.clone()
    view = positions[None, None] if seq_dim == -2 else positions[None, :, None]
    out_q, out_k = module(q, k, positions, seq_dim=seq_dim, inplace=True)
    assert out_q is q and out_k is k and kernel_calls
    assert_close_to_reference(q, q_ref, view, plan, "half")
    assert_close_to_reference(k, k_ref, view, plan, "half")
    assert torch.equal(q[..., 16:], q_ref[..., 16:])  # past the plan's rotary_dim: untouched
    batched = torch.stack([positions, positions + 1.5])  # (batch, seq, n_axes)
    out_q, _ = module(q_ref, None, batched, seq_dim=seq_dim)
    view = batched[:, None] if seq_dim == -2 else batched[:, :, None]
    assert_close_to_reference(out_q, q_ref, view, plan, "half")
