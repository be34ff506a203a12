"""``ropekit_lab.bench``: the rows it produces (what is timed next to what), their uncertainty and flags.

Never the timings themselves: the stopping rule runs on a fake clock, the flagging logic and the
busy notice on synthetic timings.
"""

import importlib.util
import io
import json
import random
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import torch

import ropekit
from ropekit import ops
from ropekit.cli.entry import main
from ropekit_lab import bench, bench_peers, bench_rows
from ropekit_lab.bench_timing import Plan, Timing, interleaved, quantile_interval


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """The load average as a quiet machine's (the real one would decide the busy notice)."""
    monkeypatch.setattr(bench, "machine_load", lambda: (0.5, 2))


def test_rows_pair_every_backend_with_its_floor():
    shape = bench.Shape("tiny", 2, 4, 2, 8, 16)  # GQA: 4 query heads, 2 key heads
    rows = bench.run(shapes=(shape,), dtypes=(torch.float32, torch.bfloat16), device="cpu", repeats=1,
                     compile_peer=False, budget_s=0)
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
    for r in rows:  # one repeat: no quartiles, so no spread, no uncertainty and nothing to call noisy
        assert r["spread_pct"] is None and r["error_pct"] is None and r["min_ms"] == r["ms"] == r["median_ms"]
        assert r["repeats"] == 1 and "noisy" not in r["flags"]
        assert (r["load_avg"], r["cores"], r["budget_s"]) == (0.5, 2, 0) and r["used_s"] > 0
    table = bench.format_table(rows).splitlines()
    assert len(table) == len(rows) + 3 + len({f for r in rows for f in r["flags"]})  # + the measuring line
    assert any(line.startswith("| tiny | bfloat16 | cpu | in-place |") for line in table)


# -- uncertainty and flags: synthetic timings ---------------------------------------------------------

BIG = bench_rows.BOUND_MIN_BYTES  # a call that moves enough bytes for the copy floor to bound it


def row(impl="cpu", ratio=1.0, error=2.0, nbytes=BIG):
    return {"impl": impl, "ratio_copy": ratio, "error_pct": error, "bytes": nbytes}


@pytest.mark.parametrize("ratio", [0.25, 0.9, 1.0, 1.2, 1.3])
def test_a_plausible_quiet_row_is_not_flagged(ratio):
    assert bench.judge(row(ratio=ratio), {"error_pct": 1.0}) == {"flags": [], "note": None}


@pytest.mark.parametrize("ratio", [1.5, 2.0, 2.5])
def test_a_rotation_much_faster_than_copying_the_same_bytes_is_flagged(ratio):
    verdict = bench.judge(row(ratio=ratio), {"error_pct": 3.0})
    assert verdict["flags"] == ["beats floor"]
    assert f"{ratio:.2f}x" in verdict["note"] and "artefact" in verdict["note"] and "\n" not in verdict["note"]


def test_the_floor_bound_widens_with_the_uncertainties():
    limit = (1 + bench_rows.FLOOR_SLACK) * 1.07  # uncertainties of 3% and 4%
    assert bench.judge(row(ratio=limit * 0.99, error=3.0), {"error_pct": 4.0})["flags"] == []
    assert bench.judge(row(ratio=limit * 1.01, error=3.0), {"error_pct": 4.0})["flags"] == ["beats floor"]


def test_an_uncertain_time_of_the_row_or_its_floor_is_flagged_noisy():
    limit = bench_rows.NOISE_LIMIT_PCT
    assert bench.judge(row(error=limit + 1), {"error_pct": 1.0})["flags"] == ["noisy"]
    assert bench.judge(row(error=1.0), {"error_pct": limit + 1})["flags"] == ["noisy"]
    assert bench.judge(row(error=limit), {"error_pct": limit})["flags"] == []
    both = bench.judge(row(ratio=9.0, error=60.0), {"error_pct": 60.0})
    assert both["flags"] == ["noisy", "beats floor"] and "; " in both["note"]  # 9x is beyond any noise


