"""RotaryLinearAttention against an explicit O(N^2) evaluation of RoFormer eq. (19)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ropekit
from ropekit.nn import RotaryLinearAttention

torch.set_num_threads(1)

ORACLE_ATOL = 2e-6  # float32 cos/sin tables (ropekit convention) inside a float64 forward


def inv_freq_by_hand(rotary_dim: int, base: float) -> torch.Tensor:
    return torch.tensor([base ** (-2.0 * i / rotary_dim) for i in range(rotary_dim // 2)], dtype=torch.float64)


def head_rotation(position: int, head_dim: int, rotary_dim: int, base: float, layout: str) -> torch.Tensor:
    rot = torch.eye(head_dim, dtype=torch.float64)
    rot[:rotary_dim, :rotary_dim] = ropekit.rotation_matrix(position, inv_freq_by_hand(rotary_dim, base), layout=layout)
    return rot


def elu_plus_one(t: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1 written out: x + 1 for x > 0, exp(x) otherwise."""
    return torch.where(t > 0, t + 1.0, torch.exp(torch.clamp(t, max=0.0)))


def projections(module: RotaryLinearAttention, x: torch.Tensor):
    x = x.detach().double()
    batch, seq, _ = x.shape
    shape = (batch, seq, module.num_heads, module.head_dim)
    q = (x @ module.q_proj.weight.detach().double().T).reshape(shape)
    k = (x @ module.k_proj.weight.detach().double().T).reshape(shape)
    v = (x @ module.v_proj.weight.detach().double().T).reshape(shape)
    return q, k, v


def output_projection(module: RotaryLinearAttention, out: torch.Tensor) -> torch.Tensor:
    batch, seq = out.shape[:2]
    return out.reshape(batch, seq, -1) @ module.o_proj.weight.detach().double().T


def oracle_eq19(
    module: RotaryLinearAttention,
    x: torch.Tensor,
    positions: torch.Tensor,
    *,
    base: float = 10000.0,
    layout: str = "half",
    rotate_denominator: bool = False,
) -> torch.Tensor:
    """out_m = sum_n (R_m phi(q_m))^T (R_n phi(k_n)) v_n / sum_n phi(q_m)^T phi(k_n), n over all (or n <= m).

    Every pair (m, n) is evaluated explicitly. ``rotate_denominator=True`` is the *wrong* variant
    (rotated features in the denominator too), used to show the module does not do that.
    """
    q, k, v = projections(module, x)
    batch, seq, heads, d = q.shape
    phi_q, phi_k = elu_plus_one(q), elu_plus_one(k)
    out = torch.zeros_like(q)
    for b in range(batch):
        rots = [head_rotation(int(m), d, module.rope.rotary_dim, base, layout) for m in positions[b]]
        for h in range(heads):
            for m in range(seq):
                numerator = torch.zeros(d, dtype=torch.float64)
                denominator = torch.zeros((), dtype=torch.float64)
                for n in range(m + 1 if module.causal else seq):
                    rotated = (rots[m] @ phi_q[b, m, h]) @ (rots[n] @ phi_k[b, n, h])
                    numerator += rotated * v[b, n, h]
                    denominator += rotated if rotate_denominator else phi_q[b, m, h] @ phi_k[b, n, h]
                out[b, m, h] = numerator / denominator
    return output_projection(module, out)


def katharopoulos(module: RotaryLinearAttention, x: torch.Tensor) -> torch.Tensor:
    """Plain linear attention: out_m = sum_n phi(q_m).phi(k_n) v_n / sum_n phi(q_m).phi(k_n)."""
    q, k, v = projections(module, x)
    seq = q.shape[1]
    weights = torch.einsum("bmhd,bnhd->bhmn", elu_plus_one(q), elu_plus_one(k))
    if module.causal:
        weights = weights * torch.ones(seq, seq, dtype=torch.float64).tril()
    weights = weights / weights.sum(-1, keepdim=True)
    return output_projection(module, torch.einsum("bhmn,bnhd->bmhd", weights, v))


