"""A decode step by ``RotaryEmbedding``, ``apply_rotary_qk``, transformers and the copy floors (a standalone script).

One command, one thread, no grad, everything interleaved round by round (drift on a shared
machine hits every contender alike; the order of the contenders turns every round):

    step     q and k of ``(1, 32, 1, 128)`` and ``(16, 32, 1, 128)``, float32 and bfloat16, at position
             1000 (a decode step after 1000 tokens):
             - module: ``rope(q, k, offset=1000)``, a ``ropekit.RotaryEmbedding(128)`` called as a module,
               and ``rope.forward(q, k, offset=1000)`` (the same without ``nn.Module.__call__``);
             - function: ``ropekit.apply_rotary_qk(q, k, cos, sin)`` with the row of the tables the
               module uses (``cos_table[1000:1001]``);
             - transformers: ``LlamaRotaryEmbedding(x, position_ids)`` then ``apply_rotary_pos_emb``;
             - clone: ``q.clone(), k.clone()`` (the out-of-place floor: the same allocation and bytes);
             - in place: the module and the function with ``inplace=True``, and their floor
               ``q.mul_(1.0), k.mul_(1.0)``.
             Each round times 5 batches of ``--calls`` calls of each, the contenders taking turns, and
             keeps each one's fastest batch (another job on the core slows some batches, never speeds
             one); a cell is the median over rounds of µs per call, a ratio the median of the
             per-round ratios with their spread (min-max).
    cache    greedy decoding of a tiny random Qwen3 (q/k norms) and Llama patched by
             ``ropekit.integrations.transformers.patch``, 64 tokens after a 16-token prompt: tokens/s
             with transformers' default ``DynamicCache`` and with
             ``ropekit.integrations.transformers.static_cache``, the two alternating run by run (the
             fastest of 3 runs of each per round); the table says whether both decoded the same
             tokens (greedy decoding of a random model: a different rounding in attention can flip a
             near tie in bfloat16).

The machine's load (``os.getloadavg()``) is printed before and after. ``--clock cpu`` times
both parts by this thread's CPU time instead of wall time: every call runs on this one thread,
so on a machine shared with other jobs it leaves out the time the thread waited for a core (not
the caches and memory bus the others share). Usage::

    python benchmarks/module_decode.py [--rounds 21] [--calls 200] [--parts step cache] [--clock wall|cpu] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

import ropekit

SHAPES = ((1, 32, 1, 128), (16, 32, 1, 128))
DTYPES = ("float32", "bfloat16")
POSITION = 1000
RATIOS = {  # name -> (numerator, denominator)
    "module / function": ("module", "function"),
    "forward / function": ("module.forward", "function"),
    "module / transformers": ("module", "transformers"),
    "function / clone": ("function", "clone"),
    "module / clone": ("module", "clone"),
    "function in place / mul_": ("function in place", "mul_"),
    "module in place / mul_": ("module in place", "mul_"),
}


CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}
clock = CLOCKS["wall"]  # --clock sets it


def interleaved(fns: dict[str, Callable[[], object]], rounds: int, calls: int, repeats: int = 5,
                warmup: int = 50) -> dict:
    """``name -> [seconds per call in each round]``, every fn timed in every round, in a turning order.

    A round times ``repeats`` batches of ``calls`` calls of each fn, the fns taking turns batch by
    batch, and keeps each fn's fastest batch: a batch during which another job held the core says
    nothing about the code, and the fastest of a few taken side by side is each fn's cost under the
    same conditions.
    """
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        best = dict.fromkeys(names, float("inf"))
        for repeat in range(repeats):
            turn = (r + repeat) % len(names)
            for name in names[turn:] + names[:turn]:
                fn = fns[name]
                start = clock()
                for _ in range(calls):
                    fn()
                best[name] = min(best[name], (clock() - start) / calls / 1e9)
        for name in names:
            times[name].append(best[name])
    return times


def summary(values: list[float]) -> dict:
    """Median, min and max of ``values``."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def step_contenders(shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """Every contender of one decode step, on inputs of its own (in-place ones on their own copies)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    batch, heads, _, head_dim = shape
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    q_in, k_in, q_mul, k_mul = q.clone(), k.clone(), q.clone(), k.clone()
    q_mod, k_mod = q.clone(), k.clone()
    rope = ropekit.RotaryEmbedding(head_dim)
    cos_table, sin_table = rope.tables(POSITION + 1)
    cos, sin = cos_table[POSITION:POSITION + 1], sin_table[POSITION:POSITION + 1]  # the row the module uses
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, head_dim=head_dim,
                         max_position_embeddings=4096)
    hf_rope = LlamaRotaryEmbedding(config)
    position_ids = torch.full((batch, 1), POSITION)

    def transformers_step():
        hf_cos, hf_sin = hf_rope(q, position_ids)
        return apply_rotary_pos_emb(q, k, hf_cos, hf_sin)

    return {
        "module": lambda: rope(q, k, offset=POSITION),
        "module.forward": lambda: rope.forward(q, k, offset=POSITION),
        "function": lambda: ropekit.apply_rotary_qk(q, k, cos, sin),
        "transformers": transformers_step,
        "clone": lambda: (q.clone(), k.clone()),
        "module in place": lambda: rope(q_mod, k_mod, offset=POSITION, inplace=True),
        "function in place": lambda: ropekit.apply_rotary_qk(q_in, k_in, cos, sin, inplace=True),
        "mul_": lambda: (q_mul.mul_(1.0), k_mul.mul_(1.0)),
    }


