"""``ropekit.tools.bench``: the rows it produces (what is timed next to what), not the timings."""

import torch

from ropekit import backends
from ropekit.tools import bench


def test_rows_pair_every_backend_with_its_floor():
    shape = bench.Shape("tiny", 2, 4, 2, 8, 16)  # GQA: 4 query heads, 2 key heads
    rows = bench.run(shapes=(shape,), dtypes=(torch.float32, torch.bfloat16), device="cpu", repeats=1,
                     compile_peer=False)
    by = {(r["dtype"], r["impl"], r["mode"]): r for r in rows}
    for dtype in ("float32", "bfloat16"):
        assert by[(dtype, "copy (x.clone)", "out-of-place")]["ratio_copy"] == 1.0
        assert by[(dtype, "in-place pass (x.mul_)", "in-place")]["ratio_copy"] == 1.0
        assert by[(dtype, "transformers eager", "out-of-place")]["ratio_hf"] == 1.0
        for name in backends.available():
            if name == "triton":
                continue  # CUDA only (it would fall back to eager ops on the CPU)
            out, inplace = by[(dtype, name, "out-of-place")], by[(dtype, name, "in-place")]
            assert out["ms"] > 0 and inplace["ms"] > 0 and out["ratio_hf"] is not None
        # autograd keeps the two half-width float32 tables and nothing of q's or k's size;
        # transformers keeps its two full-width tables in the activation dtype
        tables = 2 * shape.seq * (shape.head_dim // 2) * 4 / 2**20
        assert by[(dtype, "ropekit auto", "fwd+bwd")]["saved_mb"] == tables
        itemsize = 4 if dtype == "float32" else 2
        full_tables = 2 * shape.seq * shape.head_dim * itemsize / 2**20
        assert by[(dtype, "transformers eager", "fwd+bwd")]["saved_mb"] == full_tables
    assert ("bfloat16", "float32 round trip (x -> f32 -> x)", "out-of-place") in by
    assert ("float32", "float32 round trip (x -> f32 -> x)", "out-of-place") not in by
    assert not any(r["impl"] == "liger-kernel" for r in rows)  # a GPU peer
    table = bench.format_table(rows)
    assert table.count("\n") == len(rows) + 1 and "| tiny | bfloat16 | cpu | in-place |" in table
