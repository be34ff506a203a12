"""Inputs whose channel axis is strided (a transposed view, or the gradient autograd hands back from a
matrix product): every CPU form reads them through a unit-stride copy and allocates its output like that
copy. A regression test: the C++ kernel once allocated the output like the strided input and wrote it as
if its channels were contiguous (found through ``RotaryLinearAttention``'s backward)."""

import pytest
import torch

import ropekit
from ropekit.nn import RotaryLinearAttention

pytestmark = pytest.mark.skipif("cpu" not in ropekit.ops.available(), reason="the C++ CPU kernel did not build")


def strided(*shape):
    """A (batch, heads, seq, head_dim) float32 tensor whose channel stride is ``seq`` (not 1)."""
    b, h, s, d = shape
    return torch.randn(b, h, d, s).transpose(-1, -2)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("inplace", [False, True])
def test_every_form_on_strided_channels_gives_the_eager_result(layout, inplace):
    torch.manual_seed(0)
    q, k = strided(2, 4, 10, 16), strided(2, 2, 10, 16)
    assert q.stride(-1) != 1 and k.stride(-1) != 1
    cos, sin = ropekit.cos_sin(torch.arange(10), ropekit.inv_frequencies(16)[0])
    forms = {
        "apply_rotary": lambda x, y, b: (ropekit.apply_rotary(x, cos, sin, layout=layout, inplace=inplace, backend=b),),
        "apply_rotary_qk": lambda x, y, b: ropekit.apply_rotary_qk(x, y, cos, sin, layout=layout, inplace=inplace,
                                                                   backend=b),
        "rotate": lambda x, y, b: (ropekit.rotate(x, cos, sin, seq_dim=-2, layout=layout, inplace=inplace, backend=b),),
        "rotate_qk": lambda x, y, b: ropekit.rotate_qk(x, y, cos, sin, positions=torch.arange(10).flip(0), seq_dim=-2,
                                                       layout=layout, inplace=inplace, backend=b),
    }
    for name, form in forms.items():
        got = form(q.clone().transpose(-1, -2).contiguous().transpose(-1, -2) if inplace else q,
                   k.clone().transpose(-1, -2).contiguous().transpose(-1, -2) if inplace else k, "cpu")
        want = form(q.clone(), k.clone(), "torch")
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


def test_backward_of_a_strided_gradient_is_the_conjugate_rotation():
    """The gradient of ``rot(x)^T @ W`` reaches the rotation transposed (channel stride = seq)."""
    torch.manual_seed(1)
    cos, sin = ropekit.cos_sin(torch.arange(6), ropekit.inv_frequencies(8)[0])
    x = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    w = torch.randn(2, 6, 6, dtype=torch.float64)
    grads, seen = {}, []
    for backend in ("cpu", "torch"):
        xb = x.clone().float().requires_grad_(True)
        y = ropekit.apply_rotary(xb, cos, sin, backend=backend)
        y.register_hook(lambda g: seen.append(g.stride(-1)))
        (y.transpose(-1, -2) @ w.float()).square().sum().backward()
        grads[backend] = xb.grad
    assert seen == [6, 6]  # the gradient the rotation's backward got was strided
    torch.testing.assert_close(grads["cpu"], grads["torch"], rtol=1e-5, atol=1e-5)


def test_linear_attention_gradients_equal_the_eager_backend():
    """The module that found the defect (one chunk covering the sequence), its former workaround gone:
    gradients of the input and every weight equal those of the eager backend."""
    torch.manual_seed(2)
    x = torch.randn(2, 12, 32)
    grads = {}
    for backend in ("cpu", "torch"):
        torch.manual_seed(3)
        attn = RotaryLinearAttention(32, 4, causal=True, chunk_size=16)
        attn.rope.backend = backend
        xb = x.clone().requires_grad_(True)
        attn(xb).square().sum().backward()
        grads[backend] = (xb.grad, *[p.grad for p in attn.parameters()])
    for a, b in zip(grads["cpu"], grads["torch"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