def make_module(**kwargs) -> RotaryLinearAttention:
    torch.manual_seed(kwargs.pop("seed", 0))
    return RotaryLinearAttention(**kwargs).double()


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    num_heads=st.integers(1, 2),
    head_dim=st.sampled_from([2, 4, 6]),
    layout=st.sampled_from(["half", "interleaved"]),
    causal=st.booleans(),
    base=st.sampled_from([10000.0, 100.0]),
    batch=st.integers(1, 2),
    seq=st.integers(1, 6),
)
def test_matches_explicit_eq19(data, num_heads, head_dim, layout, causal, base, batch, seq):
    rotary_dim = data.draw(st.sampled_from(list(range(2, head_dim + 1, 2))), label="rotary_dim")
    module = make_module(
        embed_dim=8, num_heads=num_heads, head_dim=head_dim, rotary_dim=rotary_dim, base=base, layout=layout,
        causal=causal,
    )
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    x = torch.randn(batch, seq, 8, dtype=torch.float64, generator=gen)
    positions = torch.randint(0, 40, (batch, seq), generator=gen)
    got = module(x, positions)
    assert got.shape == (batch, seq, 8) and got.dtype == torch.float64
    expected = oracle_eq19(module, x, positions, base=base, layout=layout)
    torch.testing.assert_close(got, expected, atol=ORACLE_ATOL, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_default_positions_and_float32(causal):
    module = RotaryLinearAttention(8, 2, causal=causal)
    x = torch.randn(2, 6, 8)
    got = module(x)
    assert got.dtype == torch.float32
    expected = oracle_eq19(module, x, torch.arange(6).expand(2, 6))
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_denominator_is_not_rotated(causal):
    module = make_module(embed_dim=8, num_heads=2, causal=causal, seed=1)
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    positions = torch.tensor([[0, 3, 7, 12, 20, 31]])
    got = module(x, positions)
    wrong = oracle_eq19(module, x, positions, rotate_denominator=True)
    right = oracle_eq19(module, x, positions)
    torch.testing.assert_close(got, right, atol=ORACLE_ATOL, rtol=0)
    # position 0 of the causal form sees only itself, where R_0 = I: compare the rest
    rows = slice(1, None) if causal else slice(None)
    assert (got[:, rows] - wrong[:, rows]).abs().amax(dim=-1).min() > 1e-4


@pytest.mark.parametrize("causal", [False, True])
def test_use_rope_false_is_katharopoulos_linear_attention(causal):
    module = make_module(embed_dim=8, num_heads=2, causal=causal, use_rope=False)
    assert module.rope is None
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(module(x), katharopoulos(module, x), atol=1e-12, rtol=0)
    # and the rotary module with the same weights is different (RoPE is applied)
    rotary = make_module(embed_dim=8, num_heads=2, causal=causal)
    rotary.load_state_dict(module.state_dict())
    assert (rotary(x) - module(x)).abs().max() > 1e-4


def test_causal_output_ignores_future_tokens():
    module = make_module(embed_dim=8, num_heads=2, causal=True)
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    changed = x.clone()
    changed[:, 4:] = torch.randn(1, 2, 8, dtype=torch.float64)
    a, b = module(x), module(changed)
    torch.testing.assert_close(a[:, :4], b[:, :4], atol=1e-12, rtol=0)
    assert (a[:, 4:] - b[:, 4:]).abs().max() > 1e-3


@settings(max_examples=15, deadline=None)
@given(shift=st.integers(0, 5000), causal=st.booleans())
def test_shifting_all_positions_leaves_output_unchanged(shift, causal):
    """Eq. (19)'s numerator depends on n - m only and its denominator on no position."""
    module = make_module(embed_dim=8, num_heads=2, causal=causal)
    x = torch.randn(1, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(shift))
    torch.testing.assert_close(module(x, torch.arange(5) + shift), module(x), atol=ORACLE_ATOL, rtol=0)


def test_half_precision_input_and_backward():
    module = RotaryLinearAttention(8, 2, causal=True).to(torch.bfloat16)
    x = torch.randn(2, 5, 8, dtype=torch.bfloat16, requires_grad=True)
    out = module(x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    out.float().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(p.grad is not None for p in module.parameters())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"embed_dim": 10, "num_heads": 4}, ValueError, "embed_dim"),
        ({"embed_dim": 12, "num_heads": 4}, ValueError, "head_dim"),
        ({"embed_dim": 8, "num_heads": 2, "head_dim": 3}, ValueError, "head_dim"),
        ({"embed_dim": 8, "num_heads": -1}, ValueError, "num_heads"),
        ({"embed_dim": 8, "num_heads": 2, "rotary_dim": 8}, ValueError, "rotary_dim"),
        ({"embed_dim": 8, "num_heads": 2, "eps": 0.0}, ValueError, "eps"),
        ({"embed_dim": 8, "num_heads": 2, "use_rope": "no"}, TypeError, "use_rope"),
        ({"embed_dim": 8, "num_heads": 2, "causal": None}, TypeError, "causal"),
    ],
)
def test_constructor_errors_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        RotaryLinearAttention(**kwargs)


def test_forward_errors_name_the_argument():
    module = RotaryLinearAttention(8, 2)
    with pytest.raises(ValueError, match="x must have shape"):
        module(torch.randn(5, 8))
    with pytest.raises(ValueError, match="x must have shape"):
        module(torch.randn(1, 5, 4))
    with pytest.raises(ValueError, match="positions"):
        module(torch.randn(1, 5, 8), torch.arange(4))
    with pytest.raises(ValueError, match="positions"):
        module(torch.randn(1, 5, 8), torch.tensor([0, 1, -2, 3, 4]))
