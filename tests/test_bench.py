"""``ropekit_lab.bench``: the rows it produces (what is timed next to what), their spread and flags.

Never the timings themselves: the flagging logic is driven by synthetic timings.
"""

import inspect
import io
import json
import types
from contextlib import redirect_stdout

import pytest
import torch

from ropekit import ops
from ropekit.cli.entry import main
from ropekit_lab import bench, bench_rows


def test_rows_pair_every_backend_with_its_floor():
    shape = bench.Shape("tiny", 2, 4, 2, 8, 16)  # GQA: 4 query heads, 2 key heads
    rows = bench.run(shapes=(shape,), dtypes=(torch.float32, torch.bfloat16), device="cpu", repeats=1,
                     compile_peer=False)
    by = {(r["dtype"], r["impl"], r["mode"]): r for r in rows}
    for dtype in ("float32", "bfloat16"):
        assert by[(dtype, "copy (x.clone)", "out-of-place")]["ratio_copy"] == 1.0
        assert by[(dtype, "in-place pass (x.mul_)", "in-place")]["ratio_copy"] == 1.0
        assert by[(dtype, "transformers eager", "out-of-place")]["ratio_hf"] == 1.0
        for name in ops.available():
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
    for r in rows:  # one repeat: no quartiles, so no spread and nothing to call noisy
        assert r["spread_pct"] is None and r["min_ms"] == r["ms"] and "noisy" not in r["flags"]
    table = bench.format_table(rows).splitlines()
    assert len(table) == len(rows) + 2 + len({f for r in rows for f in r["flags"]})
    assert any(line.startswith("| tiny | bfloat16 | cpu | in-place |") for line in table)


# -- spread and flags: synthetic timings -------------------------------------------------------------

BIG = bench_rows.BOUND_MIN_BYTES  # a call that moves enough bytes for the copy floor to bound it


def row(impl="cpu", ratio=1.0, spread=2.0, nbytes=BIG):
    return {"impl": impl, "ratio_copy": ratio, "spread_pct": spread, "bytes": nbytes}


@pytest.mark.parametrize("ratio", [0.25, 0.9, 1.0, 1.2, 1.3])
def test_a_plausible_quiet_row_is_not_flagged(ratio):
    assert bench.judge(row(ratio=ratio), {"spread_pct": 3.0}) == {"flags": [], "note": None}


@pytest.mark.parametrize("ratio", [1.5, 2.0, 2.5])
def test_a_rotation_much_faster_than_copying_the_same_bytes_is_flagged(ratio):
    verdict = bench.judge(row(ratio=ratio), {"spread_pct": 3.0})
    assert verdict["flags"] == ["beats floor"]
    assert f"{ratio:.2f}x" in verdict["note"] and "artefact" in verdict["note"] and "\n" not in verdict["note"]


def test_the_floor_bound_widens_with_the_spreads():
    limit = (1 + bench_rows.FLOOR_SLACK) * 1.09  # spreads of 4% and 5%
    assert bench.judge(row(ratio=limit * 0.99, spread=4.0), {"spread_pct": 5.0})["flags"] == []
    assert bench.judge(row(ratio=limit * 1.01, spread=4.0), {"spread_pct": 5.0})["flags"] == ["beats floor"]


def test_a_wide_spread_of_the_row_or_its_floor_is_flagged_noisy():
    limit = bench_rows.NOISE_LIMIT_PCT
    assert bench.judge(row(spread=limit + 1), {"spread_pct": 1.0})["flags"] == ["noisy"]
    assert bench.judge(row(spread=1.0), {"spread_pct": limit + 1})["flags"] == ["noisy"]
    assert bench.judge(row(spread=limit), {"spread_pct": limit})["flags"] == []
    both = bench.judge(row(ratio=9.0, spread=60.0), {"spread_pct": 60.0})
    assert both["flags"] == ["noisy", "beats floor"] and "; " in both["note"]  # 9x is beyond any noise


def test_floors_references_and_small_calls_are_not_bound_by_the_copy():
    for impl in bench_rows.REFERENCES:  # the floors, and a round trip into preallocated tensors
        assert bench.judge(row(impl=impl, ratio=2.0), {"spread_pct": 1.0})["flags"] == []
    # below BOUND_MIN_BYTES the fixed cost of a call, not its bytes, sets the time
    assert bench.judge(row(ratio=2.0, nbytes=BIG - 1), {"spread_pct": 1.0})["flags"] == []
    # unknown spreads (fewer than 3 repeats) judge the ratio alone
    assert bench.judge(row(ratio=1.2, spread=None), {"spread_pct": None})["flags"] == []
    assert bench.judge(row(ratio=1.5, spread=None), {"spread_pct": None})["flags"] == ["beats floor"]


