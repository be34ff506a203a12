"""ropekit against Liger's Triton RoPE kernel (``liger_kernel.ops.rope``), run in Triton's CPU interpreter.

Liger is an independent implementation of the half layout (transformers' ``rotate_half``
pairing) with full-width ``(1, seq, head_dim)`` tables; its kernel runs here under
``TRITON_INTERPRET=1``, so shapes stay small. Forward and backward must agree with ropekit's
``apply_rotary_qk`` to the rounding of the dtype, and both with the float64 matrices.
"""

import os

_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # needed while triton is first imported (see test_backend_triton)

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

liger_rope = pytest.importorskip("liger_kernel.ops.rope")

import ropekit  # noqa: E402

if _PREVIOUS_INTERPRET is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _PREVIOUS_INTERPRET

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def liger(q, k, cos, sin):
    """Liger's RoPE on copies (it writes into q/k's (b, s, h, d) storage), full-width tables."""
    full_cos, full_sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]
    return liger_rope.LigerRopeFunction.apply(q.clone(), k.clone(), full_cos, full_sin)


def make(batch, seq, q_heads, k_heads, head_dim, dtype, gen, requires_grad=False):
    """q and k as transformers has them: (b, h, s, d) views of (b, s, h, d) storage."""
    def rand(heads):
        x = torch.randn(batch, seq, heads, head_dim, generator=gen, dtype=torch.float64) * 3
        return x.to(dtype).transpose(1, 2).requires_grad_(requires_grad)
    return rand(q_heads), rand(k_heads)


@settings(max_examples=12, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    batch=st.integers(1, 2),
    seq=st.integers(1, 9),
    heads=st.sampled_from([(1, 1), (4, 2), (6, 1), (3, 3)]),
    head_dim=st.sampled_from([8, 16, 24, 64]),
    first=st.integers(0, 5000),
    seed=st.integers(0, 2**16),
)
def test_forward_matches_liger(dtype, batch, seq, heads, head_dim, first, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = make(batch, seq, *heads, head_dim, dtype, gen)
    positions = torch.arange(first, first + seq)
    cos, sin = ropekit.cos_sin(positions, ropekit.inv_frequencies(head_dim)[0])
    theirs = liger(q, k, cos, sin)
    ours = ropekit.apply_rotary_qk(q, k, cos, sin, layout="half")
    for x, a, b in zip((q, k), ours, theirs, strict=True):
        assert a.shape == b.shape == x.shape and a.dtype == b.dtype == dtype
        # one rounding of the same float32 value each, up to float32 evaluation order
        scale = x.double().abs().max().item()
        tol = 4 * torch.finfo(torch.float32).eps * scale if dtype == torch.float32 else torch.finfo(dtype).eps * scale
        assert (a.double() - b.double()).abs().max().item() <= tol
        ref = ropekit.apply_reference(x.double(), positions, ropekit.inv_frequencies(head_dim)[0])
        assert (a.double() - ref).abs().max().item() <= 2 * tol + 1e-6 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_matches_liger(dtype):
    gen = torch.Generator().manual_seed(3)
    q, k = make(2, 7, 4, 2, 32, dtype, gen, requires_grad=True)
    cos, sin = ropekit.cos_sin(torch.arange(100, 107), ropekit.inv_frequencies(32)[0])
    grad_q = torch.randn(q.shape, generator=gen).to(dtype)
    grad_k = torch.randn(k.shape, generator=gen).to(dtype)
    grads = []
    for run in (lambda: liger(q, k, cos, sin), lambda: ropekit.apply_rotary_qk(q, k, cos, sin)):
        q.grad = k.grad = None
        torch.autograd.backward(run(), (grad_q, grad_k))
        grads.append((q.grad.clone(), k.grad.clone()))
    for a, b in zip(*grads, strict=True):
        tol = 4 * torch.finfo(torch.float32).eps * 8 if dtype == torch.float32 else torch.finfo(dtype).eps * 8
        assert (a.double() - b.double()).abs().max().item() <= tol
