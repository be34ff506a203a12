"""``apply_rotary_qk``: q and k in one call, against the float64 oracle and two ``apply_rotary`` calls.

The pair must be exactly two single rotations (bit for bit, on every backend), with the
gradients of a rotation by ``-theta``; the oracle is ``apply_reference`` (explicit matrices).
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ropekit import apply_reference, apply_rotary, apply_rotary_qk, base_inv_freq, cos_sin, ops

LAYOUTS = ["half", "interleaved"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def tables(positions, inv_freq, dtype):
    if dtype == torch.float64:
        angles = positions.to(torch.float64)[..., None] * inv_freq.to(torch.float64)
        return angles.cos(), angles.sin()
    return cos_sin(positions, inv_freq)


def assert_bits(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


@st.composite
def qk_cases(draw):
    """q of (batch, q_heads, seq, head_dim), k with another head count, tables per token or per sequence."""
    batch, seq = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    k_heads = draw(st.integers(1, 5))
    q_heads = k_heads * draw(st.integers(1, 4))  # GQA groups
    half = draw(st.sampled_from([1, 3, 4, 8, 16, 20, 32]))
    head_dim = 2 * half + draw(st.sampled_from([0, 0, 2, 6]))
    return {
        "batch": batch, "seq": seq, "q_heads": q_heads, "k_heads": k_heads, "half": half, "head_dim": head_dim,
        "per_sequence": draw(st.booleans()), "bshd": draw(st.booleans()),
        "dtype": draw(st.sampled_from(DTYPES)), "layout": draw(st.sampled_from(LAYOUTS)),
        "inplace": draw(st.booleans()), "backend": draw(st.sampled_from(["auto", "torch"])),
        "seed": draw(st.integers(0, 2**16)),
    }


def make_case(c):
    gen = torch.Generator().manual_seed(c["seed"])
    b, s, d = c["batch"], c["seq"], c["head_dim"]

    def rand(heads):
        if c["bshd"]:  # (b, s, h, d) storage, seen as (b, h, s, d)
            return (torch.randn(b, s, heads, d, generator=gen, dtype=torch.float64) * 3).to(c["dtype"]).transpose(1, 2)
        return (torch.randn(b, heads, s, d, generator=gen, dtype=torch.float64) * 3).to(c["dtype"])

    q, k = rand(c["q_heads"]), rand(c["k_heads"])
    inv_freq = base_inv_freq(2 * c["half"])
    if c["per_sequence"]:  # decode-like: each sequence at its own positions
        positions = torch.randint(0, 10**5, (b, s), generator=gen)
        cos, sin = tables(positions, inv_freq, c["dtype"])
        cos, sin = cos[:, None], sin[:, None]
    else:
        positions = torch.randint(0, 10**5, (s,), generator=gen)
        cos, sin = tables(positions, inv_freq, c["dtype"])
    return q, k, cos, sin, positions, inv_freq


@given(case=qk_cases())
def test_pair_matches_reference_and_single_calls(case):
    q, k, cos, sin, positions, inv_freq = make_case(case)
    layout, inplace, backend = case["layout"], case["inplace"], case["backend"]
    expected = [apply_rotary(t, cos, sin, layout=layout, backend=backend) for t in (q, k)]
    q_in, k_in = (q.clone(), k.clone()) if inplace else (q, k)
    q_out, k_out = apply_rotary_qk(q_in, k_in, cos, sin, layout=layout, inplace=inplace, backend=backend)
    assert (q_out is q_in and k_out is k_in) == inplace
    assert_bits(q_out, expected[0])
    assert_bits(k_out, expected[1])
    pos = positions[:, None, :] if positions.dim() == 2 else positions
    eps = torch.finfo(q.dtype).eps
    for x, y in ((q, q_out), (k, k_out)):
        ref = apply_reference(x.double(), pos.expand(x.shape[:-1]), inv_freq, layout=layout)
        scale = max(ref.abs().max().item(), 1.0)
        bound = 1e-12 * scale if x.dtype == torch.float64 else (8 if x.dtype == torch.float32 else 2) * eps * scale
        assert (y.double() - ref).abs().max().item() <= bound


def decode_inputs(dtype=torch.float32, q_heads=32, k_heads=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(4, q_heads, 1, 128, generator=gen).to(dtype)
    k = torch.randn(4, k_heads, 1, 128, generator=gen).to(dtype)
    cos, sin = cos_sin(torch.randint(0, 4096, (4, 1, 1), generator=gen), base_inv_freq(128))
    return q, k, cos, sin


@pytest.mark.skipif("cpu" not in ops.available(), reason="C++ CPU kernel unavailable")
def test_decode_step_is_one_native_call(monkeypatch):
    """On the CPU q and k go to the kernel once, not once per tensor, on the first call (checks)
    and on the next ones (the fast path)."""
    from ropekit import functional
    from ropekit.ops import prepared

    q, k, cos, sin = decode_inputs()
    cpu = ops.get("cpu")
    calls = {"pair": 0, "single": 0}

    def counting(fn, name):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    monkeypatch.setattr(cpu, "_qk", counting(cpu._qk, "pair"))
    monkeypatch.setattr(cpu, "_one", counting(cpu._one, "single"))
    expected = apply_rotary(q, cos, sin, backend="torch"), apply_rotary(k, cos, sin, backend="torch")
    prepared.clear()
    for step in range(1, 4):
        q_out, k_out = apply_rotary_qk(q, k, cos, sin)
        assert calls == {"pair": step, "single": 0}
        assert len(prepared.calls) == 1
        # the next calls take the fast path: they never reach the checks
        monkeypatch.setattr(functional, "check_tables", lambda *args: pytest.fail("checks ran again"))
        assert_bits(q_out, expected[0])
        assert_bits(k_out, expected[1])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_gradcheck_and_gradgradcheck(layout, inplace, backend):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 3, 10, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 3, 10, generator=gen, dtype=torch.float64, requires_grad=True)
    cos, sin = tables(torch.randint(0, 10**4, (3,), generator=gen), base_inv_freq(8), torch.float64)

    def f(a, b):
        if inplace:
            a, b = a * 1.0, b * 1.0  # non-leaves to rotate in place
        return apply_rotary_qk(a, b, cos, sin, layout=layout, inplace=inplace, backend=backend)

    assert torch.autograd.gradcheck(f, (q, k), eps=1e-6, atol=1e-8)
    assert torch.autograd.gradgradcheck(f, (q, k), eps=1e-6, atol=1e-8)


def test_gradients_are_the_inverse_rotation_and_reach_only_what_requires_them():
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 5, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 4, 5, 16, generator=gen, dtype=torch.float64)  # no grad
    w = torch.randn(2, 4, 5, 16, generator=gen, dtype=torch.float64)
    positions = torch.randint(0, 10**5, (5,), generator=gen)
    inv_freq = base_inv_freq(16)
    cos, sin = tables(positions, inv_freq, torch.float64)
    q_out, k_out = apply_rotary_qk(q, k, cos, sin)
    assert q_out.requires_grad
    (q_out * w).sum().backward()
    torch.testing.assert_close(q.grad, apply_reference(w, positions, -inv_freq), rtol=0, atol=1e-12)
    assert k.grad is None


def test_learned_tables_get_gradients():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    cos, sin = tables(torch.arange(3), base_inv_freq(4), torch.float64)
    cos, sin = cos.clone().requires_grad_(), sin.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b, c, s: apply_rotary_qk(a, b, c, s), (q, k, cos, sin), eps=1e-6,
                                    atol=1e-8)


@pytest.mark.parametrize("name", ["cpu", "torch"])
def test_every_cpu_backend_pairs(name):
    if name not in ops.available():
        pytest.skip(f"backend {name} unavailable")
    for dtype in DTYPES:
        q, k, cos, sin = decode_inputs(dtype, seed=6)
        if dtype == torch.float64:
            cos, sin = cos.double(), sin.double()
        q_out, k_out = apply_rotary_qk(q, k, cos, sin, layout="interleaved", backend=name)
        assert_bits(q_out, apply_rotary(q, cos, sin, layout="interleaved", backend="torch"))
        assert_bits(k_out, apply_rotary(k, cos, sin, layout="interleaved", backend="torch"))


def test_errors_name_the_argument():
    q, k, cos, sin = decode_inputs()
    with pytest.raises(TypeError, match="^q must"):
        apply_rotary_qk(q.numpy(), k, cos, sin)
    with pytest.raises(TypeError, match="^k must have a floating dtype"):
        apply_rotary_qk(q, k.long(), cos, sin)
    with pytest.raises(ValueError, match="same head_dim"):
        apply_rotary_qk(q, k[..., :64], cos, sin)
    with pytest.raises(ValueError, match="distinct q and k"):
        apply_rotary_qk(q, q, cos, sin, inplace=True)
    with pytest.raises(ValueError, match="layout"):
        apply_rotary_qk(q, k, cos, sin, layout="spiral")
    with pytest.raises(TypeError, match="inplace must be a bool"):
        apply_rotary_qk(q, k, cos, sin, inplace=1)
    with pytest.raises(ValueError, match="do not broadcast"):
        apply_rotary_qk(q, k[:2], cos, sin)  # tables of 4 sequences against k of 2
    with pytest.raises(ValueError, match="backend must be"):
        apply_rotary_qk(q, k, cos, sin, backend="cuda")
    q_out, _ = apply_rotary_qk(q, q, cos, sin)  # out of place, the same tensor twice is fine
    assert_bits(q_out, apply_rotary(q, cos, sin))


# -- rotate_qk: positions looked up in the full tables (here: gathered, then the CPU kernel) --------------
def test_rotate_qk_packed_varlen_on_the_cpu():
    """Three sequences packed into (tokens, heads, head_dim), each from its own offset."""
    from ropekit import rotate_qk

    gen = torch.Generator().manual_seed(7)
    inv_freq = base_inv_freq(24)
    cos_table, sin_table = cos_sin(torch.arange(64), inv_freq)
    lengths, offsets = [5, 1, 7], torch.tensor([0, 30, 9])
    cu_seqlens = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    q = torch.randn(13, 4, 32, generator=gen, dtype=torch.float64)
    k = torch.randn(13, 2, 32, generator=gen, dtype=torch.float64)
    q_out, k_out = rotate_qk(q, k, cos_table.double(), sin_table.double(), cu_seqlens=cu_seqlens, offsets=offsets,
                             seq_dim=0, layout="interleaved")
    pos = torch.cat([torch.arange(n) + int(o) for n, o in zip(lengths, offsets, strict=True)])[:, None]
    for x, y in ((q, q_out), (k, k_out)):
        torch.testing.assert_close(y, apply_reference(x, pos.expand(x.shape[:-1]), inv_freq, layout="interleaved"),
                                   rtol=0, atol=1e-6)  # float32 tables
    # the same as gathering the rows and rotating with apply_rotary_qk, bit for bit (float32)
    q32, k32 = q.float(), k.float()
    got = rotate_qk(q32, k32, cos_table, sin_table, cu_seqlens=cu_seqlens, offsets=offsets, seq_dim=0)
    rows = pos[:, 0]
    expected = apply_rotary_qk(q32, k32, cos_table[rows][:, None], sin_table[rows][:, None])
    for a, b in zip(got, expected, strict=True):
        assert_bits(a, b)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        rotate_qk(q32, k32, cos_table, sin_table, cu_seqlens=torch.tensor([1, 13]), seq_dim=0)
    with pytest.raises(ValueError, match="outside the cos/sin tables"):
        rotate_qk(q32[None], k32[None], cos_table, sin_table, offsets=60, seq_dim=1)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_inplace_pair_bumps_both_versions(backend):
    q, k, cos, sin = decode_inputs(seed=8)
    for _ in range(2):  # the second call takes the decode fast path
        before = q._version, k._version
        apply_rotary_qk(q, k, cos, sin, inplace=True, backend=backend)
        assert q._version > before[0] and k._version > before[1]
