"""Warm and cold decode-step calls of the three prepared entry points (a standalone script, not a test).

A decode loop calls ``apply_rotary_qk``, ``rms_norm_rotary_qk`` and ``rotate_into_cache`` with
arguments of one signature on every step: after the first call each is *warm* (its prepared
kernel call is found, :mod:`ropekit.ops.prepared`). This script times warm calls, and cold ones
(every prepared call forgotten before each call, as in a fresh process), for q and k of shapes
``(1, 32, 1, 128)`` and ``(16, 32, 1, 128)``, float32 and bfloat16, in place and out of place
(the cache write: keys and values into a 64-slot cache at slot 5), one thread, no grad.

With ``--old-src DIR`` (the ``src`` directory of another tree) both trees run side by side:
each in its own worker process with its tree first on ``PYTHONPATH``, the driver asking them in
turn, cell by cell, their order swapped every round, so drift on a shared machine hits both
alike. Each round times a batch of calls per cell and tree; the table gives, per cell, the
median over rounds of µs per call with the spread (min-max), and the median of the per-round
ratios new/old (each round's two batches taken back to back). Usage::

    mkdir ../old && git archive <commit> src | tar -x -C ../old
    python benchmarks/warm_calls.py --old-src ../old/src [--rounds 15] [--calls 400] [--cold]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

SHAPES = ((1, 32, 1, 128), (16, 32, 1, 128))
DTYPES = ("float32", "bfloat16")
CALLS = (("apply_rotary_qk", "in place"), ("apply_rotary_qk", "out of place"), ("rms_norm_rotary_qk", "in place"),
         ("rms_norm_rotary_qk", "out of place"), ("rotate_into_cache", "cache write"))
CACHE_SLOTS = 64


def cells(cold: bool) -> list[tuple]:
    """Every ``(call, mode, dtype, shape, state)`` measured."""
    states = ("warm", "cold") if cold else ("warm",)
    return [(call, mode, dtype, shape, state) for state in states for call, mode in CALLS for dtype in DTYPES
            for shape in SHAPES]


# -- the worker: one process per tree -------------------------------------------------------------
def _calls_of(cell: tuple):
    """The zero-argument call a cell times, on inputs of its own."""
    import torch

    import ropekit

    call, mode, dtype, shape, _ = cell
    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    batch, heads, _, head_dim = shape
    q, k = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    cos, sin = ropekit.cos_sin(torch.arange(batch) * 37 + 100, ropekit.inv_frequencies(head_dim)[0])
    cos, sin = cos.reshape(batch, 1, 1, -1), sin.reshape(batch, 1, 1, -1)
    inplace = mode == "in place"
    if call == "apply_rotary_qk":
        return lambda: ropekit.apply_rotary_qk(q, k, cos, sin, inplace=inplace)
    if call == "rms_norm_rotary_qk":
        q_weight, k_weight = torch.ones(head_dim, dtype=dtype), torch.ones(head_dim, dtype=dtype)
        return lambda: ropekit.rms_norm_rotary_qk(q, k, q_weight, k_weight, cos, sin, eps=1e-6, inplace=inplace)
    k_cache = torch.zeros(batch, heads, CACHE_SLOTS, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    return lambda: ropekit.rotate_into_cache(k, q, cos, sin, k_cache, v_cache, 5)


def worker() -> None:
    """Answer ``index calls`` lines on stdin with the ns per call of that cell, one line each."""
    import time

    import torch

    from ropekit.ops import dispatch

    torch.set_num_threads(1)
    forget = dispatch._ON_REGISTER  # clears every prepared-call store of the tree (as ops.register does)
    todo = cells(cold=True)
    runs = {}
    for line in sys.stdin:
        index, calls = map(int, line.split())
        cell = todo[index]
        if index not in runs:
            runs[index] = _calls_of(cell)
        run = runs[index]
        with torch.no_grad():
            if cell[-1] == "warm":
                for _ in range(20):
                    run()
                start = time.perf_counter_ns()
                for _ in range(calls):
                    run()
            else:
                start = time.perf_counter_ns()
                for _ in range(calls):
                    for callback in forget:
                        callback()
                    run()
            elapsed = time.perf_counter_ns() - start
        print(elapsed / calls, flush=True)


# -- the driver --------------------------------------------------------------------------------
def start_worker(src: Path) -> subprocess.Popen:
    """A worker process importing ropekit from ``src``."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                        "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)


def ask(worker_process: subprocess.Popen, index: int, calls: int) -> float:
    """µs per call of cell ``index`` in ``worker_process``."""
    worker_process.stdin.write(f"{index} {calls}\n")
    worker_process.stdin.flush()
    answer = worker_process.stdout.readline()
    if not answer:
        raise RuntimeError("a worker ended early (its error is above)")
    return float(answer) / 1e3


def spread(values: list[float], digits: int = 1) -> str:
    """``median (min-max)``."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    """Measure, then print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-src", type=Path, help="src directory of a tree to compare with")
    parser.add_argument("--new-src", type=Path, default=Path(__file__).resolve().parents[1] / "src")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=400, help="calls per batch (cold: a quarter)")
    parser.add_argument("--cold", action="store_true", help="also time cold calls")
    parser.add_argument("--only", nargs="+", default=None, help="calls to time (default: all three)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker()
        return
    trees = {"new": args.new_src.resolve()} | ({"old": args.old_src.resolve()} if args.old_src else {})
    workers = {name: start_worker(src) for name, src in trees.items()}
    chosen = [(i, cell) for i, cell in enumerate(cells(cold=True)) if (args.cold or cell[-1] == "warm")
              and (args.only is None or cell[0] in args.only)]
    times: dict[int, dict[str, list[float]]] = {i: {name: [] for name in trees} for i, _ in chosen}
    for round_index in range(args.rounds):
        order = list(trees) if round_index % 2 == 0 else list(reversed(trees))
        for i, cell in chosen:
            calls = args.calls if cell[-1] == "warm" else max(1, args.calls // 4)
            for name in order:
                times[i][name].append(ask(workers[name], i, calls))
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    for process in workers.values():
        process.stdin.close()
        process.wait()
    names = list(trees)
    header = "| call | mode | dtype | shape | state | " + " | ".join(f"{n} µs" for n in names)
    print(header + (" | new/old |" if "old" in trees else " |"))
    print("|---|---|---|---|---|" + "---:|" * (len(names) + ("old" in trees)))
    for i, (call, mode, dtype, shape, state) in chosen:
        row = [call, mode, dtype, "x".join(map(str, shape)), state] + [spread(times[i][n]) for n in names]
        if "old" in trees:
            ratios = [new / old for new, old in zip(times[i]["new"], times[i]["old"], strict=True)]
            row.append(spread(ratios, 2))
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
