"""``RotaryEmbedding`` at a decode step, warm and cold, against the float64 reference.

A decode loop calls the module with one signature on every step: the first call runs every check
and keeps the prepared call of ``rotate_qk`` by an int offset (the C++ kernel reading the table
rows where they lie), later ones run it directly. Whatever path a call takes (int offset,
``(batch,)`` tensor offsets, positions; each ``tensor_format``; in place or not; tables grown
between calls; attributes changed between calls), its result must be the float64 reference's
(``ropekit.apply_reference``), and a warm call's bits those of a cold one.
"""

from __future__ import annotations

import pytest
import torch

import ropekit
from ropekit import ops
from ropekit.ops import prepared

torch.set_num_threads(1)

FORMATS = {"bhsd": (0, 2, 1), "bshd": (0, 1, 2), "sbhd": (1, 0, 2), "thd": (None, 0, 1)}  # batch, seq, heads axes
BACKENDS = [b for b in ("cpu", "torch") if b in ops.available()]
HEAD_DIM, Q_HEADS, K_HEADS, BATCH = 16, 4, 2, 3


def qk(tensor_format: str, seq: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k (GQA) of ``seq`` tokens in ``tensor_format``."""
    gen = torch.Generator().manual_seed(seed)
    batch_axis, seq_axis, head_axis = FORMATS[tensor_format]
    shapes = []
    for heads in (Q_HEADS, K_HEADS):
        shape = [0] * (3 if batch_axis is None else 4)
        shape[seq_axis], shape[head_axis], shape[-1] = seq, heads, HEAD_DIM
        if batch_axis is not None:
            shape[batch_axis] = BATCH
        shapes.append(shape)
    return tuple(torch.randn(shape, generator=gen).to(dtype) for shape in shapes)


def token_positions(x: torch.Tensor, tensor_format: str, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` ``(batch, seq)`` (or ``(seq,)``) viewed to broadcast against ``x.shape[:-1]``."""
    batch_axis, seq_axis, _ = FORMATS[tensor_format]
    view = [1] * (x.dim() - 1)
    view[seq_axis] = x.shape[seq_axis]
    if rows.dim() == 2:
        view[batch_axis] = rows.shape[0]
        if batch_axis > seq_axis:
            rows = rows.t()
    return rows.reshape(view)


def expected(x: torch.Tensor, positions: torch.Tensor, layout: str = "half") -> torch.Tensor:
    return ropekit.apply_reference(x.double(), positions, ropekit.inv_frequencies(HEAD_DIM)[0], layout=layout)


def assert_close(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> None:
    assert out.dtype == x.dtype and out.shape == x.shape
    # float32 tables and arithmetic (float64 x: float32 tables); one rounding to bfloat16 or float16
    bound = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}.get(x.dtype, 4e-6)
    scale = max(1.0, float(x.abs().max()))
    assert float((out.double() - ref).abs().max()) <= bound * scale


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tensor_format", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_decode_steps_by_int_offset_match_the_reference_warm_and_cold(backend, tensor_format, dtype, inplace, layout):
    """Steps at positions 0..299 (the tables grow from 256 rows on the way): every one is the reference's, warm."""
    rope = ropekit.RotaryEmbedding(HEAD_DIM, layout=layout, backend=backend)
    prepared.clear()
    for step in [*range(0, 300, 7), 255, 256, 299, 299]:
        q, k = qk(tensor_format, 1, dtype, seed=step)
        rows = torch.tensor([step])
        want = [expected(t, token_positions(t, tensor_format, rows), layout) for t in (q, k)]
        given = (q.clone(), k.clone())
        out = rope(*given, offset=step, tensor_format=tensor_format, inplace=inplace)
        for got, ref, x, inp in zip(out, want, (q, k), given, strict=True):
            assert_close(got, ref, x)
            assert (got is inp) == inplace
        cold_q, cold_k = q.clone(), k.clone()
        prepared.clear()
        cold = rope(cold_q, cold_k, offset=step, tensor_format=tensor_format, inplace=inplace)
        for warm_out, cold_out in zip(out, cold, strict=True):
            assert torch.equal(bits(warm_out), bits(cold_out))
        rope(*qk(tensor_format, 1, dtype), offset=step, tensor_format=tensor_format, inplace=inplace)  # warm again
    if backend == "cpu":  # the decode loop ran on prepared calls
        assert any(key[0] == "RotaryEmbedding" for key in prepared.calls)


@pytest.mark.parametrize("tensor_format", ["bhsd", "bshd", "sbhd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_offsets_and_positions_match_the_reference(tensor_format, dtype):
    """Per-sequence offsets ``(batch,)`` and positions ``(batch, seq)`` (not prepared: their values vary)."""
    rope = ropekit.RotaryEmbedding(HEAD_DIM)
    for seq in (1, 3):
        q, k = qk(tensor_format, seq, dtype)
        offsets = torch.tensor([0, 41, 300])
        rows = offsets[:, None] + torch.arange(seq)
        cases = ((dict(offset=offsets), rows), (dict(positions=rows), rows), (dict(positions=rows[1]), rows[1]))
        for _ in range(2):  # a repeated call: the same result
            for where, used in cases:
                q_out, k_out = rope(q, k, tensor_format=tensor_format, **where)
                for got, x in ((q_out, q), (k_out, k)):
                    assert_close(got, expected(x, token_positions(x, tensor_format, used)), x)


def test_packed_positions_match_the_reference():
    """``"thd"``: packed tokens by positions ``(tokens,)`` and by an int offset."""
    rope = ropekit.RotaryEmbedding(HEAD_DIM)
    q, k = qk("thd", 5, torch.float32)
    positions = torch.tensor([7, 0, 1, 300, 2])
    for _ in range(2):
        q_out, k_out = rope(q, k, positions, tensor_format="thd")
        for got, x in ((q_out, q), (k_out, k)):
            assert_close(got, expected(x, positions[:, None]), x)
        q_out, k_out = rope(q, k, offset=20, tensor_format="thd")
        for got, x in ((q_out, q), (k_out, k)):
            assert_close(got, expected(x, (torch.arange(5) + 20)[:, None]), x)


def test_offsets_past_the_cached_rows_and_seq_dim_spellings():
    """Rows past ``max_cached_positions`` (computed for the call), then back inside; seq_dim and format alike."""
    rope = ropekit.RotaryEmbedding(HEAD_DIM, max_cached_positions=64)
    q, k = qk("bshd", 1, torch.float32)
    for offset in (10, 63, 64, 500, 10, 10):
        want = [expected(t, token_positions(t, "bshd", torch.tensor([offset]))) for t in (q, k)]
        for spelling in ({"tensor_format": "bshd"}, {"seq_dim": 1}, {"seq_dim": -3}):
            for got, ref, x in zip(rope(q, k, offset=offset, **spelling), want, (q, k), strict=True):
                assert_close(got, ref, x)
    assert rope.tables(1)[0].shape[0] == 64


def test_setting_an_attribute_retires_the_prepared_calls():
    """``layout``, ``max_cached_positions`` and ``scaling`` set after warm calls: the next call is the new one's."""
    rope = ropekit.RotaryEmbedding(HEAD_DIM)
    q, k = qk("bhsd", 1, torch.float32)
    for _ in range(3):
        rope(q, k, offset=5)
    rope.layout = "interleaved"
    for got, x in zip(rope(q, k, offset=5), (q, k), strict=True):
        assert_close(got, expected(x, torch.tensor([5])[:, None], "interleaved"), x)
    rope.layout = "half"
    rope(q, k, offset=100)
    rope.max_cached_positions = 0  # rows computed for every call from now on: the same values
    for got, x in zip(rope(q, k, offset=100), (q, k), strict=True):
        assert_close(got, expected(x, torch.tensor([100])[:, None]), x)
    dynamic = ropekit.scaling.DynamicNTK(factor=4.0, original_max_position_embeddings=16)
    fresh = ropekit.RotaryEmbedding(HEAD_DIM, scaling=dynamic)
    rope.max_cached_positions = ropekit.nn.rotary.MAX_CACHED_POSITIONS
    rope.scaling = dynamic
    rope._tables.clear()  # (the tables of the static rule were built before the rule changed)
    for offset in (3, 40, 3, 200, 200):
        for got, want in zip(rope(q, k, offset=offset), fresh(q, k, offset=offset), strict=True):
            assert torch.equal(got, want)


def test_a_dynamic_rule_keeps_nothing():
    """Frequencies that follow the sequence length: every call is cold, each the fresh module's result."""
    dynamic = ropekit.scaling.DynamicNTK(factor=4.0, original_max_position_embeddings=16)
    rope = ropekit.RotaryEmbedding(HEAD_DIM, scaling=dynamic)
    q, k = qk("bhsd", 1, torch.float32)
    prepared.clear()
    for offset in (3, 40, 41, 40):
        want = ropekit.RotaryEmbedding(HEAD_DIM, scaling=dynamic)(q, k, offset=offset)
        for got, ref in zip(rope(q, k, offset=offset), want, strict=True):
            assert torch.equal(got, ref)
    assert not any(key[0] == "RotaryEmbedding" for key in prepared.calls)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tensor_format", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_rotate_qk_by_an_int_offset_matches_the_reference(backend, tensor_format, dtype):
    """``ropekit.rotate_qk(..., offsets=int)``: warm calls, in place and not, an offset outside the tables refused."""
    cos, sin = ropekit.cos_sin(torch.arange(40), ropekit.inv_frequencies(HEAD_DIM)[0])
    if dtype == torch.float16:  # tables of another dtype and strides: the kernel converts the rows it reads
        cos, sin = cos.double().t().contiguous().t(), sin.double().t().contiguous().t()
    for offset in (0, 17, 36, 17):
        q, k = qk(tensor_format, 3 if tensor_format != "thd" else 4, dtype, seed=offset)
        rows = offset + torch.arange(q.shape[FORMATS[tensor_format][1]])
        want = [expected(t, token_positions(t, tensor_format, rows)) for t in (q, k)]
        for inplace in (False, True):
            given = (q.clone(), k.clone())
            out = ropekit.rotate_qk(*given, cos, sin, offsets=offset, tensor_format=tensor_format, inplace=inplace,
                                    backend=backend)
            for got, ref, x in zip(out, want, (q, k), strict=True):
                assert_close(got, ref, x)
    q, k = qk(tensor_format, 3, torch.float32)
    with pytest.raises(ValueError, match="outside the cos/sin tables"):
        ropekit.rotate_qk(q, k, cos, sin, offsets=39, tensor_format=tensor_format, backend=backend)
    with pytest.raises(ValueError, match="offsets must be >= 0"):
        ropekit.rotate_qk(q, k, cos, sin, offsets=-1, tensor_format=tensor_format, backend=backend)


@pytest.mark.skipif("cpu" not in ops.available(), reason="C++ CPU kernel unavailable (no compiler)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_native_offset_kernel_equals_the_gathered_rows(dtype):
    """``rotate_qk_offset`` (rows read in the tables) gives the bits of ``apply_rotary_qk`` on gathered rows."""
    module = ops.get("cpu").module
    cos, sin = ropekit.cos_sin(torch.arange(50), ropekit.inv_frequencies(HEAD_DIM)[0])
    gen = torch.Generator().manual_seed(1)
    for shape, seq_axis in (((2, 5, 3, HEAD_DIM), 1), ((2, 3, 5, HEAD_DIM), 2), ((5, 3, HEAD_DIM), 0)):
        q = torch.randn(shape, generator=gen).to(dtype)
        k = torch.randn(shape, generator=gen).to(dtype)[..., : HEAD_DIM // 2 * 2]
        if dtype == torch.bfloat16:  # channel-strided q: the kernel reads a contiguous copy
            q = torch.randn(*shape[:-1], 2 * HEAD_DIM, generator=gen).to(dtype)[..., ::2]
        view = [1] * len(shape)
        view[seq_axis], view[-1] = 5, HEAD_DIM // 2
        rows_cos, rows_sin = cos[30:35].reshape(view), sin[30:35].reshape(view)
        for interleaved in (False, True):
            want = module.apply_rotary_qk(q, k, rows_cos, rows_sin, interleaved, False)
            got = module.rotate_qk_offset(q, k, cos, sin, 30, seq_axis, interleaved, False)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(bits(a), bits(b))
            copies = (q.clone(), k.clone())
            module.rotate_qk_offset_(*copies, cos, sin, 30, seq_axis, interleaved, False)
            for a, b in zip(copies, want, strict=True):
                assert torch.equal(bits(a), bits(b))
            assert torch.equal(bits(module.rotate_offset(q, cos, sin, 30, seq_axis, interleaved, False)), bits(want[0]))
    with pytest.raises(ValueError, match="outside tables of 50 rows"):
        module.rotate_qk_offset(q, k, cos, sin, 46, 0, False, False)
    with pytest.raises(ValueError, match="outside tables of 50 rows"):
        module.rotate_qk_offset(q, k, cos, sin, -1, 0, False, False)
