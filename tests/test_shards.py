"""Positions of sequence shards (ropekit.rope.shards): the orders checked against their definitions,
against the peers' own helpers (Megatron-core, torch's context-parallel load balancer, DTensor's Shard
rule) and TransformerEngine's documented examples, and the rotation of a shard against the float64 oracle."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ropekit
from ropekit.rope.shards import (
    SCHEMES,
    check_cu_seqlens,
    packed_positions,
    packed_shard,
    pad_cu_seqlens,
    shard_multiple,
    shard_order,
    shard_positions,
    shard_sizes,
    torch_cp_scheme,
)


def group_and_length(scheme_strategy=None):
    """(scheme, cp_size, seq_len) with seq_len valid for the scheme."""
    scheme_strategy = st.sampled_from(SCHEMES) if scheme_strategy is None else scheme_strategy

    @st.composite
    def draw(draw_):
        scheme = draw_(scheme_strategy)
        cp_size = draw_(st.integers(1, 8))
        if scheme == "zigzag":
            return scheme, cp_size, 2 * cp_size * draw_(st.integers(0, 6))
        return scheme, cp_size, draw_(st.integers(0, 50))

    return draw()


# -- the orders against their definitions --------------------------------------------------------------


@given(group_and_length())
def test_ranks_hold_a_permutation_of_the_sequence(case):
    scheme, cp_size, seq_len = case
    parts = [shard_positions(seq_len, cp_size, r, scheme=scheme) for r in range(cp_size)]
    assert [p.numel() for p in parts] == shard_sizes(seq_len, cp_size, scheme=scheme)
    order = shard_order(seq_len, cp_size, scheme=scheme)
    assert order.dtype == torch.int64 and torch.equal(order, torch.cat(parts))
    assert torch.equal(order.sort().values, torch.arange(seq_len))
    x = torch.randn(seq_len)
    assert torch.equal(x[order][order.argsort()], x)


@given(group_and_length(st.just("contiguous")))
def test_contiguous_is_the_chunk_rule(case):
    _, cp_size, seq_len = case
    chunks = torch.arange(seq_len).chunk(cp_size) if seq_len else ()
    expected = list(chunks) + [torch.arange(0)] * (cp_size - len(chunks))
    for r in range(cp_size):
        assert torch.equal(shard_positions(seq_len, cp_size, r, scheme="contiguous"), expected[r])


@given(group_and_length(st.just("contiguous")))
def test_contiguous_is_dtensors_shard_rule(case):
    from torch.distributed.tensor import Shard

    _, cp_size, seq_len = case
    for r in range(cp_size):
        size, offset = Shard.local_shard_size_and_offset(seq_len, cp_size, r)
        got = shard_positions(seq_len, cp_size, r, scheme="contiguous")
        assert got.numel() == size and (size == 0 or int(got[0]) == offset)


@given(group_and_length(st.just("zigzag")))
def test_zigzag_holds_chunk_r_then_its_mirror_and_balances_causal_work(case):
    _, cp_size, seq_len = case
    chunks = torch.arange(seq_len).view(2 * cp_size, -1)
    work = set()
    for r in range(cp_size):
        got = shard_positions(seq_len, cp_size, r, scheme="zigzag")
        assert torch.equal(got, torch.cat((chunks[r], chunks[2 * cp_size - 1 - r])))
        work.add(int((got + 1).sum()))  # a query at position p attends to p + 1 keys
    assert len(work) == 1


@given(group_and_length(st.just("striped")))
def test_striped_puts_token_i_on_rank_i_mod_cp(case):
    _, cp_size, seq_len = case
    for r in range(cp_size):
        got = shard_positions(seq_len, cp_size, r, scheme="striped")
        assert bool((got % cp_size == r).all()) and bool((got.diff() == cp_size).all())


def test_worked_examples():
    """The examples of docs/distributed.md."""
    assert [shard_positions(16, 4, r, scheme="zigzag").tolist() for r in range(4)] == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert [shard_positions(16, 4, r, scheme="contiguous").tolist() for r in range(4)] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert [shard_positions(16, 4, r, scheme="striped").tolist() for r in range(4)] == [
        [0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert shard_sizes(10, 4, scheme="contiguous") == [3, 3, 3, 1]
    assert shard_sizes(5, 4, scheme="contiguous") == [2, 2, 1, 0]
    assert shard_sizes(10, 4, scheme="striped") == [3, 3, 2, 2]


# -- packed batches -------------------------------------------------------------------------------------


@st.composite
def packed_case(draw):
    scheme = draw(st.sampled_from(SCHEMES))
    cp_size = draw(st.integers(1, 4))
    multiple = shard_multiple(cp_size, scheme=scheme)
    lengths = draw(st.lists(st.integers(0, 4), min_size=1, max_size=5))
    cu = torch.tensor([0] + lengths).cumsum(0) * multiple
    return scheme, cp_size, cu


@given(packed_case())
def test_packed_shard_splits_each_sequence_as_if_alone(case):
    scheme, cp_size, cu = case
    all_positions, seq_ids = packed_positions(cu)
    pieces = []
    for r in range(cp_size):
        shard = packed_shard(cu, cp_size, r, scheme=scheme)
        # the oracle: each sequence split alone by the unpacked rule, shifted to its start, one after the other
        expected = torch.cat([int(s) + shard_positions(int(e - s), cp_size, r, scheme=scheme)
                              for s, e in zip(cu[:-1], cu[1:], strict=True)])
        assert torch.equal(shard.token_index, expected)
        assert torch.equal(shard.positions, all_positions[shard.token_index])
        assert torch.equal(shard.cu_seqlens, cu // cp_size)
        assert torch.equal(seq_ids[shard.token_index], torch.repeat_interleave(
            torch.arange(cu.numel() - 1), shard.cu_seqlens.diff()))
        pieces.append(shard.token_index)
    assert torch.equal(torch.cat(pieces).sort().values, torch.arange(int(cu[-1])))


def test_packed_worked_example():
    cu = torch.tensor([0, 4, 12, 16])
    rank0, rank1 = (packed_shard(cu, 2, r, scheme="zigzag") for r in range(2))
    assert rank0.token_index.tolist() == [0, 3, 4, 5, 10, 11, 12, 15]
    assert rank0.positions.tolist() == [0, 3, 0, 1, 6, 7, 0, 3]
    assert rank1.positions.tolist() == [1, 2, 2, 3, 4, 5, 1, 2]
    assert rank0.cu_seqlens.tolist() == [0, 2, 6, 8]


def test_transformer_engine_documented_orders():
    """TransformerEngine (not installable without CUDA) documents its THD order in its own tests:
    tests/pytorch/attention/test_cp_utils.py, TestContextParallelUtils.test_cp_rank_slicing_simple_case and
    test_cp_rank_slicing_multiple_sequences, for get_batch_on_this_cp_rank in
    transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py ("rank 0 gets first and last
    slices" of each sequence cut into 2*cp_size slices), the order of tex.thd_get_partitioned_indices."""
    one = packed_shard(torch.tensor([0, 8]), 2, 0, scheme="zigzag")
    assert one.positions.tolist() == [0, 1, 6, 7]
    assert packed_shard(torch.tensor([0, 8]), 2, 1, scheme="zigzag").positions.tolist() == [2, 3, 4, 5]
    two = packed_shard(torch.tensor([0, 8, 16]), 2, 0, scheme="zigzag")
    assert two.token_index.tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert two.positions.tolist() == [0, 1, 6, 7, 0, 1, 6, 7]


def test_pad_cu_seqlens_pads_each_sequence_at_its_end():
    # TransformerEngine's pad_thd_sequences_for_cp example: lengths 3 and 7, divisibility 4 -> [0, 4, 12]
    assert pad_cu_seqlens(torch.tensor([0, 3, 10]), 4).tolist() == [0, 4, 12]
    assert pad_cu_seqlens(torch.tensor([0, 8, 8, 9], dtype=torch.int32), 8).tolist() == [0, 8, 8, 16]
    padded = pad_cu_seqlens(torch.tensor([0, 5, 18, 26]), shard_multiple(4, scheme="zigzag"))
    assert packed_shard(padded, 4, 3, scheme="zigzag").token_index.numel() == int(padded[-1]) // 4


# -- the peers' own helpers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron():
    pytest.importorskip("megatron.core", reason="megatron-core is a test dependency (pip install -e '.[test]')")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed": not needed here
        from megatron.core import parallel_state, utils
        from megatron.core.models.common.embeddings import rope_utils
    return parallel_state, utils, rope_utils


@pytest.mark.parametrize("cp_size, seq_len", [(2, 8), (2, 16), (4, 16), (4, 24), (8, 32)])
def test_zigzag_is_megatrons_get_batch_on_this_cp_rank(megatron, monkeypatch, cp_size, seq_len):
    parallel_state, utils, _ = megatron
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp_size)
    for r in range(cp_size):
        monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda r=r: r)
        batch = utils.get_batch_on_this_cp_rank({"position_ids": torch.arange(seq_len)[None],
                                                 "tokens": torch.arange(100, 100 + seq_len)[None]})
        expected = shard_positions(seq_len, cp_size, r, scheme="zigzag")
        assert torch.equal(batch["position_ids"][0], expected)
        assert torch.equal(batch["tokens"][0], 100 + expected)