def test_floors_references_and_small_calls_are_not_bound_by_the_copy():
    for impl in bench_rows.REFERENCES:  # the floors, and a round trip into preallocated tensors
        assert bench.judge(row(impl=impl, ratio=2.0), {"error_pct": 1.0})["flags"] == []
    # below BOUND_MIN_BYTES the fixed cost of a call, not its bytes, sets the time
    assert bench.judge(row(ratio=2.0, nbytes=BIG - 1), {"error_pct": 1.0})["flags"] == []
    # unknown uncertainties (fewer than 3 repeats) judge the ratio alone
    assert bench.judge(row(ratio=1.2, error=None), {"error_pct": None})["flags"] == []
    assert bench.judge(row(ratio=1.5, error=None), {"error_pct": None})["flags"] == ["beats floor"]


# -- the stopping rule, on a fake clock ----------------------------------------------------------------


class FakeClock:
    """Seconds that pass only when a fake call says so; each call logs its name."""

    def __init__(self) -> None:
        self.now, self.log = 0.0, []

    def __call__(self) -> float:
        return self.now

    def call(self, name: str, durations_ms):
        """A call named ``name`` that takes the next of ``durations_ms`` (cycled) each time."""
        durations = iter(durations_ms)

        def run() -> None:
            self.log.append(name)
            self.now += next(durations) / 1e3
        return run


def cycle(*values):
    while True:
        yield from values


def test_the_timing_is_the_lower_quartile_with_its_interval_against_numpy():
    gen = random.Random(0)
    samples = [gen.lognormvariate(0, 0.4) for _ in range(37)]
    timing = Timing.of(samples)
    assert timing.estimate == timing.q1 == pytest.approx(np.quantile(samples, 0.25))
    assert timing.median == pytest.approx(np.median(samples)) and timing.minimum == min(samples)
    assert timing.q3 == pytest.approx(np.quantile(samples, 0.75)) and timing.repeats == 37
    assert timing.spread_pct == pytest.approx(100 * (timing.q3 - timing.q1) / timing.median)
    assert timing.low <= timing.q1 <= timing.high and timing.low in samples and timing.high in samples
    assert timing.error_pct == pytest.approx(100 * (timing.high - timing.low) / 2 / timing.q1)
    doubled = timing.scaled(2)
    assert (doubled.estimate, doubled.low, doubled.error_pct) == pytest.approx(
        (2 * timing.estimate, 2 * timing.low, timing.error_pct))
    assert Timing.of([3.0, 1.0]).error_pct is None and Timing.of([3.0]).spread_pct is None
    with pytest.raises(ValueError, match="samples"):
        Timing.of([])


@pytest.mark.parametrize("n", [12, 40, 150])
def test_the_quartile_interval_covers_the_true_quartile_about_95_percent_of_the_time(n):
    gen = random.Random(n)
    true_q1 = -np.log(0.75)  # of the unit exponential: a skewed law, as wall times are
    covered = 0
    for _ in range(1500):
        low, high = quantile_interval(sorted(gen.expovariate(1.0) for _ in range(n)), 0.25)
        covered += low <= true_q1 <= high
    assert 0.93 <= covered / 1500 <= 0.995, covered / 1500  # the ranks are rounded outwards: at least 95%


def test_rounds_interleave_the_calls_in_a_turning_order():
    clock = FakeClock()
    calls = {name: clock.call(name, cycle(1.0)) for name in "abc"}
    timings, seconds = interleaved(calls, Plan(4, 4, 100.0, 5.0), clock=clock, warmup={"a": 1, "b": 1, "c": 1})
    assert clock.log == list("abc") + list("abc" "bca" "cab" "abc")  # the warm-up, then 4 rounds
    assert {t.repeats for t in timings.values()} == {4} and seconds == pytest.approx(0.012)