def step(rounds: int, calls: int) -> list[dict]:
    """One row per shape and dtype: µs per call of every contender and the ratios (per-round, summarised)."""
    rows = []
    for shape in SHAPES:
        for dtype_name in DTYPES:
            fns = step_contenders(shape, getattr(torch, dtype_name))
            times = interleaved(fns, rounds, calls)
            row = {"shape": list(shape), "dtype": dtype_name,
                   "us": {name: {key: 1e6 * value for key, value in summary(ts).items()} for name, ts in times.items()}}
            row["ratios"] = {label: summary([a / b for a, b in zip(times[num], times[den], strict=True)])
                             for label, (num, den) in RATIOS.items()}
            rows.append(row)
    return rows


def tiny_model(family: str, dtype: torch.dtype) -> torch.nn.Module:
    """A random 4-layer Qwen3 (q/k norms) or Llama: small enough that a step is mostly per-token work."""
    import transformers

    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, pad_token_id=0, eos_token_id=None)
    config = (transformers.Qwen3Config if family == "qwen3" else transformers.LlamaConfig)(**common)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model_class = transformers.Qwen3ForCausalLM if family == "qwen3" else transformers.LlamaForCausalLM
    return model_class(config).eval().to(dtype)


def decoding(model: torch.nn.Module, prompt: torch.Tensor, options: dict, static_length: int | None):
    """A call decoding greedily from ``prompt``, with a static cache of ``static_length`` slots or DynamicCache."""
    from ropekit.integrations.transformers import static_cache

    def generate():
        past = static_cache(model, static_length) if static_length is not None else None
        with torch.no_grad():
            return model.generate(prompt, past_key_values=past, **options)

    return generate


def cache(rounds: int, new_tokens: int = 64, prompt_tokens: int = 16) -> list[dict]:
    """Tokens/s of greedy decoding, patched, with transformers' DynamicCache and with ropekit's static cache."""
    from ropekit.integrations.transformers import patch, unpatch

    rows = []
    for family in ("qwen3", "llama"):
        for dtype_name in DTYPES:
            model = tiny_model(family, getattr(torch, dtype_name))
            prompt = torch.randint(1, 512, (1, prompt_tokens), generator=torch.Generator().manual_seed(2))
            options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           attention_mask=torch.ones_like(prompt))
            patch(model)
            try:
                runs = {"DynamicCache": decoding(model, prompt, options, None),
                        "static_cache": decoding(model, prompt, options, prompt_tokens + new_tokens)}
                same_tokens = torch.equal(runs["DynamicCache"](), runs["static_cache"]())
                times = interleaved(runs, rounds, 1, repeats=3, warmup=1)
            finally:
                unpatch(model)
            rates = {name: [new_tokens / t for t in ts] for name, ts in times.items()}
            rows.append({"model": family, "dtype": dtype_name, "same_tokens": same_tokens,
                         "tokens_per_s": {name: summary(r) for name, r in rates.items()},
                         "static / dynamic": summary([s / d for s, d in zip(rates["static_cache"],
                                                                            rates["DynamicCache"], strict=True)])})
    return rows


