"""The MLA cache write against its unfused composition, timed side by side (a standalone script, not a test).

DeepSeek-V3's dimensions: the compressed kv ``kv_c`` has kv_lora_rank = 512 channels, the shared
key ``k_pe`` qk_rope_head_dim = 64 (interleaved pairs). Per case, three forms write the same
tokens into the same caches, interleaved repeat by repeat (drift on a shared machine hits every
row alike); ratios are computed from the medians of the same run:

    fused     ropekit.mla.rotate_into_mla_cache(kv_c, k_pe, cos, sin, kv_cache, pe_cache, slots, ...)
    unfused   k_rot = ropekit.apply_rotary(k_pe, cos, sin) (reordered by ropekit.convert_layout for
              the half-order cache), then kv_c and k_rot copied into their slots: slice assignments
              (contiguous) or index_copy_ into the caches viewed as rows (paged)
    copy      kv_c and k_pe copied into their slots, no rotation (the floor of the bytes moved)

Cases (every call at the next slot, as decoding writes them; positions cycle through the caches):

    decode contiguous  16 sequences x 1 token into (16, 1024, C) caches, one start for every row
    decode paged       16 tokens into (1024 blocks, 16 rows, C) caches by a slot mapping
    prefill contiguous 1 sequence x 2048 tokens into (1, 4096, C) caches
    prefill paged      2048 tokens into (256 blocks, 16 rows, C) caches

each with the key cached as given (interleaved, vLLM's way) and de-interleaved (transformers'
order). Each row reports the median and the spread (interquartile range over the repeats, % of
the median), and the load average before and after. Usage::

    python benchmarks/mla.py [--repeats 30] [--threads 1] [--dtype bfloat16] [--cases ...] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics

import torch
from cpu_floor import timings  # the sibling script: run as ``python benchmarks/mla.py``

import ropekit
from ropekit import mla

RANK, ROPE = 512, 64
CASES = ("decode contiguous", "decode paged", "prefill contiguous", "prefill paged")


def spread_pct(times: list[float]) -> float:
    """Interquartile range as a percentage of the median."""
    q = statistics.quantiles(times, n=4)
    return 100.0 * (q[2] - q[0]) / statistics.median(times)


def steps(case: str, dtype: torch.dtype):
    """``(caches factory, list of (kv_c, k_pe, cos, sin, slots, block_size))`` for one case."""
    gen = torch.Generator().manual_seed(0)
    decode, paged = case.startswith("decode"), case.endswith("paged")
    batch, seq = (16, 1) if decode else (1, 2048)
    length = 1024 if decode else 4096
    tokens = batch * seq
    kv_c = torch.randn(batch, seq, RANK, generator=gen).to(dtype)
    k_pe = torch.randn(batch, seq, ROPE, generator=gen).to(dtype)
    inv_freq, _ = ropekit.inv_frequencies(ROPE)
    cos_table, sin_table = ropekit.cos_sin(torch.arange(length), inv_freq)
    block_size = 16
    blocks_per_sequence = length // block_size
    block_table = torch.randperm(batch * blocks_per_sequence, generator=gen).view(batch, blocks_per_sequence)
    out = []
    for first in range(0, length - seq + 1, seq):
        positions = torch.arange(first, first + seq)
        cos, sin = cos_table[positions], sin_table[positions]  # (seq, ROPE // 2)
        if paged:
            slots = ropekit.slot_mapping(block_table, positions.expand(batch, seq), block_size)
            cos_t, sin_t = cos.repeat(batch, 1), sin.repeat(batch, 1)  # (tokens, ROPE // 2)
            out.append((kv_c.view(tokens, RANK), k_pe.view(tokens, ROPE), cos_t, sin_t, slots, block_size))
        else:
            out.append((kv_c, k_pe, cos, sin, first, None))

    def caches():
        shape = (batch * blocks_per_sequence, block_size) if paged else (batch, length)
        return torch.zeros(*shape, RANK, dtype=dtype), torch.zeros(*shape, ROPE, dtype=dtype)

    return caches, out


def forms(case: str, dtype: torch.dtype, output_layout: str | None) -> dict:
    """The three forms of one case, each with its own caches and its own count of steps."""
    caches, all_steps = steps(case, dtype)
    paged = case.endswith("paged")

    def fused():
        kv_cache, pe_cache = caches()
        step = itertools.cycle(all_steps).__next__

        def run():
            kv_c, k_pe, cos, sin, slots, block_size = step()
            mla.rotate_into_mla_cache(kv_c, k_pe, cos, sin, kv_cache, pe_cache, slots, layout="interleaved",
                                      output_layout=output_layout, block_size=block_size)
        return run

    def unfused(rotate=True):
        kv_cache, pe_cache = caches()
        kv_rows, pe_rows = kv_cache.view(-1, RANK), pe_cache.view(-1, ROPE)
        step = itertools.cycle(all_steps).__next__

        def run():
            kv_c, k_pe, cos, sin, slots, _ = step()
            k_rot = k_pe
            if rotate:
                k_rot = ropekit.apply_rotary(k_pe, cos, sin, layout="interleaved")
                if output_layout == "half":
                    k_rot = ropekit.convert_layout(k_rot, src="interleaved", dst="half")
            if paged:
                kv_rows.index_copy_(0, slots, kv_c)
                pe_rows.index_copy_(0, slots, k_rot)
            else:
                seq = k_pe.shape[1]
                kv_cache[:, slots:slots + seq] = kv_c
                pe_cache[:, slots:slots + seq] = k_rot
        return run

    return {"fused": fused(), "unfused": unfused(), "copy": unfused(rotate=False)}


def measure(case: str, dtype: torch.dtype, output_layout: str | None, repeats: int) -> dict:
    """One result row: medians (microseconds per call), spreads and the ratios of one case."""
    calls = 200 if case.startswith("decode") else 20  # windows of 20-100 ms: preemption on a busy machine averages out
    times = timings(forms(case, dtype, output_layout), repeats, calls)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {"case": case, "cache order": output_layout or "interleaved", "dtype": str(dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(), "us": {n: round(1e6 * v, 2) for n, v in med.items()},
            "spread_pct": {n: round(spread_pct(ts), 1) for n, ts in times.items()},
            "unfused_over_fused": round(med["unfused"] / med["fused"], 3),
            "copy_over_fused": round(med["copy"] / med["fused"], 3)}


def main() -> None:
    """Run every case asked for at every thread count; print one line (or JSON object) per result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"# torch {torch.__version__}, backends {ropekit.ops.available()}, load average {os.getloadavg()}")
    for threads, case, order in itertools.product(args.threads, args.cases, (None, "half")):
        torch.set_num_threads(threads)
        row = measure(case, dtype, order, args.repeats)
        if args.json:
            print(json.dumps(row))
            continue
        us, spread = row["us"], row["spread_pct"]
        print(f"{case:19} {row['cache order']:11} {threads} thr | fused {us['fused']:9.1f} us "
              f"({spread['fused']:4.1f}%) unfused {us['unfused']:9.1f} ({spread['unfused']:4.1f}%) "
              f"copy {us['copy']:9.1f} ({spread['copy']:4.1f}%) | unfused/fused {row['unfused_over_fused']:.2f} "
              f"copy/fused {row['copy_over_fused']:.2f}")
    print(f"# load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