def test_steady_calls_stop_at_the_least_number_of_rounds():
    clock = FakeClock()
    calls = {"copy": clock.call("copy", cycle(2.0)), "rotation": clock.call("rotation", cycle(2.5))}
    timings, _ = interleaved(calls, Plan(5, 1000, 100.0, 5.0), clock=clock)
    assert timings["copy"].repeats == 5 and timings["copy"].estimate == pytest.approx(2.0)
    assert timings["rotation"].error_pct < 1e-9


def test_rounds_go_on_until_every_time_is_known():
    """One call slowed down at random by another job: rounds go on until its lower quartile is known to 5%;
    the steady one leaves the rounds once its time is known."""
    gen = random.Random(1)
    durations = [2.0 * (1 + 0.02 * gen.random()) * (3 if gen.random() < 0.4 else 1) for _ in range(1000)]
    clock = FakeClock()
    calls = {"copy": clock.call("copy", cycle(2.0)), "rotation": clock.call("rotation", durations)}
    timings, _ = interleaved(calls, Plan(5, 900, 100.0, 5.0), clock=clock)
    done = timings["rotation"]
    assert timings["copy"].repeats == 5  # known at once, it left the rounds to the call still unknown
    assert clock.log[-3:] == ["rotation"] * 3
    samples = durations[2:2 + done.repeats]  # after the two warm-up calls
    assert done.estimate == pytest.approx(Timing.of(samples).estimate) and 5 < done.repeats < 900
    assert done.error_pct <= 5.0 and done.spread_pct > 50  # known, though the samples stay spread
    assert done.estimate == pytest.approx(2.0, rel=0.05)  # the undisturbed time, not the median's ~2x
    for rounds in range(5, done.repeats):  # it stopped at the first round it could
        assert Timing.of(samples[:rounds]).error_pct > 5.0


def test_the_budget_ends_the_rounds_of_a_time_that_stays_unknown():
    clock = FakeClock()  # anywhere from 1 to 9 ms: its lower quartile takes thousands of rounds to know to 5%
    gen = random.Random(2)
    calls = {"a": clock.call("a", (gen.uniform(1.0, 9.0) for _ in iter(int, 1))), "b": clock.call("b", cycle(1.0))}
    timings, seconds = interleaved(calls, Plan(3, 1000, 0.05, 5.0), clock=clock)
    assert 3 <= timings["a"].repeats < 1000 and timings["a"].error_pct > 5.0
    assert 0.05 <= seconds < 0.05 + 0.011  # stopped by the round that crossed the budget
    timings, seconds = interleaved(calls, Plan(3, 7, 100.0, 5.0), clock=clock)
    assert timings["a"].repeats == 7  # or by max_repeats
    timings, _ = interleaved(calls, Plan(3, 1000, 0.0, 5.0), clock=clock)
    assert timings["a"].repeats == 3  # a zero budget: the least number of rounds


def test_a_short_call_is_repeated_within_its_turn():
    clock = FakeClock()
    calls = {"decode": clock.call("decode", cycle(0.25)), "prefill": clock.call("prefill", cycle(4.0))}
    plan = Plan(2, 2, 0.0, 5.0, sample_s=1e-3)
    timings, _ = interleaved(calls, plan, clock=clock, warmup={"decode": 1, "prefill": 1})
    assert clock.log == ["decode", "prefill"] + ["decode"] * 4 + ["prefill"] + ["prefill"] + ["decode"] * 4
    assert timings["decode"].estimate == pytest.approx(0.25) and timings["prefill"].estimate == pytest.approx(4.0)


def test_a_plan_names_what_is_wrong_with_it():
    with pytest.raises(ValueError, match="min_repeats"):
        Plan(0, 3, 1.0, 5.0)
    with pytest.raises(ValueError, match="min_repeats"):
        Plan(4, 3, 1.0, 5.0)
    with pytest.raises(ValueError, match="budget_s"):
        Plan(1, 3, -1.0, 5.0)
    with pytest.raises(ValueError, match="calls"):
        interleaved({}, Plan(1, 1, 0.0, 5.0))


