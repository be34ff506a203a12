"""Multi-axis tables on the Triton kernel, in Triton's CPU interpreter: forward and backward.

``TRITON_INTERPRET=1`` must be set before triton is first imported (as in test_backend_triton.py);
the launches are counted so that a silent fall-back to eager fails. Shapes stay small: the
interpreter is slow.
"""

import pytest
import torch

import ropekit
from multiaxis_cases import PLANS, assert_close_to_reference, positions_for
from triton_interpreter import count_calls, import_interpreted

triton, (triton_kernel,) = import_interpreted("ropekit.ops.triton_kernel")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def launches(monkeypatch):
    return count_calls(monkeypatch, triton_kernel, "launch")


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("name", ["qwen3-vl", "flux", "pixel"])
def test_forward_and_backward_on_the_triton_kernel(name, layout, launches):
    plan = PLANS[name]()
    gen = torch.Generator().manual_seed(7)
    positions = positions_for(plan, 6, gen)
    cos, sin = plan.cos_sin(positions)
    q = torch.randn(1, 2, 6, 18, generator=gen).requires_grad_()
    k = torch.randn(1, 1, 6, 18, generator=gen).requires_grad_()
    q_out, k_out = ropekit.apply_rotary_qk(q, k, cos, sin, layout=layout, backend="triton")
    assert len(launches) == 1
    eager = ropekit.apply_rotary_qk(q.detach(), k.detach(), cos, sin, layout=layout, backend="torch")
    torch.testing.assert_close(q_out, eager[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(k_out, eager[1], rtol=0, atol=1e-6)
    assert_close_to_reference(q_out, q, positions, plan, layout)
    assert_close_to_reference(k_out, k, positions, plan, layout)
    wq, wk = torch.randn(q.shape, generator=gen), torch.randn(k.shape, generator=gen)
    torch.autograd.backward((q_out, k_out), (wq, wk))
    assert len(launches) == 2, "the backward did not run on the Triton kernel"
    assert_close_to_reference(q.grad, wq, -positions, plan, layout)
    assert_close_to_reference(k.grad, wk, -positions, plan, layout)


def test_rotate_qk_with_per_token_tables_on_triton(launches):
    plan = PLANS["qwen2-vl"]()
    positions = positions_for(plan, 8, torch.Generator().manual_seed(2))
    cos_table, sin_table = plan.cos_sin(positions)
    q, k = torch.randn(8, 2, 16), torch.randn(8, 1, 16)
    q_out, k_out = ropekit.rotate_qk(q, k, cos_table, sin_table, positions=torch.arange(8), seq_dim=0,
                                     backend="triton")
    assert len(launches) == 1
    assert_close_to_reference(q_out, q, positions[:, None], plan, "half")
    assert_close_to_reference(k_out, k, positions[:, None], plan, "half")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_module_forward_and_backward(monkeypatch, launches):
    monkeypatch.delenv("TRITON_INTERPRET")
    from ropekit.nn import MultiAxisRotaryEmbedding

    plan = PLANS["qwen3-vl"]()
    module = MultiAxisRotaryEmbedding(plan, head_dim=18)
    positions = positions_for(plan, 64, torch.Generator().manual_seed(4))
    q = torch.randn(2, 4, 64, 18, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 64, 18, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q_out, k_out = module(q, k, positions)
    assert launches and q_out.is_cuda
    assert_close_to_reference(q_out.cpu(), q.cpu(), positions[None, None], plan, "half")
    (q_out.float().sum() + k_out.float().sum()).backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
