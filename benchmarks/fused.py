"""The fused forms against what they replace, timed side by side (a standalone script, not a test).

Three measurements, each interleaved repeat by repeat (drift on a shared machine hits every row
alike), at every thread count asked for; ratios are computed from the medians of the same run:

    prefill  q, k (1, 32, 4096, 128): ropekit.rms_norm_rotary_qk (out of place, in place) against
             F.rms_norm of q and k then ropekit.apply_rotary_qk (the unfused composition), and
             against the floors x.clone() (out of place) and x.mul_(1.0) (in place) of q and k;
             also out of place with the kernel's populating of fresh outputs turned off (their
             pages then fault in one by one, as clone's do)
    decode   k, v (16, 32, 1, 128) into caches (16, 32, 1024, 128): ropekit.rotate_into_cache
             against ropekit.apply_rotary then two slice copies into the caches (rotate-then-copy),
             every call at the next slot as decoding writes them (and, apart, always the same
             slot); timed 200 calls at a time
    fp8      k, v into float8_e4m3fn caches with per-head scales: ropekit.rotate_into_cache against
             ropekit.apply_rotary, a division by the scale, a clamp, .to(float8_e4m3fn) and
             index_copy_ (of k and of v), at a decode shape (16, 8, 1, 128) (caches (16, 8, 1024,
             128), the next slot every call; timed 50 calls at a time) and a prefill shape (1, 8,
             2048, 128) (caches (1, 8, 4096, 128)), float32 and bfloat16 inputs: all eight calls
             interleaved in the same rounds; medians with their min-max over the rounds
    model    greedy decoding of a tiny random Qwen3 (4 layers, hidden 256, 8 heads, 4 kv heads,
             head_dim 64): tokens/s unpatched, patched (transformers' default cache), patched with
             ropekit's static cache, and unpatched with transformers' StaticCache

Each row reports the median and the spread (interquartile range over the repeats, % of the
median). Usage::

    python benchmarks/fused.py [--repeats 30] [--threads 1 2] [--parts prefill decode fp8 model]
        [--dtype bfloat16] [--json]

(``fp8`` times float32 and bfloat16 inputs in one run, whatever ``--dtype`` says.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics

import torch
import torch.nn.functional as F
from cpu_floor import timings  # the sibling script: run as ``python benchmarks/fused.py``

import ropekit


def spread_pct(times: list[float]) -> float:
    """Interquartile range as a percentage of the median."""
    q = statistics.quantiles(times, n=4)
    return 100.0 * (q[2] - q[0]) / statistics.median(times)


def measure(fns: dict, repeats: int, calls: int = 1, warmup: int = 3) -> dict[str, tuple[float, float]]:
    """``name -> (median seconds per call, spread %)``, the functions interleaved within every repeat."""
    times = timings(fns, repeats, calls, warmup)
    return {name: (statistics.median(ts), spread_pct(ts)) for name, ts in times.items()}


def prefill(dtype: torch.dtype, repeats: int) -> dict:
    """q, k ``(1, 32, 4096, 128)``: fused RMSNorm + rotation against the unfused pair and the copy floors."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 4096, 128, generator=gen).to(dtype)
    k = torch.randn(1, 32, 4096, 128, generator=gen).to(dtype)
    wq = (torch.randn(128, generator=gen) * 0.2 + 1).to(dtype)
    wk = (torch.randn(128, generator=gen) * 0.2 + 1).to(dtype)
    inv_freq, _ = ropekit.inv_frequencies(128, base=1e6)
    cos, sin = ropekit.cos_sin(torch.arange(4096), inv_freq)
    cos, sin = cos[None, None], sin[None, None]
    hooks = ropekit.ops.get("cpu").operators()

    def pages_faulted_in():  # the fused call with its fresh output's pages faulted in one by one
        old = hooks.set_populate_bytes(2**62)
        try:
            return ropekit.rms_norm_rotary_qk(q, k, wq, wk, cos, sin, eps=1e-6)
        finally:
            hooks.set_populate_bytes(old)

    t = measure({
        "clone": lambda: (q.clone(), k.clone()),
        "mul_": lambda: (q.mul_(1.0), k.mul_(1.0)),
        "unfused": lambda: ropekit.apply_rotary_qk(F.rms_norm(q, (128,), wq, 1e-6), F.rms_norm(k, (128,), wk, 1e-6),
                                                   cos, sin),
        "fused": lambda: ropekit.rms_norm_rotary_qk(q, k, wq, wk, cos, sin, eps=1e-6),
        "fused, pages faulted in": pages_faulted_in,
        "fused in place": lambda: ropekit.rms_norm_rotary_qk(q, k, wq, wk, cos, sin, eps=1e-6, inplace=True),
    }, repeats)
    return {"ms": {n: 1e3 * v[0] for n, v in t.items()}, "spread_pct": {n: v[1] for n, v in t.items()},
            "fused_speedup_over_unfused": t["unfused"][0] / t["fused"][0],
            "fused_vs_clone": t["clone"][0] / t["fused"][0],
            "fused_pages_faulted_in_vs_clone": t["clone"][0] / t["fused, pages faulted in"][0],
            "fused_in_place_vs_mul_": t["mul_"][0] / t["fused in place"][0]}