def test_time_ms_times_exactly_its_repeats():
    timing = bench.time_ms(lambda: sum(range(100)), torch.device("cpu"), repeats=4, warmup=1)
    assert timing.repeats == 4 and 0 < timing.minimum <= timing.estimate <= timing.median


def test_run_splits_the_budget_cheap_cases_first_and_keeps_the_order(monkeypatch):
    seen = []

    def case(shape, dtype, device, plan, *, backward, compile_peer):
        seen.append((shape.name, str(dtype), plan.budget_s))
        used = {"decode": 0.5}.get(shape.name, plan.budget_s)  # the small case stops early
        return [{"shape": shape.name, "dtype": str(dtype), "flags": []}], used

    monkeypatch.setattr(bench, "_case", case)
    small, large = bench.Shape("decode", 2, 2, 2, 1, 8), bench.Shape("prefill", 1, 4, 4, 64, 8)
    rows = bench.run(shapes=(large, small), dtypes=(torch.float32,), device="cpu", budget_s=10.0)
    assert seen == [("decode", "torch.float32", 5.0), ("prefill", "torch.float32", 9.5)]  # 10 - 0.5 left
    assert [r["shape"] for r in rows] == ["prefill", "decode"]  # rows in the order asked for
    assert all(r["budget_s"] == 10.0 and r["used_s"] == 10.0 and r["load_avg"] == 0.5 and r["cores"] == 2
               for r in rows)


def scripted(copy_ms, copy_error=1.0, other_ms=2.0, other_error=1.0):
    """A stand-in for ``bench.interleaved``: the clone floor takes ``copy_ms``, every other forward ``other_ms``."""

    def fake(calls, plan, **kwargs):
        out = {}
        for name in calls:
            ms, error = (copy_ms, copy_error) if name == "copy" else (other_ms, other_error)
            ms *= 2 if "fwd+bwd" in name else 1  # forward + backward moves twice the bytes
            half = ms * error / 100
            out[name] = Timing(1.05 * ms, ms, 1.1 * ms, 0.9 * ms, plan.min_repeats, ms - half, ms + half)
        return out, 0.25

    return fake


def test_a_slow_copy_floor_flags_the_rows_it_bounds(monkeypatch):
    """A clone timed at 5x its true cost (fresh pages, a busy machine) flags what it bounds, nothing else."""
    monkeypatch.setattr(bench, "interleaved", scripted(copy_ms=10.0))
    big, small = bench.Shape("big", 1, 8, 8, 1024, 128), bench.Shape("small", 2, 4, 4, 1, 64)
    rows = bench.run(shapes=(big, small), dtypes=(torch.float32, torch.bfloat16), device="cpu", repeats=5,
                     compile_peer=False)
    assert rows[0]["impl"] == "copy (x.clone)" and rows[0]["ms"] == 10.0  # the stand-in saw the floor
    for r in rows:
        bound = (r["shape"] == "big" and r["mode"] != "in-place" and r["impl"] not in bench_rows.REFERENCES)
        assert r["flags"] == (["beats floor"] if bound else []), r
        assert r["error_pct"] == pytest.approx(1.0) and r["min_ms"] < r["ms"] < r["median_ms"]
    assert any(r["flags"] and r["impl"] == "cpu" for r in rows)
    assert rows[0]["used_s"] == 4 * 0.25  # four cases

    monkeypatch.setattr(bench, "interleaved", scripted(copy_ms=2.0))  # the same rows with an honest floor
    rows = bench.run(shapes=(big,), dtypes=(torch.float32,), device="cpu", repeats=5, compile_peer=False)
    assert not any(r["flags"] for r in rows)


