"""What every rank runs in tests/test_distributed.py: all scenarios of one world size in one launch.

The model and the batches are built here from fixed seeds, so that the parent process builds the
very same ones for its single-process reference. Each scenario returns plain data (tensors,
strings); the parent does the comparing.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import ropekit
from ropekit.distributed import (
    SCHEMES,
    ContextShard,
    check_seq_len,
    global_seq_len,
    shard_order,
    torch_cp_scheme,
)
from ropekit.nn import KVCache, RotarySelfAttention
from ropekit.scaling import DynamicNTK, LongRoPE

EMBED, HEADS, KV_HEADS, LAYERS, BATCH = 32, 4, 2, 2, 2
HEAD_DIM = EMBED // HEADS
ORIGINAL_CONTEXT = 8  # the dynamic rules' original context: every global length below is past it
PACKED = (0, 8, 24, 32)  # each length a multiple of 2 * 4: every scheme splits it on 2 and on 4 ranks


def rule(name: str, fixed_seq_len: int | None = None):
    """The scaling rule ``name``; ``fixed_seq_len`` freezes a dynamic rule at that length."""
    if name == "none":
        return None
    if name == "dynamic":
        return DynamicNTK(factor=4.0, original_max_position_embeddings=ORIGINAL_CONTEXT, fixed_seq_len=fixed_seq_len)
    return LongRoPE(short_factor=[1.0] * (HEAD_DIM // 2), long_factor=[1.0, 2.0, 4.0, 8.0], factor=4.0,
                    original_max_position_embeddings=ORIGINAL_CONTEXT, fixed_seq_len=fixed_seq_len)


class TinyModel(torch.nn.Module):
    """A causal stack of ``RotarySelfAttention`` layers (shared rope, GQA) with residuals."""

    def __init__(self, scaling, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        rope = ropekit.RotaryEmbedding(HEAD_DIM, scaling=scaling)
        self.layers = torch.nn.ModuleList(
            RotarySelfAttention(EMBED, HEADS, num_kv_heads=KV_HEADS, rope=rope) for _ in range(LAYERS))
        self.to(dtype)

    def forward(self, x: torch.Tensor, context: ContextShard | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x, context=context)
        return x


def model_batch(tokens: int, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, w)``: hidden states ``(rows, tokens, EMBED)`` and the weights of the loss ``(y * w).sum()``."""
    gen = torch.Generator().manual_seed(tokens)
    return (torch.randn(rows, tokens, EMBED, generator=gen, dtype=dtype),
            torch.randn(rows, tokens, EMBED, generator=gen, dtype=dtype))


def model_cases() -> list[dict]:
    """Every model scenario: scheme, rule, dtype, and a fixed length or packed sequences."""
    cases = []
    for scheme in SCHEMES:
        for name in ("none", "dynamic"):
            for dtype in (torch.float32, torch.float64):
                cases.append(dict(scheme=scheme, rule=name, dtype=dtype, seq_len=16))
            cases.append(dict(scheme=scheme, rule=name, dtype=torch.float32, cu_seqlens=PACKED))
    cases.append(dict(scheme="contiguous", rule="longrope", dtype=torch.float32, seq_len=16))
    cases.append(dict(scheme="zigzag", rule="dynamic", dtype=torch.float64, cu_seqlens=PACKED))
    for scheme in ("contiguous", "striped"):  # uneven shards: 10 tokens on 4 ranks are 3, 3, 3, 1 or 3, 3, 2, 2
        cases.append(dict(scheme=scheme, rule="dynamic", dtype=torch.float32, seq_len=10))
    cases.append(dict(scheme="contiguous", rule="none", dtype=torch.float32, seq_len=6))  # 2, 2, 2, 0: an empty rank
    return cases


def case_name(case: dict) -> str:
    length = f"L={case['seq_len']}" if "seq_len" in case else f"cu_seqlens={list(case['cu_seqlens'])}"
    return f"{case['scheme']}-{case['rule']}-{str(case['dtype']).removeprefix('torch.')}-{length}"


