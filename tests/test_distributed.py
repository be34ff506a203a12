"""Context parallelism in real multi-process runs: gloo process groups of 2 and 4 ranks on the CPU.

One launch per world size runs every scenario (tests/distributed_ranks.py); the tests below compare
what the ranks returned with single-process runs of the same model and data built here:

- a causal model of ``nn.RotarySelfAttention`` layers, each rank holding its shard (contiguous,
  zigzag, striped; fixed length, uneven and packed), keys and values all-gathered: outputs and the
  gradients of every parameter equal the single-process run within 1e-5 in float32 (1e-12 in
  float64), with dynamic scaling rules at a global length past their original context;
- DTensor q/k rotated by ``RotaryEmbedding`` from their placement, equal to the plain rotation;
- torch's own ``context_parallel`` buffer sharding, with positions and with cos/sin tables;
- ranks that disagree, and bad DTensors, as errors naming the argument.
"""

from __future__ import annotations

import pytest
import torch

import ropekit
from distributed_harness import run_ranks
from distributed_ranks import BATCH, TinyModel, case_name, guide_loop, model_batch, model_cases, rule
from ropekit.distributed import shard_positions

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda world: f"world{world}")
def ranks(request, tmp_path_factory):
    """``(world, [what rank r returned for r in range(world)])``, one launch per world size."""
    import distributed_ranks

    ropekit.RotaryEmbedding(8)(torch.randn(1, 1, 2, 8), None)  # build or load the C++ kernel here, not per rank
    world = request.param
    return world, run_ranks(distributed_ranks.run_all, world, tmp_path_factory.mktemp(f"world{world}"))