def test_json_and_text_carry_uncertainty_and_flags(monkeypatch):
    """``ropekit bench --json`` rows carry the uncertainty, minimum, flags and note; the text shows the flag and why."""
    monkeypatch.setattr(bench, "interleaved", scripted(copy_ms=10.0, copy_error=3.0, other_error=2.0))
    monkeypatch.setattr(bench, "QUICK_SHAPES", (bench.Shape("big", 1, 8, 8, 1024, 128),))
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["bench", "--quick", "--device", "cpu", "--json", "--budget", "2.5"]) == 0
    rows = json.loads(out.getvalue())
    for r in rows:
        assert r["error_pct"] == pytest.approx(3.0 if r["impl"] == "copy (x.clone)" else 2.0)
        assert r["min_ms"] < r["ms"] and r["budget_s"] == 2.5 and r["load_avg"] == 0.5
    assert [r["flags"] for r in rows if r["flags"]] and all(f == ["beats floor"] for f in (r["flags"] for r in rows)
                                                             if f)

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["bench", "--quick", "--device", "cpu"]) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("| shape |") and "| ± % |" in lines[0] and lines[0].endswith("| flag |")
    assert "| 3.0 |" in lines[2] and lines[2].endswith("|  |")
    assert any(line.endswith("| beats floor |") for line in lines)
    assert lines[-2] == "beats floor: " + bench_rows.FLAGS["beats floor"]
    assert lines[-1].startswith("Timed in interleaved rounds") and "0 of " in lines[-1]


def test_a_machine_too_busy_to_measure_is_said_once_instead_of_flagging_most_rows(monkeypatch):
    monkeypatch.setattr(bench, "interleaved", scripted(copy_ms=10.0, copy_error=30.0))
    monkeypatch.setattr(bench, "QUICK_SHAPES", (bench.Shape("big", 1, 8, 8, 1024, 128),))
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["bench", "--quick", "--device", "cpu", "--json"]) == 0
    rows = json.loads(out.getvalue())
    noisy = sum("noisy" in r["flags"] for r in rows)  # every row judged against the uncertain copy
    assert noisy == sum(r["mode"] != "in-place" for r in rows) > len(rows) / 3  # JSON keeps every row's flags

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["bench", "--quick", "--device", "cpu"]) == 0
    text = out.getvalue()
    lines = text.splitlines()
    assert lines[0] == bench_rows.busy_notice(rows) and f"{noisy} of {len(rows)} rows" in lines[0]
    assert text.count("too busy") == 1 and "noisy" not in "".join(lines[1:-1])  # no row's flag, no flag line
    assert any(line.endswith("| beats floor |") for line in lines)  # the other flag stays
    assert f"{noisy} of {len(rows)} rows still noisy" in lines[-1]


def test_the_busy_notice_speaks_for_many_noisy_rows_or_an_overloaded_machine():
    def rows(noisy, total=9, load=0.5, cores=2):
        return [{"flags": ["noisy"] if i < noisy else [], "load_avg": load, "cores": cores} for i in range(total)]

    assert bench_rows.busy_notice(rows(3)) is None  # a third: each row says it
    notice = bench_rows.busy_notice(rows(4))
    assert notice.startswith("This machine was too busy to measure: 4 of 9 rows") and "\n" not in notice
    assert "load average 0.5 on 2 cores" in notice
    assert bench_rows.busy_notice(rows(0, load=2.5)) is not None and bench_rows.busy_notice(rows(0, load=2.0)) is None
    assert bench_rows.busy_notice(rows(4, load=None)) is not None and "load" not in bench_rows.busy_notice(
        rows(4, load=None))
    assert bench_rows.busy_notice([]) is None
    row = {"flags": ["noisy", "beats floor"]}
    assert bench_rows.shown_flags(row, busy=True) == ["beats floor"]
    assert bench_rows.shown_flags(row, busy=False) == ["noisy", "beats floor"]


