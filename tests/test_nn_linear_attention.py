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


# -- the causal form, chunk by chunk ---------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(seq=st.integers(1, 11), chunk_size=st.integers(1, 13), layout=st.sampled_from(["half", "interleaved"]),
       seed=st.integers(0, 2**16))
def test_causal_chunks_equal_the_quadratic_definition(seq, chunk_size, layout, seed):
    """RoFormer eq. (19), causal, evaluated pair by pair, whatever the chunk size (1, dividing or not, > seq)."""
    torch.manual_seed(seed)
    module = RotaryLinearAttention(8, 2, layout=layout, causal=True, chunk_size=chunk_size).double()
    x = torch.randn(2, seq, 8, dtype=torch.float64)
    positions = torch.randint(0, 60, (2, seq))
    torch.testing.assert_close(module(x, positions), oracle_eq19(module, x, positions, layout=layout),
                               atol=ORACLE_ATOL, rtol=0)


def test_causal_chunks_gradients():
    """The backward through the chunk loop is the derivative of the same sums (finite differences, float64)."""
    from ropekit.nn import causal_linear_attention

    gen = torch.Generator().manual_seed(0)
    inputs = [torch.rand(1, 2, 7, 4, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(5)]
    assert torch.autograd.gradcheck(lambda *t: causal_linear_attention(*t, chunk_size=3), inputs)


MEMORY_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from ropekit.nn import causal_linear_attention
form, sizes = sys.argv[1], [int(n) for n in sys.argv[2:]]
heads, d = 4, 64

def run(seq):
    gen = torch.Generator().manual_seed(0)
    rq, rk, pq, pk, v = (torch.rand(1, heads, seq, d, generator=gen) for _ in range(5))
    if form == "chunked":
        return causal_linear_attention(rq, rk, pq, pk, v)
    if form == "prefix":  # the former causal path: one d x d prefix sum per position
        kv = torch.einsum("bhnd,bhne->bhnde", rk, v).cumsum(dim=2)
        return torch.einsum("bhnd,bhnde->bhne", rq, kv) / (pq * pk.cumsum(dim=2)).sum(-1, keepdim=True)
    weights = (rq @ rk.transpose(-1, -2)).tril()  # the definition: an N x N matrix per head
    return (weights @ v) / (pq @ pk.transpose(-1, -2)).tril().sum(-1, keepdim=True)

def status_kib(key):
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith(key + ":"))

with torch.no_grad():
    run(64)
    for seq in sizes:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # reset the peak (VmHWM) to the current resident size
        before = status_kib("VmRSS")
        run(seq)
        print(status_kib("VmHWM") - before)
"""


def peak_growth_mib(form: str, *sizes: int) -> tuple[float, ...]:
    """Peak resident memory (Linux VmHWM, reset before each run) added by one forward at each size, MiB."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, form, *map(str, sizes)], capture_output=True,
                          text=True, timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    return tuple(int(line) / 1024 for line in done.stdout.split())


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_causal_peak_memory_grows_linearly_not_with_the_square():
    """Peak memory at N and 4N tokens (4 heads of 64, float32): the chunked form adds little beyond its inputs.

    Inputs and output are 6 tensors of N * 4 * 64 floats (6 MiB at N = 1024). The growth from N to
    4N must stay within twice what those tensors grow by (the extra memory does not depend on N),
    and must be 4x-like. The same meter sees the former prefix-sum form (a d x d matrix per
    position) and the quadratic definition (an N x N matrix per head) blow far past that bound.
    """
    small, large = 1024, 4096
    io_growth = 6 * (large - small) * 4 * 64 * 4 / 2**20  # MiB
    growth = {form: peak_growth_mib(form, small, large) for form in ("chunked", "prefix", "quadratic")}
    chunked = growth["chunked"]
    assert chunked[1] - chunked[0] <= 2 * io_growth, growth
    assert chunked[1] <= 5 * chunked[0] + 4, growth
    for control in ("prefix", "quadratic"):
        assert growth[control][1] - growth[control][0] > 4 * io_growth, growth
    assert growth["quadratic"][1] > 10 * growth["quadratic"][0], growth  # the square shows


def test_chunk_size_is_checked():
    with pytest.raises(ValueError, match="chunk_size"):
        RotaryLinearAttention(8, 2, causal=True, chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size"):
        RotaryLinearAttention(8, 2, causal=True, chunk_size=2.0)


@pytest.mark.parametrize("seq", [5, 8, 13])  # one chunk covering the sequence, exactly one, several
def test_gradients_agree_on_every_backend(seq):
    """One chunk over the whole sequence hands the rotation a transposed gradient: still exact on each backend."""
    available = ropekit.ops.available()
    torch.manual_seed(0)
    reference = RotaryLinearAttention(16, 2, causal=True, chunk_size=8)
    reference.rope.backend = "torch"
    x = torch.randn(3, seq, 16)
    reference(x).square().sum().backward()
    runs_here = [b for b in ("cpu", "triton") if b in available and ropekit.ops.get(b).cannot_run(x) is None]
    for backend in runs_here:  # triton runs CPU tensors only under TRITON_INTERPRET=1
        module = RotaryLinearAttention(16, 2, causal=True, chunk_size=8)
        module.load_state_dict(reference.state_dict())
        module.rope.backend = backend
        module(x).square().sum().backward()
        for got, want in zip(module.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5)