def reference(case: dict) -> tuple[torch.Tensor, dict]:
    """The same model and batch in one process: full sequences, or each packed sequence on its own."""
    if "seq_len" in case:
        model = TinyModel(rule(case["rule"]), case["dtype"])
        x, w = model_batch(case["seq_len"], BATCH, case["dtype"])
        y = model(x)
    else:
        cu = case["cu_seqlens"]
        longest = max(b - a for a, b in zip(cu[:-1], cu[1:], strict=True))
        # one process given the packed batch decides a dynamic rule from max(position) + 1 = the longest sequence
        model = TinyModel(rule(case["rule"], fixed_seq_len=longest), case["dtype"])
        x, w = model_batch(cu[-1], 1, case["dtype"])
        y = torch.cat([model(x[:, a:b]) for a, b in zip(cu[:-1], cu[1:], strict=True)], dim=1)
    (y * w).sum().backward()
    return y.detach(), {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.parametrize("case", model_cases(), ids=case_name)
def test_context_parallel_model_equals_one_process(ranks, case):
    world, results = ranks
    y_ref, grads_ref = reference(case)
    tolerance = TOLERANCE[case["dtype"]]
    for rank, result in enumerate(results):
        got = result["models"][case_name(case)]
        y_err = (got["y"] - y_ref).abs().max().item()
        grad_err = max((got["grads"][name] - grads_ref[name]).abs().max().item() for name in grads_ref)
        assert y_err <= tolerance and grad_err <= tolerance, (
            f"rank {rank}/{world}: outputs off by {y_err:.3g}, gradients by {grad_err:.3g}")
        assert got["rope_seq_len"] == case.get("seq_len", 16)


def test_dynamic_rule_on_shards_needs_the_global_length(ranks):
    """What the agreed length prevents: each rank's own max(position) + 1 differs, so a dynamic rule
    would pick different frequencies on different ranks; global_seq_len gives every rank the same."""
    world, results = ranks
    local = [result["collectives"]["local_seq_len"] for result in results]
    assert len(set(local)) > 1  # zigzag: only rank 0 holds the last position
    assert [result["collectives"]["global_seq_len"] for result in results] == [8 * world] * world


def test_ranks_that_disagree_raise_on_every_rank(ranks):
    world, results = ranks
    for rank, result in enumerate(results):
        errors = result["collectives"]
        assert errors["check_seq_len"] == (
            f"ValueError: seq_len must be the same on every rank of the group, got values from 8 to 16 (this rank, "
            f"{rank}: {16 if rank else 8})")
        assert "seq_len must be the same on every rank" in errors["seq_len"] and "from 16 to 32" in errors["seq_len"]
        assert "scheme must be the same on every rank" in errors["scheme"]
        assert "cu_seqlens must be the same on every rank" in errors["cu_seqlens"], errors["cu_seqlens"]
        assert "rope_seq_len must be the same on every rank" in errors["rope_seq_len"]
        if rank == 0:
            assert "seq_len must be a multiple of 2*cp_size" in errors["refused_here"]
            assert errors["refused_type"] == "TypeError: seq_len must be an int >= 0, got str '16'"
            assert errors["refused_positions"] == "ValueError: positions must be >= 0, got a minimum of -1"
        else:
            for name in ("refused_here", "refused_type", "refused_positions"):
                assert errors[name] == ("ValueError: another rank of the group refused its arguments (its own error "
                                        "says which); this rank's were valid")
        assert errors["agreed"] == 24


def test_gather_restores_the_global_order_and_sums_gradients(ranks):
    world, results = ranks
    for result in results:
        for label, got in result["collectives"]["gathers"].items():
            assert torch.equal(got["whole"], got["x"]), label
            # every rank's loss uses every token: the gradient of a rank's tokens is the sum over the ranks
            expected = world * got["w"].index_select(1, got["token_index"])
            torch.testing.assert_close(got["grad"], expected, rtol=0, atol=1e-6, msg=label)


def test_gather_of_mismatched_parts_raises_the_same_error_on_every_rank(ranks):
    """float16 against bfloat16 (bytes that would be read as each other's) and shapes that would abort gloo."""
    world, results = ranks
    last = world - 1
    others = ", ".join(map(str, range(1, world)))
    mismatch = [result["collectives"]["gather_mismatch"] for result in results]
    rest = "s" if world > 2 else ""
    expected = {
        "dtype": f"ValueError: x must have the same dtype on every rank of the group, got torch.float16 on rank 0 "
                 f"and torch.bfloat16 on rank{rest} {others}",
        "shape": f"ValueError: x must have the same shape on every rank of the group apart from its seq_dim axis "
                 f"(* below), got (2, *, 3) with seq_dim=1 on rank{rest} {', '.join(map(str, range(last)))} and "
                 f"(2, *, 2) with seq_dim=1 on rank {last}",
        "ndim": f"ValueError: x must have the same shape on every rank of the group apart from its seq_dim axis "
                f"(* below), got (2, *, 3, 1) with seq_dim=1 on rank 0 and (2, *, 3) with seq_dim=1 on "
                f"rank{rest} {others}",
        "seq_dim": f"ValueError: x must have the same shape on every rank of the group apart from its seq_dim axis "
                   f"(* below), got (*, 2, 3) with seq_dim=0 on rank 0 and (2, *, 3) with seq_dim=1 on "
                   f"rank{rest} {others}",
    }
    for rank, got in enumerate(mismatch):
        for name, message in expected.items():
            assert got[name] == message, (rank, name, got[name])
        if rank == 0:
            assert got["tokens"].startswith("ValueError: x must hold this rank's") and "got 1" in got["tokens"]
        else:
            assert "another rank of the group refused its arguments" in got["tokens"]
        whole = torch.randn(2, 8, 3, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        assert got["bfloat16"].dtype == torch.bfloat16 and torch.equal(got["bfloat16"], whole)


def test_attention_with_context_refuses_what_it_cannot_combine(ranks):
    _, results = ranks
    errors = results[0]["collectives"]
    assert "cache cannot be combined with context" in errors["attn_cache"]
    assert errors["attn_tokens"].startswith("ValueError: x must hold the") and "got 16" in errors["attn_tokens"]
    assert "context must be a ropekit.distributed.ContextShard" in errors["attn_type"]


def _plain_rotation(seq_len: int, scaling_name: str | None = "dynamic") -> ropekit.RotaryEmbedding:
    return ropekit.RotaryEmbedding(8, scaling=None if scaling_name is None else rule(scaling_name))


def _qkw(seq_len: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seq_len)
    return tuple(torch.randn(2, heads, seq_len, 8, generator=gen) for heads in (4, 2, 4))


def test_dtensor_qk_rotate_by_the_positions_of_their_placement(ranks):
    world, results = ranks
    for result in results:
        for label, got in result["dtensor"].items():
            if label == "errors":
                continue
            q, k, w = _qkw(got["seq_len"])
            ref_q, ref_k = _plain_rotation(got["seq_len"])(q.requires_grad_(), k)
            assert torch.equal(got["q"], ref_q.detach()) and torch.equal(got["k"], ref_k), label
            if "grad" in got:
                (ref_q * w).sum().backward()
                assert torch.equal(got["grad"], q.grad), label
                assert got["type"] == "DTensor" and got["placements"] == "(Shard(dim=2),)"
                assert got["inplace_same_object"] and torch.equal(got["inplace_q"], ref_q.detach())
        assert result["dtensor"]["uneven"]["shape"] == (2, 4, 10, 8)


def test_bad_dtensors_are_refused_with_the_argument_named(ranks):
    world, results = ranks
    errors = results[-1]["dtensor"]["errors"]
    assert "sharded along its last (channel) axis" in errors["channel"]
    assert "seq_len must be a multiple of 2*cp_size" in errors["zigzag_length"] and "q has 10 tokens" in (
        errors["zigzag_length"])
    if world == 4:
        assert "shard_scheme 'striped' puts 2 of the 10 tokens of q on mesh rank 3" in errors["striped_uneven"]
        assert "by mesh dims [0, 1]" in errors["two_mesh_dims"]
    else:
        assert errors["striped_uneven"] is None  # 5 and 5 tokens: striped and the Shard rule agree on the sizes
    assert errors["mixed"].startswith("TypeError: q and k must both be DTensors")
    assert "shard_scheme applies to DTensor q and k only" in errors["plain_scheme"]
    assert "inplace=True cannot rotate DTensors that require grad" in errors["inplace_grad"]
    for name in ("apply_rotary", "rotate_qk"):  # the kernels used to read address 0 of a DTensor: a crash
        assert errors[name].startswith("TypeError: ") and "is a DTensor" in errors[name]
        assert ".to_local()" in errors[name]


def test_torch_context_parallel_buffers(ranks):
    world, results = ranks
    rope = _plain_rotation(0, None)
    long_tables_wrong = False
    for rank, result in enumerate(results):
        for seq_len, got in result["torch_cp"].items():
            expected = shard_positions(seq_len, world, rank, scheme=got["scheme"])
            assert torch.equal(got["positions"], expected), (seq_len, got["scheme"])
            gen = torch.Generator().manual_seed(seq_len)
            q, k = torch.randn(2, 4, seq_len, 8, generator=gen), torch.randn(2, 2, seq_len, 8, generator=gen)
            ref_q, ref_k = (t[:, :, expected] for t in rope(q, k))
            for way in ("by_positions", "by_exact_tables"):
                assert torch.equal(got[way][0], ref_q) and torch.equal(got[way][1], ref_k), way
            if got["scheme"] == "zigzag":  # the balancer indexes the first seq_len rows: long tables work
                assert torch.equal(got["by_long_tables"][0], ref_q)
            else:  # no balancer: a longer table is cut by its own length, its rows are not the tokens' positions
                long_tables_wrong |= not torch.allclose(got["by_long_tables"][0], ref_q)
    assert long_tables_wrong


def test_the_guides_loop_runs(ranks):
    """docs/distributed.md's training loop, run on every rank: the gathered output and the sum of the ranks'
    losses are those of the same layers run in one process on the whole batch."""
    world, results = ranks
    code = guide_loop()
    setup = code[:code.index("shard = ContextShard")]  # the same seed, layers and batch, in this process
    namespace: dict = {}
    exec(compile(setup, "docs/distributed.md", "exec"), namespace)  # noqa: S102 - our own documentation
    h = namespace["x"]
    for layer in namespace["layers"]:
        h = h + layer(h)
    loss = ((h - namespace["target"]) ** 2).sum() / namespace["target"].numel()
    for result in results:
        torch.testing.assert_close(result["guide"]["y"], h.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(sum(result["guide"]["loss"] for result in results), loss.detach(), rtol=1e-6, atol=0)