def test_every_backend_and_row_name_is_explained():
    for name in ops.available():
        assert name in bench_rows.IMPLEMENTATIONS
    for name in ("copy (x.clone)", "in-place pass (x.mul_)", "transformers eager", "transformers + torch.compile",
                 "liger-kernel", "ropekit auto", "float32 round trip (x -> f32 -> x)", *FUSED_ROWS):
        assert bench_rows.describe(name) == bench_rows.IMPLEMENTATIONS[name]
    for mode in ("out-of-place", "in-place", "fwd+bwd", "norm + rotation", "into cache"):
        assert mode in bench_rows.MODES
    assert "registered" in bench_rows.describe("someone-elses-backend")
    assert "batch" in dict(bench_rows.COLUMNS)["shape"] and "head_dim" in bench_rows.DIMS


# -- the fused forms' peers: what each row computes, against float64 oracles ----------------------------

FUSED_ROWS = (bench_rows.NORM_EAGER, bench_rows.NORM_COMPILE, bench_rows.NORM_OURS, bench_rows.CACHE_COPY,
              bench_rows.CACHE_EAGER, bench_rows.CACHE_COMPILE, bench_rows.CACHE_OURS)


def peer_inputs(dtype, seq=1, start=4095):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, seq, 32, generator=gen).to(dtype)
    k = torch.randn(2, 2, seq, 32, generator=gen).to(dtype)
    inv_freq, _ = ropekit.inv_frequencies(32)
    positions = torch.arange(start, start + seq)
    cos, sin = ropekit.cos_sin(positions, inv_freq)
    full = (torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype))
    return q, k, positions, inv_freq, full


def float64_norm(x, weight, eps):
    x64 = x.double()
    return x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps) * weight.double()


def assert_reference(got, want):
    """Within a few roundings of got's dtype (8 eps of the largest value)."""
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=8 * torch.finfo(got.dtype).eps * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq", [1, 5])
def test_every_peer_computes_the_float64_reference(dtype, seq):
    """transformers' rotation, its q/k norm + rotation and its rotate-then-copy cache write, against float64."""
    q, k, positions, inv_freq, (cos, sin) = peer_inputs(dtype, seq)
    rotated = bench.hf_recipe(q, k, cos, sin)
    for got, x in zip(rotated, (q, k), strict=True):
        assert_reference(got, ropekit.apply_reference(x, positions, inv_freq))

    weight = torch.linspace(0.5, 1.5, 32).to(dtype)
    norm = bench_peers.qwen3_norm(weight, 1e-6)
    normed = bench_peers.norm_then_rotate(norm, norm, bench.hf_recipe)(q, k, cos, sin)
    for got, x in zip(normed, (q, k), strict=True):
        assert_reference(got, ropekit.apply_reference(float64_norm(x, weight, 1e-6), positions, inv_freq))
    torch.testing.assert_close(bench_peers.reference_norm(q, weight, 1e-6), float64_norm(q, weight, 1e-6), rtol=1e-12,
                               atol=1e-12)

    v = torch.randn(k.shape).to(dtype)
    k_cache, v_cache = torch.zeros(2, 2, 16, 32, dtype=dtype), torch.zeros(2, 2, 16, 32, dtype=dtype)
    index = torch.arange(16 - seq, 16)
    bench_peers.rotate_then_copy(k, v, cos, sin, k_cache, v_cache, index)
    assert_reference(k_cache[:, :, 16 - seq:], ropekit.apply_reference(k, positions, inv_freq))
    assert torch.equal(v_cache[:, :, 16 - seq:], v) and not k_cache[:, :, :16 - seq].any()
    bench_peers.copy_into_cache(k, v, k_cache, v_cache, index)
    assert torch.equal(k_cache[:, :, 16 - seq:], k) and torch.equal(v_cache[:, :, 16 - seq:], v)


