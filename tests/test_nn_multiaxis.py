"""MultiAxisRotaryEmbedding and MixedRotaryEmbedding: shapes, errors, and RoPE-Mixed's gradients by hand.

The rotations themselves are checked against the float64 reference in test_multiaxis_kernels.py and
against timm in test_peer_timm.py; here, an independent float64 derivation of RoPE-Mixed's gradient.
"""

import pytest
import torch

from ropekit import base_inv_freq
from ropekit.multiaxis import named_plan, patch_grid
from ropekit.nn import MixedRotaryEmbedding, MultiAxisRotaryEmbedding
from ropekit.scaling import DynamicNTK


def test_mixed_gradient_equals_a_float64_derivation():
    module = MixedRotaryEmbedding(8, 2, generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.zeros(1, 2), patch_grid((2, 3), indexing="xy").float()])  # a class token first
    x = torch.randn(1, 2, 7, 8, dtype=torch.float64)
    weight = torch.randn(1, 2, 7, 8, dtype=torch.float64)
    out, _ = module(x, None, positions)
    (out.double() * weight).sum().backward()
    # by hand: interleaved pairs (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) with angle = x f_x + y f_y per head and pair
    freqs = module.freqs.detach().double().requires_grad_()
    angles = positions.double() @ freqs  # (heads, N, pairs)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    y1 = x1 * angles.cos() - x2 * angles.sin()
    y2 = x2 * angles.cos() + x1 * angles.sin()
    (y1 * weight[..., 0::2] + y2 * weight[..., 1::2]).sum().backward()
    torch.testing.assert_close(module.freqs.grad.double(), freqs.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[:, :, 0].double(), x[:, :, 0], rtol=0, atol=1e-6)  # the class token: identity


def test_mixed_tokens_before_heads():
    module = MixedRotaryEmbedding(8, 3)
    positions = patch_grid((2, 2), indexing="xy")
    q = torch.randn(2, 3, 4, 8)
    expected, _ = module(q, None, positions)
    got, _ = module(q.transpose(1, 2), None, positions, seq_dim=-3)
    torch.testing.assert_close(got.transpose(1, 2), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda m, q: m(q, None), ValueError, ["positions", "tables", "exactly one"]),
        (lambda m, q: m(q, None, torch.zeros(4, 2)), ValueError, ["n_axes=3", "(4, 2)"]),
        (lambda m, q: m(q, None, torch.zeros(5, 3)), ValueError, ["5 tokens", "4 along seq_dim=-2"]),
        (lambda m, q: m(q, None, torch.zeros(2, 2, 4, 3)), ValueError, ["(seq, n_axes) or (batch, seq, n_axes)"]),
        (lambda m, q: m(q[..., :8], None, torch.zeros(4, 3)), ValueError, ["head_dim=16"]),
        (lambda m, q: m(q, None, torch.zeros(4, 3), seq_dim=-1), ValueError, ["seq_dim", "-1"]),
    ],
)
def test_multi_axis_module_errors(call, error, words):
    module = MultiAxisRotaryEmbedding(named_plan("qwen3-vl", head_dim=16, section=(2, 3, 3)))
    with pytest.raises(error) as info:
        call(module, torch.randn(1, 2, 4, 16))
    for word in words:
        assert word in str(info.value)


def test_module_construction_errors():
    plan = named_plan("flux")
    with pytest.raises(TypeError, match="plan must be a ropekit.AxisPlan, got dict"):
        MultiAxisRotaryEmbedding({})
    with pytest.raises(ValueError, match=r"head_dim \(64\) is smaller than the plan's rotary_dim \(128\)"):
        MultiAxisRotaryEmbedding(plan, head_dim=64)
    with pytest.raises(ValueError, match="layout"):
        MultiAxisRotaryEmbedding(plan, layout="spiral")
    with pytest.raises(ValueError, match="head_dim divisible by 4"):
        MixedRotaryEmbedding(6, 2)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        MixedRotaryEmbedding(8, 0)
    with pytest.raises(ValueError, match=r"has 4 heads, this module was built for num_heads=1"):
        MixedRotaryEmbedding(8, 1)(torch.randn(1, 1, 4, 8), None, patch_grid((2, 2)), seq_dim=0)
    qwen = {"model_type": "qwen2_vl", "hidden_size": 1024, "num_attention_heads": 8, "max_position_embeddings": 4096,
            "rope_scaling": {"type": "dynamic", "factor": 2.0, "mrope_section": [16, 24, 24]}}
    with pytest.raises(ValueError, match="fixed_seq_len"):
        MultiAxisRotaryEmbedding.from_hf(qwen)
    assert "AxisPlan(pairs=64" in repr(MultiAxisRotaryEmbedding(plan))
    from ropekit import RopeConfig

    rope = RopeConfig.from_hf(qwen, fixed_seq_len=8192)
    assert isinstance(rope.scaling, DynamicNTK)
    module = MultiAxisRotaryEmbedding.from_config(rope)
    assert module.plan == rope.axis_plan() == rope.axes  # frozen at fixed_seq_len: NTK-stretched frequencies
    assert module.plan.inv_freq[-1] < base_inv_freq(128, 10000.0)[-1]
