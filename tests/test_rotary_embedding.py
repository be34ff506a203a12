"""``RotaryEmbedding`` (module) against the float64 matrix oracle, for every way of naming positions."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ropekit import RotaryEmbedding, apply_reference, base_inv_freq
from ropekit.nn import rotary as rotary_module

LAYOUTS = ["half", "interleaved"]


def oracle(x, positions, rotary_dim, layout, base=10000.0):
    return apply_reference(x, positions, base_inv_freq(rotary_dim, base), layout=layout)


def assert_float32_close(out, ref, x):
    assert out.dtype == x.dtype and out.shape == x.shape
    err = float((out.double() - ref).abs().max()) if out.numel() else 0.0
    assert err < 4e-6 * max(1.0, float(x.abs().max())), err


@given(
    layout=st.sampled_from(LAYOUTS),
    head_dim=st.sampled_from([8, 16]),
    rotary_frac=st.sampled_from([1.0, 0.5]),
    seq_dim=st.sampled_from([-2, -3, 0]),
    offset=st.integers(0, 5000),
    seed=st.integers(0, 1000),
)
def test_forward_seq_dims(layout, head_dim, rotary_frac, seq_dim, offset, seed):
    rotary_dim = int(head_dim * rotary_frac)
    g = torch.Generator().manual_seed(seed)
    b, hq, hk, s = 2, 4, 2, 5
    if seq_dim == -2:  # (b, h, s, d)
        q, k = torch.randn(b, hq, s, head_dim, generator=g), torch.randn(b, hk, s, head_dim, generator=g)
        pos = torch.arange(s) + offset  # broadcasts against (b, h, s)
    elif seq_dim == -3:  # (b, s, h, d)
        q, k = torch.randn(b, s, hq, head_dim, generator=g), torch.randn(b, s, hk, head_dim, generator=g)
        pos = (torch.arange(s) + offset)[:, None]
    else:  # packed (tokens, h, d)
        q, k = torch.randn(s, hq, head_dim, generator=g), torch.randn(s, hk, head_dim, generator=g)
        pos = (torch.arange(s) + offset)[:, None]
    rope = RotaryEmbedding(head_dim, rotary_dim=rotary_dim, layout=layout)
    q_out, k_out = rope(q, k, offset=offset, seq_dim=seq_dim)
    assert_float32_close(q_out, oracle(q, pos, rotary_dim, layout), q)
    assert_float32_close(k_out, oracle(k, pos, rotary_dim, layout), k)
    assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])
    # explicit positions give the same result as the offset
    q_pos, _ = rope(q, None, positions=torch.arange(s) + offset, seq_dim=seq_dim)
    assert torch.equal(q_pos, q_out)


@given(layout=st.sampled_from(LAYOUTS), seq_dim=st.sampled_from([-2, -3]), seed=st.integers(0, 1000))
def test_batched_positions(layout, seq_dim, seed):
    """positions of shape (batch, seq): padded batches, KV-cache decoding, packed documents."""
    g = torch.Generator().manual_seed(seed)
    b, h, s, d = 3, 2, 6, 16
    positions = torch.randint(0, 3000, (b, s), generator=g)
    q = torch.randn(b, h, s, d, generator=g)
    if seq_dim == -3:
        q = q.transpose(1, 2).contiguous()  # (b, s, h, d)
        pos_b = positions[:, :, None]
    else:
        pos_b = positions[:, None, :]
    rope = RotaryEmbedding(d, layout=layout)
    q_out, _ = rope(q, None, positions=positions, seq_dim=seq_dim)
    assert_float32_close(q_out, oracle(q, pos_b, d, layout), q)
    # each batch row alone gives the same bits
    for i in range(b):
        row, _ = rope(q[i : i + 1], None, positions=positions[i], seq_dim=seq_dim)
        assert torch.equal(row[0], q_out[i])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
def test_any_integer_position_dtype(dtype):
    """Every integer dtype indexes the tables (uint8 must not act as a boolean mask)."""
    rope = RotaryEmbedding(8)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 4, 8, generator=g)
    positions = torch.tensor([[0, 1, 2, 3], [7, 100, 1, 1]])
    got, _ = rope(q, None, positions=positions.to(dtype))
    assert_float32_close(got, oracle(q, positions[:, None, :], 8, "half"), q)
    cos, _ = rope.cos_sin(positions.to(dtype))
    assert cos.shape == (2, 4, 4)


def test_tensor_offset_per_sequence():
    g = torch.Generator().manual_seed(1)
    b, h, s, d = 3, 2, 4, 8
    q = torch.randn(b, h, s, d, generator=g)
    k = torch.randn(b, 1, s, d, generator=g)
    offset = torch.tensor([0, 17, 1000])
    rope = RotaryEmbedding(d, layout="interleaved")
    q_out, k_out = rope(q, k, offset=offset)
    pos = (offset[:, None] + torch.arange(s))[:, None, :]
    assert_float32_close(q_out, oracle(q, pos, d, "interleaved"), q)
    assert_float32_close(k_out, oracle(k, pos, d, "interleaved"), k)
    # a 0-d tensor offset behaves like the int
    q_0d, _ = rope(q, None, offset=torch.tensor(17))
    q_int, _ = rope(q, None, offset=17)
    assert torch.equal(q_0d, q_int)


def test_tables_grow_on_demand():
    rope = RotaryEmbedding(16, layout="half")
    q = torch.randn(1, 2, 3, 16)
    rope(q, None)  # builds the initial cache
    initial = rope.tables(1)[0].shape[0]
    far = initial + 12345
    positions = torch.tensor([0, initial - 1, far])
    q_out, _ = rope(q, None, positions=positions)
    assert_float32_close(q_out, oracle(q, positions, 16, "half"), q)
    cos, sin = rope.tables(far + 1)
    assert cos.shape[0] > far and cos.dtype == torch.float32
    # the grown table still holds the early positions correctly (nothing truncated or shifted)
    again, _ = rope(q, None, positions=torch.tensor([0, 1, 2]))
    assert_float32_close(again, oracle(q, torch.tensor([0, 1, 2]), 16, "half"), q)


def test_cos_sin_gather_matches_table_rows():
    rope = RotaryEmbedding(8)
    positions = torch.tensor([[5, 0], [300, 7]])
    cos, sin = rope.cos_sin(positions)
    assert cos.shape == (2, 2, 4)
    angles = positions.double()[..., None] * base_inv_freq(8)
    assert (cos.double() - angles.cos()).abs().max() < 1e-7
    assert (sin.double() - angles.sin()).abs().max() < 1e-7


@pytest.mark.parametrize("layout", LAYOUTS)
def test_module_to_bfloat16_keeps_tables(layout):
    """transformers #25681: model.to(bf16) must not downcast inv_freq or the tables."""
    rope = RotaryEmbedding(64, layout=layout)
    rope.tables(10)
    rope = rope.to(torch.bfloat16)
    positions = torch.arange(20000, 20016)
    q = torch.randn(1, 2, 16, 64).to(torch.bfloat16)
    q_out, _ = rope(q, None, positions=positions)
    assert q_out.dtype == torch.bfloat16
    assert rope.tables(1)[0].dtype == torch.float32 and rope.inv_freq.dtype == torch.float64
    ref = oracle(q, positions, 64, layout)
    # the result is the exact rotation rounded once to bf16: within half a bf16 ulp (+ float32 noise)
    bound = 2.0**-8 * ref.abs() * (1 + 1e-3) + 1e-5
    assert bool(((q_out.double() - ref).abs() <= bound).all())
    # a bf16 inv_freq (what the bug produces) misses the same bound by far
    bad = (positions.double()[:, None] * base_inv_freq(64).to(torch.bfloat16).double())
    x1, x2 = q.double()[..., :32], q.double()[..., 32:]
    wrong = torch.cat((x1 * bad.cos() - x2 * bad.sin(), x2 * bad.cos() + x1 * bad.sin()), dim=-1)
    assert (wrong - ref).abs().max() > 0.1


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seq_dim", [-2, -3])
def test_inplace_mode(layout, seq_dim):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 5, 8, generator=g)
    k = torch.randn(2, 1, 5, 8, generator=g) if seq_dim == -2 else torch.randn(2, 5, 1, 8, generator=g)
    if seq_dim == -3:
        q = q.transpose(1, 2)  # non-contiguous (b, s, h, d)
    rope = RotaryEmbedding(8, layout=layout)
    want_q, want_k = rope(q, k, offset=9, seq_dim=seq_dim)
    q2, k2 = q.clone(), k.clone()
    got_q, got_k = rope(q2, k2, offset=9, seq_dim=seq_dim, inplace=True)
    assert got_q is q2 and got_k is k2
    assert torch.equal(q2, want_q) and torch.equal(k2, want_k)