def test_check_refuses_a_result_off_the_reference_and_names_the_row():
    q, k, positions, inv_freq, (cos, sin) = peer_inputs(torch.float32)
    want = (ropekit.apply_reference(q, positions, inv_freq),)
    bench_peers.check("a row", bench.hf_recipe(q, k, cos, sin)[:1], want)
    off_by_one = ropekit.apply_rotary(q, *ropekit.cos_sin(positions + 1, inv_freq))
    with pytest.raises(RuntimeError, match="'a row' is off the float64 reference"):
        bench_peers.check("a row", (off_by_one,), want)
    with pytest.raises(RuntimeError, match="'a row' computes a result of shape"):
        bench_peers.check("a row", (q[:1],), want)


def test_decode_rows_time_the_fused_forms_beside_their_peers(monkeypatch):
    """On a decode step: the norm + rotation and cache-write rows, each against its floor and transformers' recipe.

    torch.compile is torch's business: here it hands back the recipe, so that the compiled rows are wired,
    checked and timed without compiling.
    """
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiled.append(kwargs) or fn)
    decode, prefill = bench.Shape("decode", 2, 4, 2, 1, 16), bench.Shape("prefill", 1, 2, 2, 8, 16)
    rows = bench.run(shapes=(decode, prefill), dtypes=(torch.float32, torch.bfloat16), device="cpu", repeats=1,
                     compile_peer=True, budget_s=0)
    assert len(compiled) == 2 * 3 + 2 and all(kwargs == {"dynamic": False} for kwargs in compiled)
    by = {(r["shape"], r["dtype"], r["impl"], r["mode"]): r for r in rows}
    for dtype, itemsize in (("float32", 4), ("bfloat16", 2)):
        for impl in (bench_rows.NORM_EAGER, bench_rows.NORM_COMPILE, bench_rows.NORM_OURS):
            row = by[("decode", dtype, impl, "norm + rotation")]
            assert row["bytes"] == 2 * (2 * 4 + 2 * 2) * 16 * itemsize  # q and k read and written once
            assert row["ratio_copy"] == by[("decode", dtype, "copy (x.clone)", "out-of-place")]["ms"] / row["ms"]
        assert by[("decode", dtype, bench_rows.NORM_EAGER, "norm + rotation")]["ratio_hf"] == 1.0
        for impl in (bench_rows.CACHE_COPY, bench_rows.CACHE_EAGER, bench_rows.CACHE_COMPILE, bench_rows.CACHE_OURS):
            row = by[("decode", dtype, impl, "into cache")]
            assert row["bytes"] == 2 * (2 * 2 + 2 * 2) * 16 * itemsize  # k and v read, written into the cache
        assert by[("decode", dtype, bench_rows.CACHE_COPY, "into cache")]["ratio_copy"] == 1.0
        assert by[("decode", dtype, bench_rows.CACHE_EAGER, "into cache")]["ratio_hf"] == 1.0
        assert ("decode", dtype, "transformers + torch.compile", "out-of-place") in by
    assert not any(r["shape"] == "prefill" and r["mode"] in ("norm + rotation", "into cache") for r in rows)

    rows = bench.run(quick=True, shapes=(decode,), dtypes=(torch.float32,), device="cpu", repeats=1, budget_s=0)
    assert not any("torch.compile" in r["impl"] for r in rows)  # --quick compiles nothing
    assert len(compiled) == 2 * 3 + 2


@pytest.mark.parametrize("wrong", ["hf_recipe", "rotate_then_copy"])
def test_a_peer_computing_something_else_is_refused_before_anything_is_timed(monkeypatch, wrong):
    if wrong == "hf_recipe":
        monkeypatch.setattr(bench, "hf_recipe", lambda q, k, cos, sin: (q.clone(), k.clone()))  # no rotation
        row = "transformers eager"
    else:
        monkeypatch.setattr(bench, "rotate_then_copy", lambda k, v, cos, sin, k_cache, v_cache, index:
                            bench_peers.copy_into_cache(k, v, k_cache, v_cache, index))  # keys left unrotated
        row = bench_rows.CACHE_EAGER
    monkeypatch.setattr(bench, "interleaved", lambda *args, **kwargs: pytest.fail("a row was timed"))
    with pytest.raises(RuntimeError, match=f"bench row '{row}' is off the float64 reference"):
        bench.run(shapes=(bench.Shape("decode", 2, 4, 2, 1, 16),), dtypes=(torch.bfloat16,), device="cpu", repeats=1,
                  compile_peer=False, budget_s=0)