def test_time_ms_reports_median_quartiles_minimum_and_spread(monkeypatch):
    durations = iter([1.0, 10.0, 3.0, 2.0, 4.0, 7.0])  # ms, in the order the calls take
    clock = {"now": 0.0, "start": True}

    def perf_counter():
        if not clock["start"]:
            clock["now"] += next(durations) / 1e3
        clock["start"] = not clock["start"]
        return clock["now"]

    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=perf_counter))
    timing = bench.time_ms(lambda: None, torch.device("cpu"), repeats=5, warmup=0)
    assert (timing.median, timing.q1, timing.q3, timing.minimum) == pytest.approx((3.0, 2.0, 4.0, 1.0))
    assert timing.spread_pct == pytest.approx(100 * 2.0 / 3.0)
    single = bench.time_ms(lambda: None, torch.device("cpu"), repeats=1, warmup=0)
    assert single.median == single.minimum == pytest.approx(7.0) and single.spread_pct is None


def scripted(copy_ms, copy_spread=1.0, other_ms=2.0, other_spread=1.0):
    """A stand-in for ``bench.time_ms``: the clone floor takes ``copy_ms``, every other forward ``other_ms``."""

    def time_ms(fn, device, repeats, warmup=2):
        source = inspect.getsource(fn)
        ms, spread = (copy_ms, copy_spread) if "q.clone(), k.clone()" in source else (other_ms, other_spread)
        ms *= 2 if "backward" in source else 1  # forward + backward moves twice the bytes
        half = ms * spread / 200
        return bench.Timing(ms, ms - half, ms + half, ms - 2 * half, repeats)

    return time_ms


def test_a_slow_copy_floor_flags_the_rows_it_bounds(monkeypatch):
    """A clone timed at 5x its true cost (fresh pages, a busy machine) flags what it bounds, nothing else."""
    monkeypatch.setattr(bench, "time_ms", scripted(copy_ms=10.0))
    big, small = bench.Shape("big", 1, 8, 8, 1024, 128), bench.Shape("small", 2, 4, 4, 1, 64)
    rows = bench.run(shapes=(big, small), dtypes=(torch.float32, torch.bfloat16), device="cpu", repeats=5,
                     compile_peer=False)
    assert rows[0]["impl"] == "copy (x.clone)" and rows[0]["ms"] == 10.0  # the stand-in saw the floor
    for r in rows:
        bound = (r["shape"] == "big" and r["mode"] != "in-place" and r["impl"] not in bench_rows.REFERENCES)
        assert r["flags"] == (["beats floor"] if bound else []), r
        assert r["spread_pct"] == pytest.approx(1.0) and r["min_ms"] < r["ms"]
    assert any(r["flags"] and r["impl"] == "cpu" for r in rows)

    monkeypatch.setattr(bench, "time_ms", scripted(copy_ms=2.0))  # the same rows with an honest floor
    rows = bench.run(shapes=(big,), dtypes=(torch.float32,), device="cpu", repeats=5, compile_peer=False)
    assert not any(r["flags"] for r in rows)


def test_json_and_text_carry_spread_and_flags(monkeypatch):
    """``ropekit bench --json`` rows carry spread, minimum, flags and note; the text table shows the flag and why."""
    monkeypatch.setattr(bench, "time_ms", scripted(copy_ms=10.0, copy_spread=30.0))
    monkeypatch.setattr(bench, "QUICK_SHAPES", (bench.Shape("big", 1, 8, 8, 1024, 128),))
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["bench", "--quick", "--device", "cpu", "--json"]) == 0
    rows = json.loads(out.getvalue())
    for r in rows:  # every row judged against the noisy copy is noisy; in place, the mul_ floor is quiet
        assert r["spread_pct"] == pytest.approx(30.0 if r["impl"] == "copy (x.clone)" else 1.0)
        assert r["min_ms"] < r["ms"] and ("noisy" in r["flags"]) == (r["mode"] != "in-place")
        assert r["note"] is None if r["mode"] == "in-place" else r["note"].startswith("spread 30%")
    assert ["noisy", "beats floor"] in [r["flags"] for r in rows]

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["bench", "--quick", "--device", "cpu"]) == 0
    lines = out.getvalue().splitlines()
    assert "| spread % |" in lines[0] and lines[0].endswith("| flag |")
    assert "| 30 |" in lines[2] and lines[2].endswith("| noisy |")
    assert any(line.endswith("| noisy, beats floor |") for line in lines)
    assert lines[-2] == "noisy: " + bench_rows.FLAGS["noisy"]
    assert lines[-1] == "beats floor: " + bench_rows.FLAGS["beats floor"]


def test_every_backend_and_row_name_is_explained():
    for name in ops.available():
        assert name in bench_rows.IMPLEMENTATIONS
    for name in ("copy (x.clone)", "in-place pass (x.mul_)", "transformers eager", "transformers + torch.compile",
                 "liger-kernel", "ropekit auto", "float32 round trip (x -> f32 -> x)"):
        assert bench_rows.describe(name) == bench_rows.IMPLEMENTATIONS[name]
    assert "registered" in bench_rows.describe("someone-elses-backend")
    assert "batch" in dict(bench_rows.COLUMNS)["shape"] and "head_dim" in bench_rows.DIMS