def _run_model_case(case: dict) -> dict:
    """One rank's part of a context-parallel step: outputs gathered, gradients all-reduced."""
    model = TinyModel(rule(case["rule"]), case["dtype"])
    if "seq_len" in case:
        x, w = model_batch(case["seq_len"], BATCH, case["dtype"])
        shard = ContextShard(case["seq_len"], scheme=case["scheme"])
    else:
        x, w = model_batch(case["cu_seqlens"][-1], 1, case["dtype"])
        shard = ContextShard(scheme=case["scheme"], cu_seqlens=torch.tensor(case["cu_seqlens"]))
    y_local = model(shard.shard(x, seq_dim=1), context=shard)
    (y_local * shard.shard(w, seq_dim=1)).sum().backward()  # a sum over tokens: the ranks' parts add up
    grads = {}
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad)  # what data/context-parallel training does with the gradients
        grads[name] = param.grad
    return {"y": shard.gather(y_local.detach(), seq_dim=1), "grads": grads, "positions": shard.positions,
            "rope_seq_len": shard.rope_seq_len}


def _expect_error(call, kind=ValueError) -> str | None:
    """The message of the ``kind`` error ``call()`` raises, or None if it raises none."""
    try:
        call()
    except kind as error:
        return f"{type(error).__name__}: {error}"
    return None


def _collective_cases(rank: int, world: int) -> dict:
    """Ranks that disagree, a length derived across ranks, and gathers (uneven, packed) with their gradients."""
    out = {
        "check_seq_len": _expect_error(lambda: check_seq_len(16 if rank else 8)),
        "seq_len": _expect_error(lambda: ContextShard(16 if rank == world - 1 else 32, scheme="zigzag")),
        "scheme": _expect_error(lambda: ContextShard(16, scheme="zigzag" if rank else "contiguous")),
        "cu_seqlens": _expect_error(lambda: ContextShard(
            scheme="zigzag", cu_seqlens=torch.tensor([0, 8, 16] if rank == 1 else [0, 16, 24]))),
        "rope_seq_len": _expect_error(lambda: ContextShard(16, scheme="striped", rope_seq_len=16 + rank)),
        # one rank's arguments fail their own checks: it raises its error, the others learn of it (none waits)
        "refused_here": _expect_error(lambda: ContextShard(10 if rank == 0 else 16, scheme="zigzag")),
        "refused_type": _expect_error(lambda: check_seq_len("16" if rank == 0 else 16), (TypeError, ValueError)),
        "refused_positions": _expect_error(lambda: global_seq_len(torch.tensor([-1 if rank == 0 else 3])),
                                           (TypeError, ValueError)),
        "agreed": check_seq_len(24),  # the group still works after the refusals
    }
    zigzag = ContextShard(8 * world, scheme="zigzag")
    out["global_seq_len"] = global_seq_len(zigzag.positions)
    out["local_seq_len"] = int(zigzag.positions.max()) + 1
    gathers = {}
    for label, kwargs in (("contiguous-10", dict(seq_len=10, scheme="contiguous")),
                          ("contiguous-5", dict(seq_len=5, scheme="contiguous")),  # 2, 2, 1, 0 on 4 ranks
                          ("striped-10", dict(seq_len=10, scheme="striped")),
                          ("zigzag-packed", dict(scheme="zigzag", cu_seqlens=torch.tensor(PACKED)))):
        shard = ContextShard(**kwargs)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(2, shard.seq_len, 3, generator=gen)
        w = torch.randn(2, shard.seq_len, 3, generator=gen)
        local = shard.shard(x, seq_dim=1).requires_grad_()
        whole = shard.gather(local, seq_dim=1)
        (whole * w).sum().backward()
        gathers[label] = {"x": x, "w": w, "whole": whole.detach(), "grad": local.grad,
                          "token_index": shard.token_index}
    out["gathers"] = gathers
    shard = ContextShard(8, scheme="contiguous")
    local = shard.shard(torch.randn(2, 8, 3, generator=torch.Generator().manual_seed(2)), seq_dim=1)
    out["gather_mismatch"] = {  # the ranks agree on dtype and shape before any bytes move
        "dtype": _expect_error(lambda: shard.gather(local.to(torch.float16 if rank == 0 else torch.bfloat16),
                                                    seq_dim=1)),
        "shape": _expect_error(lambda: shard.gather(local if rank < world - 1 else local[..., :2], seq_dim=1)),
        "ndim": _expect_error(lambda: shard.gather(local if rank else local[..., None], seq_dim=1)),
        "seq_dim": _expect_error(lambda: shard.gather(local if rank else local.transpose(0, 1),
                                                      seq_dim=1 if rank else 0)),
        "tokens": _expect_error(lambda: shard.gather(local[:, :1] if rank == 0 else local, seq_dim=1)),
        "bfloat16": shard.gather(local.to(torch.bfloat16), seq_dim=1),  # the group still works, in any one dtype
    }
    attn = RotarySelfAttention(EMBED, HEADS)
    shard = ContextShard(16, scheme="zigzag")
    local = torch.randn(1, shard.token_index.numel(), EMBED)
    out["attn_cache"] = _expect_error(lambda: attn(local, cache=KVCache(), context=shard))
    out["attn_tokens"] = _expect_error(lambda: attn(torch.randn(1, 16, EMBED), context=shard))
    out["attn_type"] = _expect_error(lambda: attn(local, context={"positions": shard.positions}), TypeError)
    return out


