"""How close the CPU rotary kernel comes to the memory floor (a standalone script, not a test).

RoPE is memory-bound: the floor is reading q and k once and writing them once. Measured side by
side in one run, interleaved repeat by repeat (so drift on a shared machine hits every row alike):

    floor, in place      x.mul_(1.0) on q and k        one read + one write, no allocation
    floor, out of place  x.clone() of q and k          allocate + one read + one write
    16-bit: round trip   q, k -> float32 -> q, k       torch's conversion into preallocated tensors
    ropekit              ropekit.apply_rotary_qk        q and k in one call (the public entry
                                                        point: checks, then the native kernel)

The table reports medians and ``floor_time / our_time`` (1.0 = as fast as the floor; targets:
>= 0.9 for float32, >= 0.8 for bfloat16). For 16-bit dtypes the kernel converts every element
to float32 and back (AVX2 has no 16-bit arithmetic); the round-trip column is that conversion
alone, done by torch. Small shapes (decode) are timed as batches of calls. Usage::

    python benchmarks/cpu_floor.py [--repeats 50] [--threads 1 2] [--shapes prefill decode]
        [--dtypes float32 bfloat16] [--json]

``--json`` prints one JSON object per row instead of the table (``benchmarks/compare_trees.py``
runs this script on two source trees and compares them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import ropekit

SHAPES = {"prefill": (1, 32, 4096, 128), "decode": (16, 32, 1, 128)}


def make_inputs(shape: tuple[int, ...], dtype: torch.dtype):
    """q, k of ``shape`` (batch, heads, seq, head_dim) and cos/sin tables expanded to 4 dims."""
    batch, _, seq, head_dim = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(shape, generator=gen).to(dtype)
    k = torch.randn(shape, generator=gen).to(dtype)
    inv_freq, _ = ropekit.inv_frequencies(head_dim)
    if seq == 1:  # decode: every sequence of the batch at its own position
        positions = torch.arange(batch) * 37 + 100
        cos, sin = ropekit.cos_sin(positions, inv_freq)
        cos, sin = cos.reshape(batch, 1, 1, -1), sin.reshape(batch, 1, 1, -1)
    else:
        cos, sin = ropekit.cos_sin(torch.arange(seq), inv_freq)
        cos, sin = cos.reshape(1, 1, seq, -1), sin.reshape(1, 1, seq, -1)
    return q, k, cos, sin


def ops(q, k, cos, sin):
    """Name -> callable doing the op on q and on k."""
    fns = {
        "mul_(1.0)": lambda: (q.mul_(1.0), k.mul_(1.0)),
        "clone()": lambda: (q.clone(), k.clone()),
        "ropekit inplace": lambda: ropekit.apply_rotary_qk(q, k, cos, sin, inplace=True),
        "ropekit out": lambda: ropekit.apply_rotary_qk(q, k, cos, sin),
    }
    if q.element_size() == 2:
        wide_q, wide_k, back_q, back_k = torch.empty(q.shape), torch.empty(k.shape), q.clone(), k.clone()
        fns["round trip"] = lambda: (wide_q.copy_(q), back_q.copy_(wide_q), wide_k.copy_(k), back_k.copy_(wide_k))
    return fns


def measure(fns: dict, repeats: int, calls: int = 1, warmup: int = 5) -> dict[str, float]:
    """Median seconds per call of each fn (timed ``calls`` at a time), interleaved within every repeat."""
    return {name: statistics.median(ts) for name, ts in timings(fns, repeats, calls, warmup).items()}


def timings(fns: dict, repeats: int, calls: int = 1, warmup: int = 5) -> dict[str, list[float]]:
    """Seconds per call of each fn in every repeat (timed ``calls`` at a time), the fns interleaved."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls)
    return times


def main() -> None:
    """Print one table row per (shape, dtype, threads)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    args = parser.parse_args()
    if "cpu" not in ropekit.ops.available():  # builds the kernel first if needed
        raise SystemExit("the CPU kernel is not available here")
    if not args.json:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads by default, "
              f"repeats={args.repeats}; times are medians for q and k together; ratio = floor / ours")
    header = (f"{'shape':8} {'dtype':9} {'thr':>3} | {'mul_':>8} {'clone':>8} {'f32 trip':>8} | "
              f"{'in place':>8} {'out':>8} | {'in ratio':>8} {'out ratio':>9} {'out/trip':>8}")
    if not args.json:
        print(header)
        print("-" * len(header))
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        calls = 1 if shape[2] > 1 else 200  # decode steps take microseconds: time them in batches
        for dtype in (getattr(torch, name) for name in args.dtypes):
            q, k, cos, sin = make_inputs(shape, dtype)
            for threads in args.threads:
                torch.set_num_threads(threads)
                t = measure(ops(q, k, cos, sin), args.repeats, calls)
                ms = {name: 1e3 * v for name, v in t.items()}
                if args.json:
                    print(json.dumps({"shape": shape_name, "dtype": str(dtype)[6:], "threads": threads, "ms": ms,
                                      "in_ratio": t["mul_(1.0)"] / t["ropekit inplace"],
                                      "out_ratio": t["clone()"] / t["ropekit out"]}), flush=True)
                    continue
                trip = f"{ms['round trip']:8.3f}" if "round trip" in t else f"{'':8}"
                trip_ratio = f"{t['round trip'] / t['ropekit out']:8.2f}" if "round trip" in t else ""
                print(
                    f"{shape_name:8} {str(dtype)[6:]:9} {threads:>3} | {ms['mul_(1.0)']:8.3f} {ms['clone()']:8.3f} "
                    f"{trip} | {ms['ropekit inplace']:8.3f} {ms['ropekit out']:8.3f} | "
                    f"{t['mul_(1.0)'] / t['ropekit inplace']:8.2f} {t['clone()'] / t['ropekit out']:9.2f} {trip_ratio}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