def test_q_only_and_float64_inputs():
    rope = RotaryEmbedding(8, rotary_dim=4, layout="interleaved")
    q = torch.randn(1, 1, 6, 8, dtype=torch.float64)
    q_out, k_out = rope(q, None, offset=100)
    assert k_out is None and q_out.dtype == torch.float64
    assert_float32_close(q_out, oracle(q, torch.arange(100, 106), 4, "interleaved"), q)


def test_module_gradients_flow():
    rope = RotaryEmbedding(8)
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    out, _ = rope(q, None, offset=3)
    (out * w).sum().backward()
    # gradient = inverse rotation of w (tables are float32: agree to float32 accuracy)
    expected = apply_reference(w, torch.arange(3, 7), -base_inv_freq(8), layout="half")
    assert (q.grad - expected).abs().max() < 1e-6


def test_table_cache_covers_requests_and_never_shrinks(monkeypatch):
    """The cache is not sized by a fixed max_positions: it starts small and grows to cover requests."""
    monkeypatch.setattr(rotary_module, "_MIN_TABLE", 4)
    rope = RotaryEmbedding(4)
    sizes = []
    for length in [3, 5, 2, 100, 7]:
        cos, sin = rope.tables(length)
        assert cos.shape[0] >= length and sin.shape == cos.shape
        sizes.append(cos.shape[0])
    assert sizes[0] < 100 and sizes == sorted(sizes)