def decode(dtype: torch.dtype, repeats: int) -> dict:
    """k, v ``(16, 32, 1, 128)`` into ``(16, 32, 1024, 128)`` caches: rotate-into-cache against rotate-then-copy.

    As decoding does, every call writes the next slot with its own position's tables (slots 0, 1,
    ..., 1023, then 0 again: each form keeps its own count), so the cache lines written are
    seldom in a CPU cache. The same slot every call (lines that stay cached, which flatters the
    ordinary stores of rotate-then-copy) is timed too.
    """
    gen = torch.Generator().manual_seed(1)
    batch, heads, length, dim, fixed = 16, 32, 1024, 128, 700
    k = torch.randn(batch, heads, 1, dim, generator=gen).to(dtype)
    v = torch.randn(batch, heads, 1, dim, generator=gen).to(dtype)
    k_cache, v_cache = torch.zeros(batch, heads, length, dim, dtype=dtype), torch.zeros(batch, heads, length, dim,
                                                                                         dtype=dtype)
    inv_freq, _ = ropekit.inv_frequencies(dim)
    cos, sin = ropekit.cos_sin(torch.arange(length), inv_freq)  # (length, half): row p for position p
    steps = [(p, cos[p:p + 1], sin[p:p + 1], torch.full((batch,), p)) for p in range(length)]

    def counter():
        return itertools.cycle(steps).__next__

    def rotate_then_copy(step):
        def run():
            p, c, s, _ = step()
            k_cache[:, :, p:p + 1] = ropekit.apply_rotary(k, c, s)
            v_cache[:, :, p:p + 1] = v
        return run

    def into(step, per_row=False):
        def run():
            p, c, s, starts = step()
            ropekit.rotate_into_cache(k, v, c, s, k_cache, v_cache, starts if per_row else p)
        return run

    def same_slot():
        return lambda: steps[fixed]

    t = measure({
        "rotate then copy": rotate_then_copy(counter()),
        "rotate into cache": into(counter()),
        "rotate into cache, per-row slots": into(counter(), per_row=True),
        "same slot: rotate then copy": rotate_then_copy(same_slot()),
        "same slot: rotate into cache": into(same_slot()),
    }, repeats, calls=200)
    return {"us": {n: 1e6 * v[0] for n, v in t.items()}, "spread_pct": {n: v[1] for n, v in t.items()},
            "speedup": t["rotate then copy"][0] / t["rotate into cache"][0],
            "speedup_per_row_slots": t["rotate then copy"][0] / t["rotate into cache, per-row slots"][0],
            "speedup_same_slot": t["same slot: rotate then copy"][0] / t["same slot: rotate into cache"][0]}


def fp8_calls(shape: tuple, length: int, dtype: torch.dtype, calls: int, gen: torch.Generator):
    """``(unfused, fused)``: each writes k, v of ``shape`` into its own float8_e4m3fn caches ``calls`` times."""
    batch, heads, seq, dim = shape
    k = torch.randn(*shape, generator=gen).to(dtype)
    v = torch.randn(*shape, generator=gen).to(dtype)
    k_scale = torch.rand(heads, generator=gen) * 0.02 + 0.01  # per head, float32 (vLLM's k_scale, v_scale)
    v_scale = torch.rand(heads, generator=gen) * 0.02 + 0.01
    limit = torch.finfo(torch.float8_e4m3fn).max
    inv_freq, _ = ropekit.inv_frequencies(dim)
    cos, sin = ropekit.cos_sin(torch.arange(length), inv_freq)
    steps = [(p, cos[p:p + seq], sin[p:p + seq], torch.arange(p, p + seq)) for p in range(0, length, seq)]

    def caches():
        return [torch.zeros(batch, heads, length, dim, dtype=torch.float8_e4m3fn) for _ in range(2)]

    def unfused(k_cache, v_cache, step):
        ks, vs = k_scale.view(1, -1, 1, 1), v_scale.view(1, -1, 1, 1)
        k_bytes, v_bytes = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        for _ in range(calls):
            _, c, s, index = step()
            kq = (ropekit.apply_rotary(k, c, s) / ks).clamp(-limit, limit).to(torch.float8_e4m3fn)
            vq = (v / vs).clamp(-limit, limit).to(torch.float8_e4m3fn)
            k_bytes.index_copy_(2, index, kq.view(torch.uint8))
            v_bytes.index_copy_(2, index, vq.view(torch.uint8))

    def fused(k_cache, v_cache, step):
        for _ in range(calls):
            p, c, s, _ = step()
            ropekit.rotate_into_cache(k, v, c, s, k_cache, v_cache, p, k_scale=k_scale, v_scale=v_scale)

    unfused_args = (*caches(), itertools.cycle(steps).__next__)  # each form its own caches and slot count
    fused_args = (*caches(), itertools.cycle(steps).__next__)
    return lambda: unfused(*unfused_args), lambda: fused(*fused_args)


