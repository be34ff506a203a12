"""rotary-embedding-torch's ``get_axial_freqs`` as an oracle for axial plans ("lang" and "pixel" ladders).

``get_axial_freqs(*dims)`` returns float32 *angles* ``(*dims, n_axes * dim)`` in the interleaved layout,
axis ``a`` owning the ``a``-th block of ``dim / 2`` pairs; its ``apply_rotary_emb`` rotates the first
``n_axes * dim`` channels and leaves the rest.
"""

import pytest
import torch

ret = pytest.importorskip("rotary_embedding_torch")

import ropekit  # noqa: E402
from ropekit.multiaxis import axial, axial_pixel, patch_grid  # noqa: E402

H, W, D = 4, 6, 16


@pytest.mark.parametrize("freqs_for", ["lang", "pixel"])
def test_axial_freqs_and_apply(freqs_for):
    if freqs_for == "lang":
        module = ret.RotaryEmbedding(dim=D, freqs_for="lang", theta=10000)
        plan, positions, atol = axial((D, D), 10000.0), patch_grid((H, W)), 1e-6
    else:
        module = ret.RotaryEmbedding(dim=D, freqs_for="pixel", max_freq=256)
        plan, positions, atol = axial_pixel((D, D), 256.0), patch_grid((H, W), kind="pixel"), 5e-5
    angles = module.get_axial_freqs(H, W)  # (H, W, 2 * D)
    assert torch.equal(angles[..., 0::2], angles[..., 1::2])
    torch.testing.assert_close(plan.angles(positions).reshape(H, W, D), angles[..., 0::2].double(), rtol=0, atol=atol)
    t = torch.randn(2, H, W, 2 * D + 4)
    expected = ret.apply_rotary_emb(angles, t)
    cos, sin = plan.cos_sin(positions.reshape(H, W, 2))
    got = ropekit.apply_rotary(t, cos, sin, layout="interleaved")
    torch.testing.assert_close(got, expected, rtol=0, atol=atol * 20)
    assert torch.equal(got[..., 2 * D:], t[..., 2 * D:])


def test_offsets_shift_each_axis():
    module = ret.RotaryEmbedding(dim=D, freqs_for="lang", theta=10000)
    angles = module.get_axial_freqs(H, W, offsets=(2, -3))
    positions = patch_grid((H, W), offset=(2, -3))
    torch.testing.assert_close(axial((D, D)).angles(positions).reshape(H, W, D), angles[..., 0::2].double(),
                               rtol=0, atol=1e-6)
