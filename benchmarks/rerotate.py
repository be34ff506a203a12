"""Moving cached keys: ``ropekit.rerotate_cache`` against its unfused compositions, timed side by side.

The step of a context shift (llama.cpp) or of StreamingLLM's sliding window: the keys after
``n_keep`` sinks and ``n_discard`` dropped tokens are re-rotated by ``-n_discard``. Every call of a
case runs once per repeat, interleaved (drift on a shared machine hits every row alike); the
ratios are computed from the medians of the same run, and the load average is printed before and
after. Two caches:

    contiguous  bfloat16 (4, 8, 4096, 128) (32 MiB), the keys of slots [n_keep + n_discard, 4096):
                rerotate_cache (one in-place pass over a view of the cache) against
                - "inverse then rotate": ropekit.rotate(inverse=True) at p, then ropekit.rotate at
                  p + delta, both in place on the same view (two passes, each looking its rows up);
                - "gather + rotate + scatter": the rows indexed out, rotated by delta, written back;
                - floor: view.mul_(1.0), one in-place pass over the same bytes.
    paged       bfloat16 (1024, 16, 8, 128) blocks (32 MiB), 4 sequences of 4096 positions through a
                shuffled block table, the same keys moved: rerotate_cache (gather, rotate, scatter
                by slot) against "gather, inverse at p, rotate at p + delta, scatter"; floor: the
                gather and the scatter alone (index_select / index_copy_ by slot, as rerotate_cache
                gathers).

Each row reports the median and the spread (interquartile range over the repeats, % of the
median). Usage::

    python benchmarks/rerotate.py [--repeats 15] [--threads 1] [--dtype bfloat16] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from cpu_floor import timings  # the sibling script: run as ``python benchmarks/rerotate.py``

import ropekit

N_KEEP, N_DISCARD = 4, 256


def spread_pct(times: list[float]) -> float:
    """Interquartile range as a percentage of the median."""
    q = statistics.quantiles(times, n=4)
    return 100.0 * (q[2] - q[0]) / statistics.median(times)


def measure(fns: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """``name -> (median seconds per call, spread %)``, the functions interleaved within every repeat."""
    times = timings(fns, repeats, 1, 3)
    return {name: (statistics.median(ts), spread_pct(ts)) for name, ts in times.items()}


def contiguous(dtype: torch.dtype, repeats: int) -> dict:
    """A (4, 8, 4096, 128) cache: rerotate_cache on a view against two passes, and against gather/scatter."""
    batch, heads, length, dim = 4, 8, 4096, 128
    cache = torch.randn(batch, heads, length, dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    cos_table, sin_table = ropekit.cos_sin(torch.arange(length), ropekit.inv_frequencies(dim)[0])
    first = N_KEEP + N_DISCARD
    positions = torch.arange(first, length)
    view = cache[:, :, first:]
    by_position = dict(cos_table=cos_table, sin_table=sin_table, tensor_format="bhsd", inplace=True)

    def inverse_then_rotate():
        ropekit.rotate(view, positions=positions, inverse=True, **by_position)
        ropekit.rotate(view, positions=positions - N_DISCARD, **by_position)

    def gather_rotate_scatter():
        rows = cache[:, :, positions]
        cos, sin = cos_table[N_DISCARD], -sin_table[N_DISCARD]
        cache[:, :, positions] = ropekit.apply_rotary(rows, cos, sin, inplace=True)

    t = measure({
        "floor: mul_ of the keys moved": lambda: view.mul_(1.0),
        "rerotate_cache": lambda: ropekit.rerotate_cache(cache, -N_DISCARD, cos_table=cos_table, sin_table=sin_table,
                                                         positions=positions),
        "inverse then rotate": inverse_then_rotate,
        "gather + rotate + scatter": gather_rotate_scatter,
    }, repeats)
    return _result(t, "rerotate_cache", ["inverse then rotate", "gather + rotate + scatter"],
                   "floor: mul_ of the keys moved")


def paged(dtype: torch.dtype, repeats: int) -> dict:
    """(1024, 16, 8, 128) blocks, 4 sequences of 4096 positions: rerotate_cache against the unfused round trip."""
    batch, length, block_size, heads, dim = 4, 4096, 16, 8, 128
    gen = torch.Generator().manual_seed(1)
    blocks = batch * length // block_size
    cache = torch.randn(blocks, block_size, heads, dim, generator=gen).to(dtype)
    block_table = torch.randperm(blocks, generator=gen).reshape(batch, length // block_size)
    cos_table, sin_table = ropekit.cos_sin(torch.arange(length), ropekit.inv_frequencies(dim)[0])
    positions = torch.arange(N_KEEP + N_DISCARD, length).expand(batch, -1)
    slots = ropekit.slot_mapping(block_table, positions, block_size)
    flat = cache.view(-1, heads, dim)  # rows by slot: the gather rerotate_cache itself uses
    p = positions.reshape(-1)

    def unfused():
        rows = flat.index_select(0, slots)  # (keys, heads, dim)
        ropekit.apply_rotary(rows, cos_table[p][:, None], sin_table[p][:, None], inplace=True, inverse=True)
        moved = p - N_DISCARD
        ropekit.apply_rotary(rows, cos_table[moved][:, None], sin_table[moved][:, None], inplace=True)
        flat.index_copy_(0, slots, rows)

    def gather_scatter():
        flat.index_copy_(0, slots, flat.index_select(0, slots))

    t = measure({
        "floor: gather + scatter": gather_scatter,
        "rerotate_cache": lambda: ropekit.rerotate_cache(cache, -N_DISCARD, cos_table=cos_table, sin_table=sin_table,
                                                         positions=positions, block_table=block_table),
        "gather, inverse, rotate, scatter": unfused,
    }, repeats)
    return _result(t, "rerotate_cache", ["gather, inverse, rotate, scatter"], "floor: gather + scatter")


def _result(t: dict, ours: str, compositions: list[str], floor: str) -> dict:
    return {"ms": {n: round(1e3 * v[0], 3) for n, v in t.items()},
            "spread_pct": {n: round(v[1], 1) for n, v in t.items()},
            "speedup_over": {n: round(t[n][0] / t[ours][0], 2) for n in compositions},
            "floor_over_ours": round(t[floor][0] / t[ours][0], 2)}


def main() -> None:
    """Run both caches at every thread count asked for; print a readable block (or one JSON object) per result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if "cpu" not in ropekit.ops.available():  # builds the kernel first if needed
        raise SystemExit("the CPU kernel is not available here")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, case in (("contiguous", contiguous), ("paged", paged)):
            load_before = os.getloadavg()[0]
            result = {"case": name, "dtype": args.dtype, "threads": threads, "repeats": args.repeats,
                      **case(dtype, args.repeats),
                      "load_avg_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                      "cores": os.cpu_count()}
            print(json.dumps(result) if args.json else json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