def fp8(dtype: torch.dtype, repeats: int) -> dict:
    """k, v into float8_e4m3fn caches with per-head scales: rotate_into_cache against the unfused composition.

    The composition a user writes without the fused form: rotate k with ropekit (in k's dtype),
    divide by the per-head scale, clamp to +-448, convert to float8_e4m3fn, ``index_copy_`` into the
    cache (through uint8 views: torch has no FP8 ``index_copy_`` on the CPU); v the same without the
    rotation. Decode writes the next slot every call (as ``decode`` does); prefill writes positions
    0..2047 of each row, then 2048..4095. Both dtypes and shapes run in the same interleaved rounds
    (``dtype`` is not used).
    """
    del dtype
    gen = torch.Generator().manual_seed(3)
    cases = {"decode": ((16, 8, 1, 128), 1024, 50), "prefill": ((1, 8, 2048, 128), 4096, 1)}  # shape, length, calls
    fns, load = {}, [os.getloadavg()[0]]
    for (name, (shape, length, calls)), dtype in itertools.product(cases.items(), (torch.float32, torch.bfloat16)):
        label = f"{name} {str(dtype).removeprefix('torch.')}"
        fns[f"{label}: unfused"], fns[f"{label}: rotate_into_cache"] = fp8_calls(shape, length, dtype, calls, gen)
    times = timings(fns, repeats, 1, 3)
    load.append(os.getloadavg()[0])
    rows = []
    for label in dict.fromkeys(n.split(": ")[0] for n in fns):
        calls = cases[label.split()[0]][2]
        row = {"case": label}
        for form in ("unfused", "rotate_into_cache"):
            us = [1e6 * t / calls for t in times[f"{label}: {form}"]]
            row[form] = {"us": statistics.median(us), "min": min(us), "max": max(us)}
        row["speedup"] = row["unfused"]["us"] / row["rotate_into_cache"]["us"]
        rows.append(row)
    return {"rows": rows, "torch": torch.__version__, "load_average_1min": load}


def tiny_qwen3(dtype: torch.dtype):
    """A random 4-layer Qwen3 (q/k norms) small enough that RoPE and the norms are a visible share of a step."""
    import transformers

    config = transformers.Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                      max_position_embeddings=1024, pad_token_id=0, eos_token_id=None)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config).eval().to(dtype)


def model(dtype: torch.dtype, repeats: int) -> dict:
    """Greedy decoding tokens/s of the tiny Qwen3, patched and not, with each cache."""
    from transformers.cache_utils import StaticCache

    from ropekit.integrations.transformers import patch, static_cache, unpatch

    lm = tiny_qwen3(dtype)
    prompt = torch.randint(1, 512, (1, 16), generator=torch.Generator().manual_seed(2))
    new = 64
    generate = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(prompt))

    def run(cache_factory=None):
        with torch.no_grad():
            lm.generate(prompt, past_key_values=cache_factory() if cache_factory else None, **generate)

    def unpatched():
        run()

    def unpatched_static():
        run(lambda: StaticCache(config=lm.config, max_cache_len=prompt.shape[1] + new))

    def patched():
        patch(lm)
        try:
            run()
        finally:
            unpatch(lm)

    def patched_static():
        patch(lm)
        try:
            run(lambda: static_cache(lm, prompt.shape[1] + new))
        finally:
            unpatch(lm)

    t = measure({"unpatched": unpatched, "patched": patched, "unpatched, StaticCache": unpatched_static,
                 "patched, ropekit static cache": patched_static}, repeats, warmup=1)
    return {"tokens_per_s": {n: new / v[0] for n, v in t.items()}, "spread_pct": {n: v[1] for n, v in t.items()},
            "patched_vs_unpatched": t["unpatched"][0] / t["patched"][0],
            "patched_static_vs_unpatched_static": (t["unpatched, StaticCache"][0]
                                                   / t["patched, ropekit static cache"][0])}


def main() -> None:
    """Run the parts asked for at every thread count; print one JSON object (or a readable block) per result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--parts", nargs="+", choices=["prefill", "decode", "fp8", "model"],
                        default=["prefill", "decode", "model"])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if "cpu" not in ropekit.ops.available():  # builds the kernel first if needed
        raise SystemExit("the CPU kernel is not available here")
    parts = {"prefill": prefill, "decode": decode, "fp8": fp8, "model": model}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for part in args.parts:
            repeats = max(5, args.repeats // 3) if part == "model" else args.repeats
            result = {"part": part, "dtype": args.dtype, "threads": threads, **parts[part](dtype, repeats)}
            if args.json:
                print(json.dumps(result), flush=True)
            else:
                print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
