"""How close the CPU rotary kernels come to the memory floor (a standalone script, not a test).

RoPE is memory-bound: the floor is reading q and k once and writing them once. Measured side by
side in one run, interleaved repeat by repeat (so drift on a shared machine hits every row alike):

    floor, in place      x.mul_(1.0)           one read + one write of x, no allocation
    floor, out of place  x.clone()             allocate + one read + one write
    eager / native       ropekit.backends.torch_eager.rotate / cpu_native.rotate

Each timing is one op applied to q and then to k; the table reports medians and the ratio
``floor_time / our_time`` (1.0 = as fast as the floor; targets: >= 0.9 for float32, >= 0.8 for
bfloat16). Usage::

    python benchmarks/cpu_floor.py [--repeats 50] [--threads 1 2] [--shapes prefill decode]
        [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ropekit
from ropekit.backends import cpu_native, torch_eager

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

    def both(f):
        return lambda: (f(q), f(k))

    def eager(inplace):
        return both(lambda x: torch_eager.rotate(x, cos, sin, layout="half", inplace=inplace))

    def native(inplace):
        return both(lambda x: cpu_native.rotate(x, cos, sin, layout="half", inplace=inplace))

    return {
        "mul_(1.0)": both(lambda x: x.mul_(1.0)),
        "clone()": both(lambda x: x.clone()),
        "eager inplace": eager(True),
        "eager out": eager(False),
        "native inplace": native(True),
        "native out": native(False),
    }


def measure(fns: dict, repeats: int, warmup: int = 5) -> dict[str, float]:
    """Median seconds per call of each fn, the fns interleaved within every repeat."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    """Print one table row per (shape, dtype, threads)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    args = parser.parse_args()
    if not cpu_native.is_available():
        raise SystemExit("the native CPU backend is not available here")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads by default, "
          f"repeats={args.repeats}; times are medians for q and k together; ratio = floor / ours")
    header = (f"{'shape':8} {'dtype':9} {'thr':>3} | {'mul_':>8} {'clone':>8} | {'eager ip':>8} {'eager oop':>9} | "
              f"{'nat ip':>8} {'nat oop':>8} | {'ip ratio':>8} {'oop ratio':>9} | {'eager ip/oop ratio':>18}")
    print(header)
    print("-" * len(header))
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        for dtype in (getattr(torch, name) for name in args.dtypes):
            q, k, cos, sin = make_inputs(shape, dtype)
            for threads in args.threads:
                torch.set_num_threads(threads)
                t = measure(ops(q, k, cos, sin), args.repeats)
                ms = {name: 1e3 * v for name, v in t.items()}
                print(
                    f"{shape_name:8} {str(dtype)[6:]:9} {threads:>3} | {ms['mul_(1.0)']:8.3f} {ms['clone()']:8.3f} | "
                    f"{ms['eager inplace']:8.3f} {ms['eager out']:9.3f} | "
                    f"{ms['native inplace']:8.3f} {ms['native out']:8.3f} | "
                    f"{t['mul_(1.0)'] / t['native inplace']:8.2f} {t['clone()'] / t['native out']:9.2f} | "
                    f"{t['mul_(1.0)'] / t['eager inplace']:8.2f} {t['clone()'] / t['eager out']:9.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