def _dtensor_cases(rank: int, world: int) -> dict:
    """DTensor q/k sharded along the sequence (stored in each scheme's order), heads, unevenly; bad placements."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    rope = ropekit.RotaryEmbedding(HEAD_DIM, scaling=rule("dynamic"))
    out = {}

    def qkw(seq_len):
        gen = torch.Generator().manual_seed(seq_len)
        return tuple(torch.randn(2, heads, seq_len, HEAD_DIM, generator=gen) for heads in (HEADS, KV_HEADS, HEADS))

    for scheme in SCHEMES:
        seq_len = 8 * world
        q, k, w = qkw(seq_len)
        order = shard_order(seq_len, world, scheme=scheme)
        dq, dk, dw = (distribute_tensor(t.index_select(2, order), mesh, [Shard(2)], src_data_rank=None)
                      for t in (q, k, w))
        dq.requires_grad_()
        oq, ok = rope(dq, dk, shard_scheme=scheme)
        (oq * dw).sum().backward()
        restore = order.argsort()
        out[scheme] = {"q": oq.full_tensor().index_select(2, restore), "k": ok.full_tensor().index_select(2, restore),
                       "grad": dq.grad.full_tensor().index_select(2, restore), "placements": str(oq.placements),
                       "type": type(oq).__name__, "seq_len": seq_len}
        iq, ik = (distribute_tensor(t.index_select(2, order), mesh, [Shard(2)], src_data_rank=None) for t in (q, k))
        with torch.no_grad():
            back_q, _ = rope(iq, ik, shard_scheme=scheme, inplace=True)
        out[scheme]["inplace_same_object"] = back_q is iq
        out[scheme]["inplace_q"] = iq.full_tensor().index_select(2, restore)
    q, k, _ = qkw(10)  # 10 tokens: 5, 5 on 2 ranks; 3, 3, 3, 1 on 4
    oq, ok = rope(distribute_tensor(q, mesh, [Shard(2)]), distribute_tensor(k, mesh, [Shard(2)]))
    out["uneven"] = {"q": oq.full_tensor(), "k": ok.full_tensor(), "shape": tuple(oq.shape), "seq_len": 10}
    q, k, _ = qkw(12)  # heads sharded (tensor parallelism), GQA keys replicated: every rank has every position
    oq, ok = rope(distribute_tensor(q, mesh, [Shard(1)]), distribute_tensor(k, mesh, [Replicate()]))
    out["heads"] = {"q": oq.full_tensor(), "k": ok.full_tensor(), "seq_len": 12}
    q, k, _ = qkw(8 * world)
    dq, dk = distribute_tensor(q, mesh, [Shard(2)]), distribute_tensor(k, mesh, [Shard(2)])
    cos, sin = rope.tables(8 * world)
    out["errors"] = {
        "channel": _expect_error(lambda: rope(distribute_tensor(q, mesh, [Shard(3)]), None)),
        "zigzag_length": _expect_error(lambda: rope(*(distribute_tensor(t[:, :, :10], mesh, [Shard(2)])
                                                      for t in (q, k)), shard_scheme="zigzag")),
        "striped_uneven": _expect_error(lambda: rope(*(distribute_tensor(t[:, :, :10], mesh, [Shard(2)])
                                                       for t in (q, k)), shard_scheme="striped")),
        "mixed": _expect_error(lambda: rope(dq, k), TypeError),
        "plain_scheme": _expect_error(lambda: rope(q, k, shard_scheme="zigzag")),
        "inplace_grad": _expect_error(lambda: rope(distribute_tensor(q, mesh, [Shard(2)]).requires_grad_() * 1.0,
                                                   None, inplace=True)),
        "apply_rotary": _expect_error(lambda: ropekit.apply_rotary(dq, cos[:8 * world], sin[:8 * world]), TypeError),
        "rotate_qk": _expect_error(lambda: ropekit.rotate_qk(dq, dk, cos, sin, seq_dim=2), TypeError),
    }
    if world == 4:  # the sequence sharded by both dims of a 2 x 2 mesh: which one is context parallel?
        mesh2 = init_device_mesh("cpu", (2, 2))
        out["errors"]["two_mesh_dims"] = _expect_error(
            lambda: rope(distribute_tensor(q, mesh2, [Shard(2), Shard(2)]), None))
    return out


def _torch_cp_cases(rank: int, world: int) -> dict:
    """torch's context_parallel shards buffers on the CPU (its ring attention needs CUDA, so no SDPA inside).

    Positions passed as a buffer come back in its load balancer's order; cos/sin tables as buffers work
    when they have exactly seq_len rows, and go wrong when longer and the balancer is off (the pitfall).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,))
    rope = ropekit.RotaryEmbedding(HEAD_DIM)
    out = {}
    for seq_len in (8 * world, 8 * world + 2):  # zigzag, then (seq_len % (2 * world) != 0) contiguous blocks
        gen = torch.Generator().manual_seed(seq_len)
        q = torch.randn(2, HEADS, seq_len, HEAD_DIM, generator=gen)
        k = torch.randn(2, KV_HEADS, seq_len, HEAD_DIM, generator=gen)
        cos, sin = rope.tables(seq_len)  # cached tables: 256 rows, longer than the sequence
        exact_cos, exact_sin = cos[:seq_len].clone(), sin[:seq_len].clone()
        long_cos, long_sin = cos.clone(), sin.clone()
        positions = torch.arange(seq_len)[None].clone()  # (batch 1, seq): torch's unshard assumes a batch axis
        buffers = [q, k, positions, exact_cos, exact_sin, long_cos, long_sin]
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 1, 0, 0, 0, 0], no_restore_buffers={q, k}):
            n = q.shape[2]
            by_positions = rope(q, k, positions[0], seq_len=seq_len)
            by_exact_tables = ropekit.apply_rotary_qk(q, k, exact_cos, exact_sin)
            by_long_tables = ropekit.apply_rotary_qk(q, k, long_cos[:n], long_sin[:n])
            out[seq_len] = {"positions": positions[0].clone(), "by_positions": by_positions,
                            "by_exact_tables": by_exact_tables, "by_long_tables": by_long_tables,
                            "scheme": torch_cp_scheme(seq_len, world)}
    return out


def guide_loop() -> str:
    """The training-loop example of docs/distributed.md (the python block that builds ``ContextShard(64``)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "distributed.md").read_text(encoding="utf-8")
    blocks = [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]
    return next(block for block in blocks if "ContextShard(64" in block)


def _run_guide_loop() -> dict:
    namespace: dict = {}
    exec(compile(guide_loop(), "docs/distributed.md", "exec"), namespace)  # noqa: S102 - our own documentation
    return {"y": namespace["y"], "loss": namespace["loss"].detach()}


def run_all(rank: int, world: int) -> dict:
    """Every scenario of one world size, in one launch."""
    models = {case_name(case): _run_model_case(case) for case in model_cases()}
    return {"models": models, "collectives": _collective_cases(rank, world), "dtensor": _dtensor_cases(rank, world),
            "guide": _run_guide_loop(), "torch_cp": _torch_cp_cases(rank, world)}
