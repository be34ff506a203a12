"""A known defect of the C++ CPU kernel, kept visible: inputs whose channel axis is strided.

``ropekit_cpu.rotate`` reads such an input through a contiguous copy but allocates its output
with ``empty_like(x)``, i.e. with x's strided channels, and then writes it as if they were unit
stride. Autograd can hand the rotation such a tensor (a transposed gradient), which is how it
was found (``RotaryLinearAttention`` guards against it). The test is a strict xfail: when the
kernel is fixed it passes, the xfail turns into a failure, and this file should go.
"""

import pytest
import torch

import ropekit

pytestmark = pytest.mark.skipif("cpu" not in ropekit.ops.available(), reason="the C++ CPU kernel did not build")


@pytest.mark.xfail(strict=True, reason="C++ CPU kernel: output allocated with the input's strided channels")
@pytest.mark.parametrize("form", ["apply_rotary", "rotate"])
def test_strided_channels_give_the_eager_result(form):
    x = torch.randn(2, 4, 16, 10).transpose(-1, -2)  # (batch, heads, seq=10, head_dim=16), channel stride 10
    cos, sin = ropekit.cos_sin(torch.arange(10), ropekit.inv_frequencies(16)[0])
    if form == "apply_rotary":
        results = [ropekit.apply_rotary(x, cos, sin, backend=b) for b in ("cpu", "torch")]
    else:
        results = [ropekit.rotate(x, cos, sin, seq_dim=-2, backend=b) for b in ("cpu", "torch")]
    torch.testing.assert_close(results[0], results[1])