def cell(stats: dict, digits: int) -> str:
    """``median (min-max)``."""
    return f"{stats['median']:.{digits}f} ({stats['min']:.{digits}f}-{stats['max']:.{digits}f})"


def print_tables(step_rows: list[dict], cache_rows: list[dict], load: tuple, rounds: int, calls: int) -> None:
    """The markdown tables of docs/benchmarks.md."""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, load average before "
          f"{load[0][0]:.2f} / after {load[1][0]:.2f} (1 min), {os.cpu_count()} CPUs")
    if step_rows:
        names = list(step_rows[0]["us"])
        print(f"\nDecode step, µs per call (median over {rounds} rounds of the fastest of 5 batches of {calls} "
              "calls):\n")
        print("| shape | dtype | " + " | ".join(names) + " |")
        print("|---|---|" + "---:|" * len(names))
        for row in step_rows:
            print(f"| {'x'.join(map(str, row['shape']))} | {row['dtype']} | "
                  + " | ".join(f"{row['us'][n]['median']:.1f}" for n in names) + " |")
        print("\nRatios, median of the per-round ratios (min-max):\n")
        print("| shape | dtype | " + " | ".join(RATIOS) + " |")
        print("|---|---|" + "---:|" * len(RATIOS))
        for row in step_rows:
            print(f"| {'x'.join(map(str, row['shape']))} | {row['dtype']} | "
                  + " | ".join(cell(row["ratios"][label], 2) for label in RATIOS) + " |")
    if cache_rows:
        print("\nGreedy decoding of tiny patched models, tokens/s (median (min-max) over the rounds):\n")
        print("| model | dtype | DynamicCache | static_cache | static / dynamic | same tokens |")
        print("|---|---|---:|---:|---:|---|")
        for row in cache_rows:
            rates = row["tokens_per_s"]
            print(f"| {row['model']} | {row['dtype']} | {cell(rates['DynamicCache'], 0)} | "
                  f"{cell(rates['static_cache'], 0)} | {cell(row['static / dynamic'], 2)} | "
                  f"{'yes' if row['same_tokens'] else 'no'} |")


def main() -> None:
    """Measure the parts asked for at one thread; print the tables (or one JSON object)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=100, help="calls per batch (decode step; 5 batches a round)")
    parser.add_argument("--cache-rounds", type=int, default=7, help="rounds of model decoding (3 runs each)")
    parser.add_argument("--parts", nargs="+", choices=["step", "cache"], default=["step", "cache"])
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: this thread's CPU time, which leaves out the time it waited "
                             "for a core on a machine shared with other jobs (every call of both parts runs on "
                             "this one thread)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(1)
    if "cpu" not in ropekit.ops.available():  # builds the kernel first if needed
        raise SystemExit("the CPU kernel is not available here")
    before = os.getloadavg()
    with torch.no_grad():
        step_rows = step(args.rounds, args.calls) if "step" in args.parts else []
    cache_rows = cache(args.cache_rounds) if "cache" in args.parts else []
    load = (before, os.getloadavg())
    if args.json:
        print(json.dumps({"torch": torch.__version__, "threads": 1, "loadavg": load, "clock": args.clock,
                          "step": step_rows, "cache": cache_rows}))
    else:
        print(f"Clock: {args.clock}.")
        print_tables(step_rows, cache_rows, load, args.rounds, args.calls)


if __name__ == "__main__":
    main()