# -- benchmarks/ipex_peer.py: its rows and checks, with a stand-in for IPEX (IPEX needs a torch of its own) ----


def load_ipex_peer():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "ipex_peer.py"
    spec = importlib.util.spec_from_file_location("ipex_peer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class StandInIpex:
    """IPEX's two entry points as it documents them ((b, s, h, d) q and k, full-width float32 tables)."""

    __version__ = "stand-in"

    def __init__(self, rotate_module=True):
        outer = self

        class RotaryEmbedding(torch.nn.Module):
            def __init__(self, max_positions, dim, base=10000, backbone=None):
                super().__init__()
                self.rope = ropekit.RotaryEmbedding(dim, base=base)

            def forward(self, x, position_ids, num_head, head_dim, offset, rotary_ndims):
                assert offset == head_dim // 2 == rotary_ndims // 2 and x.shape[-2:] == (num_head, head_dim)
                if not outer.rotate_module:
                    return x.clone()
                cos, sin = self.rope.cos_sin(position_ids)  # (b, s, d/2)
                return ropekit.apply_rotary(x, cos[:, :, None], sin[:, :, None])

        def rotary_embedding(query, key, sin, cos, rotary_dim, rotary_half):
            assert rotary_half and rotary_dim == query.shape[-1] == sin.shape[-1]
            half = sin.shape[-1] // 2
            return ropekit.apply_rotary_qk(query, key, cos[:, None, :half], sin[:, None, :half], inplace=True)

        self.rotate_module = rotate_module
        self.llm = type("llm", (), {"modules": type("modules", (), {"RotaryEmbedding": RotaryEmbedding}),
                                    "functional": type("functional", (), {"rotary_embedding": rotary_embedding})})


def test_ipex_peer_times_each_form_beside_ropekit_and_the_floors_after_checking_it():
    ipex_peer = load_ipex_peer()
    shapes = (bench.Shape("decode", 2, 4, 2, 1, 16), bench.Shape("prefill", 1, 2, 2, 8, 16))
    rows = ipex_peer.run(shapes, (torch.float32, torch.bfloat16), 1, 0.0, StandInIpex())
    assert len(rows) == 2 * 2 * len(ipex_peer.ROWS)
    assert [r["shape"] for r in rows[::len(ipex_peer.ROWS)]] == ["decode", "decode", "prefill", "prefill"]
    by = {(r["shape"], r["dtype"], r["impl"], r["mode"]): r for r in rows}
    for shape in ("decode", "prefill"):
        for dtype in ("float32", "bfloat16"):
            assert by[(shape, dtype, "IPEX llm.functional.rotary_embedding", "in-place")]["ratio_ipex"] == 1.0
            assert by[(shape, dtype, "IPEX llm.modules.RotaryEmbedding", "out-of-place")]["ratio_ipex"] == 1.0
            assert by[(shape, dtype, "copy (x.clone)", "out-of-place")]["ratio_copy"] == 1.0
            assert by[(shape, dtype, "ropekit RotaryEmbedding", "out-of-place")]["ms"] > 0

    with pytest.raises(RuntimeError, match="'IPEX llm.modules.RotaryEmbedding' is off the float64 reference"):
        ipex_peer.run(shapes[:1], (torch.float32,), 1, 0.0, StandInIpex(rotate_module=False))
    if importlib.util.find_spec("intel_extension_for_pytorch") is None:  # said in one line, exit 2
        assert ipex_peer.main(["--quick"]) == 2