@pytest.mark.parametrize("cu, cp_size", [([0, 4, 12, 16], 2), ([0, 8, 24, 32], 4), ([0, 8, 16], 2), ([0, 16, 64], 8)])
def test_packed_zigzag_is_megatrons_thd_rope_slice(megatron, cu, cp_size):
    """Megatron's RoPE for packed (THD) batches takes each sequence's slice of the frequencies with
    rope_utils._get_thd_freqs_on_this_cp_rank; given the table arange(n), the slice is the positions."""
    *_, rope_utils = megatron
    cu = torch.tensor(cu)
    lengths = cu.diff()
    table = torch.arange(int(lengths.max()))
    pieces = torch.split(torch.empty(int(cu[-1]) // cp_size), (lengths // cp_size).tolist())
    for r in range(cp_size):
        expected = torch.cat([rope_utils._get_thd_freqs_on_this_cp_rank(r, cp_size, piece, table) for piece in pieces])
        assert torch.equal(packed_shard(cu, cp_size, r, scheme="zigzag").positions, expected)


def test_zigzag_is_torchs_head_tail_load_balancer():
    """torch's context_parallel shards buffers by _HeadTailLoadBalancer (a private class; its indices cut into
    cp_size contiguous parts give each rank its tokens). Before torch 2.10 the same order was called
    _RoundRobinLoadBalancer: "round-robin" in torch's context parallelism means this zigzag order."""
    balancer = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")
    for cp_size, seq_len in [(2, 8), (2, 16), (4, 16), (4, 24), (3, 18)]:
        indices = balancer._HeadTailLoadBalancer(seq_len, cp_size, "cpu")._generate_indices()[0]
        assert torch.equal(indices.long(), shard_order(seq_len, cp_size, scheme="zigzag"))
    for cp_size, seq_len in [(2, 8), (2, 10), (4, 16), (4, 12), (3, 7)]:
        default = balancer._create_default_load_balancer(seq_len, cp_size, "cpu")
        expected = "contiguous" if default is None else "zigzag"
        assert torch_cp_scheme(seq_len, cp_size) == expected
        assert default is None or torch.equal(default._generate_indices()[0].long(),
                                              shard_order(seq_len, cp_size, scheme=expected))
    assert torch_cp_scheme(16, 2, load_balance=False) == "contiguous"


# -- rotating a shard -----------------------------------------------------------------------------------


@given(group_and_length(), st.sampled_from(["half", "interleaved"]))
def test_a_shard_rotated_by_its_positions_is_the_shard_of_the_whole_rotation(case, layout):
    scheme, cp_size, seq_len = case
    gen = torch.Generator().manual_seed(seq_len)
    q = torch.randn(2, 4, seq_len, 16, dtype=torch.float64, generator=gen)
    k = torch.randn(2, 2, seq_len, 16, dtype=torch.float64, generator=gen)
    inv_freq, _ = ropekit.inv_frequencies(16, 10000.0)
    cos, sin = ropekit.cos_sin(torch.arange(max(seq_len, 1)), inv_freq)
    whole_q, whole_k = ropekit.rotate_qk(q, k, cos, sin, seq_dim=2, layout=layout)
    for r in range(cp_size):
        pos = shard_positions(seq_len, cp_size, r, scheme=scheme)
        got_q, got_k = ropekit.rotate_qk(q[:, :, pos], k[:, :, pos], cos, sin, positions=pos, seq_dim=2, layout=layout)
        assert torch.equal(got_q, whole_q[:, :, pos]) and torch.equal(got_k, whole_k[:, :, pos])
        oracle = ropekit.apply_reference(q[:, :, pos], pos, inv_freq, layout=layout)
        torch.testing.assert_close(got_q, oracle, rtol=0, atol=1e-6)  # float32 tables, float64 matrices


def test_a_packed_shard_rotated_by_its_positions_matches_the_packed_rotation():
    cu = torch.tensor([0, 8, 24, 32])
    q, k = torch.randn(32, 4, 16), torch.randn(32, 2, 16)
    rope = ropekit.RotaryEmbedding(16)
    cos, sin = rope.tables(32)
    whole_q, whole_k = ropekit.rotate_qk(q, k, cos, sin, cu_seqlens=cu, seq_dim=0)
    for scheme in SCHEMES:
        for r in range(4):
            shard = packed_shard(cu, 4, r, scheme=scheme)
            got_q, got_k = rope(q[shard.token_index], k[shard.token_index], shard.positions, seq_dim=0)
            assert torch.equal(got_q, whole_q[shard.token_index]) and torch.equal(got_k, whole_k[shard.token_index])


# -- bad input ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: shard_positions(10, 2, 0, scheme="zigzag"), ValueError,
         ["seq_len", "multiple of 2*cp_size = 4", "10"]),
        (lambda: shard_positions(8, 2, 2, scheme="zigzag"), ValueError, ["cp_rank", "[0, 2)", "got 2"]),
        (lambda: shard_positions(8, 0, 0, scheme="contiguous"), ValueError, ["cp_size", ">= 1", "got 0"]),
        (lambda: shard_positions(8, 2, 0, scheme="round-robin"), ValueError, ["scheme", "'zigzag'", "'round-robin'"]),
        (lambda: shard_positions(8.0, 2, 0, scheme="striped"), TypeError, ["seq_len", "int", "float"]),
        (lambda: shard_order(-1, 2, scheme="striped"), ValueError, ["seq_len", ">= 0", "-1"]),
        (lambda: packed_shard(torch.tensor([0, 8, 18]), 2, 0, scheme="zigzag"), ValueError,
         ["cu_seqlens", "sequence 1 has 10 tokens", "multiple of 4", "pad_cu_seqlens"]),
        (lambda: packed_shard(torch.tensor([0, 4, 7]), 2, 0, scheme="striped"), ValueError,
         ["sequence 1 has 3 tokens", "multiple of 2"]),
        (lambda: packed_shard(torch.tensor([1, 8]), 2, 0, scheme="zigzag"), ValueError, ["cu_seqlens", "start at 0"]),
        (lambda: packed_shard(torch.tensor([0, 8, 4]), 2, 0, scheme="zigzag"), ValueError,
         ["cu_seqlens", "non-decreasing", "8 then 4"]),
        (lambda: packed_shard(torch.tensor([0.0, 8.0]), 2, 0, scheme="zigzag"), TypeError, ["cu_seqlens", "integer"]),
        (lambda: packed_shard([0, 8], 2, 0, scheme="zigzag"), TypeError, ["cu_seqlens", "list"]),
        (lambda: check_cu_seqlens(torch.tensor([0])), ValueError, ["cu_seqlens", "num_seqs + 1 >= 2"]),
        (lambda: pad_cu_seqlens(torch.tensor([0, 3]), 0), ValueError, ["multiple", ">= 1"]),
    ],
)
def test_bad_input_names_the_argument(call, error, words):
    with pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_the_guides_tables_are_what_the_functions_give():
    """docs/distributed.md's worked examples (L = 16 on 4 ranks; a packed batch on 2) are read from the page."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "distributed.md").read_text(encoding="utf-8")

    def table_after(title):
        rows = text[text.index(title):].split("\n\n")[1].splitlines()[2:]
        return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]

    worked = table_after("### Worked example: `L = 16`, `cp = 4`")
    assert [row[0] for row in worked] == ["0", "1", "2", "3"]
    for row in worked:
        rank = int(row[0])
        for scheme, cell in zip(("contiguous", "zigzag", "striped"), row[1:], strict=True):
            assert [int(v) for v in cell.split()] == shard_positions(16, 4, rank, scheme=scheme).tolist()
    packed = table_after("`cu_seqlens = [0, 4, 12, 16]`, `cp = 2`, zigzag:")
    assert len(packed) == 2
    for row in packed:
        shard = packed_shard(torch.tensor([0, 4, 12, 16]), 2, int(row[0]), scheme="zigzag")
        numbers = [[int(v) for v in cell.replace("·", " ").split()] for cell in row[1:]]
        assert numbers == [shard.token_index.tolist(), shard.positions.tolist(), shard.cu_seqlens.tolist()]
