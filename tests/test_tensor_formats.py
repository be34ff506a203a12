"""Tensor formats named, never guessed: ``tensor_format`` everywhere a sequence axis is implied.

Every order is checked against the float64 oracle (:func:`ropekit.rotation_matrix` applied token
by token), and a module call whose default order the call itself contradicts must raise.
Also here: the layout aliases and transformers' full-width cos/sin tables.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ropekit
from ropekit import RotaryEmbedding, apply_rotary, rotate, rotate_qk, rotation_matrix
from ropekit.multiaxis import axial, patch_grid
from ropekit.nn import MixedRotaryEmbedding, MultiAxisRotaryEmbedding, XPosEmbedding
from ropekit.validation import LAYOUT_ALIASES, TENSOR_FORMATS, check_layout

HEAD_DIM = 8
INV_FREQ = 10000.0 ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)

# bhsd tensor -> the format (and back): axes permutations
TO_FORMAT = {"bhsd": (0, 1, 2, 3), "bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3)}


def to_format(x_bhsd: torch.Tensor, fmt: str) -> torch.Tensor:
    return x_bhsd.permute(TO_FORMAT[fmt]).contiguous()


def from_format(x: torch.Tensor, fmt: str) -> torch.Tensor:
    inverse = [TO_FORMAT[fmt].index(i) for i in range(4)]
    return x.permute(inverse)


def oracle_bhsd(x: torch.Tensor, positions: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """float64 rotation of a (b, h, s, d) tensor, token t of row b at positions[b, t] (or positions[t])."""
    b, h, s, d = x.shape
    pos = positions.expand(b, s) if positions.dim() == 1 else positions
    out = torch.empty(b, h, s, d, dtype=torch.float64)
    for i in range(b):
        for t in range(s):
            r = rotation_matrix(int(pos[i, t]), INV_FREQ, layout=layout)
            out[i, :, t] = x[i, :, t].double() @ r.T
    return out


# -- the case: (batch, seq, heads, head_dim) by default is caught, by name is right ----------

def test_bshd_named_is_rotated_by_token_not_by_head():
    torch.manual_seed(0)
    rope = RotaryEmbedding(HEAD_DIM)
    q_bhsd, k_bhsd = torch.randn(2, 3, 5, HEAD_DIM), torch.randn(2, 3, 5, HEAD_DIM)
    want_q, want_k = oracle_bhsd(q_bhsd, torch.arange(5)), oracle_bhsd(k_bhsd, torch.arange(5))
    q, k = rope(to_format(q_bhsd, "bshd"), to_format(k_bhsd, "bshd"), tensor_format="bshd")
    torch.testing.assert_close(from_format(q, "bshd").double(), want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(from_format(k, "bshd").double(), want_k, atol=1e-5, rtol=1e-5)
    # the low-level spelling says the same
    q2, _ = rope(to_format(q_bhsd, "bshd"), to_format(k_bhsd, "bshd"), seq_dim=1)
    torch.testing.assert_close(q2, q, atol=0, rtol=0)


def test_default_order_contradicted_by_positions_raises_with_the_format_that_fits():
    rope = RotaryEmbedding(HEAD_DIM)
    q = torch.randn(2, 5, 3, HEAD_DIM)  # (batch, seq=5, heads=3, head_dim)
    with pytest.raises(ValueError, match=r"positions cover 5 tokens.*tensor_format='bshd'"):
        rope(q, q.clone(), torch.arange(5))
    with pytest.raises(ValueError, match=r"tensor_format='bshd'"):
        rope.rotate_one(q, torch.arange(5))
    with pytest.raises(ValueError, match=r"tensor_format='bshd'"):
        XPosEmbedding(HEAD_DIM)(q, q.clone(), torch.arange(5))


def test_default_order_contradicted_by_gqa_keys_raises_with_the_format_that_fits():
    rope = RotaryEmbedding(HEAD_DIM)
    q, k = torch.randn(2, 5, 4, HEAD_DIM), torch.randn(2, 5, 2, HEAD_DIM)  # flash-attention order, GQA
    with pytest.raises(ValueError, match=r"seq_dim=-2 \(the default, 'bhsd' order\).*tensor_format='bshd'"):
        rope(q, k)
    q_out, k_out = rope(q, k, tensor_format="bshd")
    torch.testing.assert_close(from_format(q_out, "bshd").double(),
                               oracle_bhsd(from_format(q, "bshd"), torch.arange(5)), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(from_format(k_out, "bshd").double(),
                               oracle_bhsd(from_format(k, "bshd"), torch.arange(5)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("call", [
    lambda q: RotaryEmbedding(HEAD_DIM)(q, q, tensor_format="bshd", seq_dim=2),
    lambda q: rotate(q, *RotaryEmbedding(HEAD_DIM).tables(8), tensor_format="sbhd", seq_dim=-3),
])
def test_tensor_format_and_seq_dim_must_agree(call):
    with pytest.raises(ValueError, match=r"seq_dim=.* and tensor_format=.* disagree"):
        call(torch.randn(2, 4, 3, HEAD_DIM))


def test_bad_formats_are_refused():
    rope = RotaryEmbedding(HEAD_DIM)
    cos, sin = rope.tables(8)
    x = torch.randn(2, 4, 3, HEAD_DIM)
    with pytest.raises(ValueError, match=r"tensor_format must be one of \('bhsd', 'bshd', 'sbhd', 'thd'\), got 'bsh'"):
        rope(x, x, tensor_format="bsh")
    with pytest.raises(ValueError, match=r"tensor_format='thd' describes 3-D q \(tokens, heads, head_dim\), got q "):
        rotate_qk(x, x, cos, sin, tensor_format="thd")
    with pytest.raises(TypeError, match=r"name the order of x's axes: tensor_format="):
        rotate(x, cos, sin)
    with pytest.raises(ValueError, match="tensor_format='bshd' describes 4-D"):
        rope(x[0], x[0], tensor_format="bshd")


# -- every format, every entry point, against the oracle (hypothesis over shapes, positions, dtypes) --

@settings(max_examples=25, deadline=None)
@given(
    fmt=st.sampled_from(["bhsd", "bshd", "sbhd"]),
    batch=st.integers(1, 3), heads=st.integers(1, 3), seq=st.integers(1, 6),
    start=st.integers(0, 40),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    layout=st.sampled_from(["half", "interleaved", "neox", "gptj"]),
    batched_positions=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_every_format_matches_the_oracle(fmt, batch, heads, seq, start, dtype, layout, batched_positions, seed):
    gen = torch.Generator().manual_seed(seed)
    q_bhsd = torch.randn(batch, heads, seq, HEAD_DIM, generator=gen, dtype=torch.float64)
    k_bhsd = torch.randn(batch, 1, seq, HEAD_DIM, generator=gen, dtype=torch.float64)  # MQA keys
    if batched_positions:
        positions = torch.randint(0, 50, (batch, seq), generator=gen)
    else:
        positions = start + torch.arange(seq)
    canonical = check_layout(layout)
    want_q, want_k = oracle_bhsd(q_bhsd, positions, canonical), oracle_bhsd(k_bhsd, positions, canonical)
    q, k = to_format(q_bhsd, fmt).to(dtype), to_format(k_bhsd, fmt).to(dtype)
    tol = {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]  # float32 tables

    def check(got_q, got_k):
        torch.testing.assert_close(from_format(got_q, fmt).double(), want_q, atol=tol * 4, rtol=tol)
        if got_k is not None:
            torch.testing.assert_close(from_format(got_k, fmt).double(), want_k, atol=tol * 4, rtol=tol)

    rope = RotaryEmbedding(HEAD_DIM, layout=layout)
    check(*rope(q, k, positions, tensor_format=fmt))
    check(rope.rotate_one(q, positions, tensor_format=fmt), None)
    cos, sin = rope.tables(64)
    check(*rotate_qk(q, k, cos, sin, positions=positions, tensor_format=fmt, layout=layout))
    check(rotate(q, cos, sin, positions=positions, tensor_format=fmt, layout=layout), None)


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(1, 5), min_size=1, max_size=3), heads=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_thd_packed_matches_the_oracle(lengths, heads, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    q = torch.randn(tokens, heads, HEAD_DIM, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    want = oracle_bhsd(q.permute(1, 0, 2)[None], positions)[0].permute(1, 0, 2)
    cos, sin = RotaryEmbedding(HEAD_DIM).tables(16)
    got_q, got_k = rotate_qk(q, q.clone(), cos, sin, cu_seqlens=cu, tensor_format="thd")
    torch.testing.assert_close(got_q.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, got_q, atol=0, rtol=0)
    got, _ = RotaryEmbedding(HEAD_DIM)(q, q.clone(), positions, tensor_format="thd")
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    flat_q, _ = rotate_qk(q.flatten(1), q.flatten(1).clone(), cos, sin, cu_seqlens=cu, tensor_format="thd",
                          head_size=HEAD_DIM)
    torch.testing.assert_close(flat_q.unflatten(1, (heads, HEAD_DIM)), got_q, atol=0, rtol=0)


@pytest.mark.parametrize("fmt", ["bhsd", "bshd", "sbhd"])
def test_multi_axis_modules_take_every_format(fmt):
    torch.manual_seed(1)
    grid = patch_grid((2, 3))  # 6 tokens, (h, w)
    plan = axial((4, 4), 100.0)
    multi = MultiAxisRotaryEmbedding(plan)
    mixed = MixedRotaryEmbedding(8, 3, generator=torch.Generator().manual_seed(0))
    q_bhsd = torch.randn(2, 3, 6, 8)
    for module, pos in ((multi, grid), (mixed, grid.flip(-1).float())):
        want, _ = module(q_bhsd, None, pos)  # the default order, bhsd
        got, _ = module(to_format(q_bhsd, fmt), None, pos, tensor_format=fmt)
        torch.testing.assert_close(from_format(got, fmt), want, atol=1e-6, rtol=1e-6)
    q_bshd = torch.randn(2, 6, 3, 8)  # (batch, seq=6, heads=3): contradicts the default through the positions
    with pytest.raises(ValueError, match=r"positions cover 6 tokens.*tensor_format='bshd'"):
        multi(q_bshd, None, grid)
    with pytest.raises(ValueError, match=r"positions cover 6 tokens.*tensor_format='bshd'"):
        mixed(q_bshd, None, grid.float())


# -- layout aliases ---------------------------------------------------------------------------------

@pytest.mark.parametrize("alias,canonical", sorted(LAYOUT_ALIASES.items()))
def test_layout_aliases_mean_their_layout(alias, canonical):
    torch.manual_seed(2)
    x = torch.randn(2, 3, 5, HEAD_DIM)
    cos, sin = ropekit.cos_sin(torch.arange(5), INV_FREQ.float())
    assert check_layout(alias) == canonical
    torch.testing.assert_close(apply_rotary(x, cos, sin, layout=alias), apply_rotary(x, cos, sin, layout=canonical),
                               atol=0, rtol=0)
    other = "half" if canonical == "interleaved" else "interleaved"
    assert not torch.allclose(apply_rotary(x, cos, sin, layout=alias), apply_rotary(x, cos, sin, layout=other))
    assert RotaryEmbedding(HEAD_DIM, layout=alias).layout == canonical
    assert ropekit.RopeConfig(HEAD_DIM, layout=alias).layout == canonical
    torch.testing.assert_close(rotation_matrix(3, INV_FREQ, layout=alias), rotation_matrix(3, INV_FREQ,
                               layout=canonical), atol=0, rtol=0)
    w = torch.randn(2 * HEAD_DIM, 4)
    torch.testing.assert_close(ropekit.permute_qk_weight(w, 2, src=alias, dst=other),
                               ropekit.permute_qk_weight(w, 2, src=canonical, dst=other), atol=0, rtol=0)


def test_unknown_layout_lists_the_aliases():
    with pytest.raises(ValueError, match=r"layout must be one of \('half', 'interleaved'\) \(or an alias: 'neox'"):
        check_layout("spiral")


# -- full-width tables (transformers' form) ---------------------------------------------------------

def test_transformers_full_width_tables_are_named_and_their_half_is_right():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, heads, seq = 16, 2, 7
    config = transformers.LlamaConfig(hidden_size=head_dim * heads, num_attention_heads=heads,
                                      num_key_value_heads=heads, max_position_embeddings=64)
    hf_rope = LlamaRotaryEmbedding(config)
    torch.manual_seed(3)
    q, k = torch.randn(1, heads, seq, head_dim), torch.randn(1, heads, seq, head_dim)
    position_ids = torch.arange(3, 3 + seq)[None]
    cos, sin = hf_rope(q, position_ids)  # (1, seq, head_dim): full width
    assert cos.shape[-1] == head_dim
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    with pytest.raises(ValueError, match=r"full-width cos/sin \(transformers' form.*pass cos\[\.\.\., :8\]"):
        apply_rotary(q, cos[:, None], sin[:, None])
    with pytest.raises(ValueError, match=r"full-width cos/sin \(transformers' form.*pass cos\[\.\.\., :8\]"):
        ropekit.apply_rotary_qk(q, k, cos[:, None], sin[:, None])
    with pytest.raises(ValueError, match=r"full-width cos/sin \(transformers' form"):
        rotate_qk(q, k, cos[0], sin[0], tensor_format="bhsd")
    half_cos, half_sin = cos[..., : head_dim // 2], sin[..., : head_dim // 2]
    got_q, got_k = ropekit.apply_rotary_qk(q, k, half_cos[:, None], half_sin[:, None], layout="neox")
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=1e-6)


def test_formats_table_is_the_documented_one():
    assert TENSOR_FORMATS == {"bhsd": (4, 2), "bshd": (4, 1), "sbhd": (4, 0), "thd": (3, 0)}
