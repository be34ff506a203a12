"""Whole models, unpatched and patched by ropekit, in every mode users run them (a standalone script).

One command measures a tiny random Qwen3 (q/k norms) and the real SmolLM2-135M-Instruct (Llama
architecture; fetched and converted once by the lab, ``ropekit_lab.smollm2_cache``), in float32 and
bfloat16, at 1 and 2 threads. Each (model, dtype, threads) runs in a process of its own (inductor
specialises its kernels on the thread count) and times six variants side by side:

    eager, DynamicCache         unpatched   and   patched (``ropekit.integrations.transformers.patch``)
    eager, static cache         unpatched with transformers' ``StaticCache``, patched with ropekit's ``static_cache``
    torch.compile, static cache the same caches, ``model.forward`` compiled (inductor, fullgraph, static shapes)

- **decode**: greedy decoding of ``--new-tokens`` tokens after a prompt of ``--prompt-tokens``,
  by calling the model step by step as ``generate`` does (the prompt eager, each new token through the
  variant's forward), timed token by token: at every step each variant decodes its next token in
  turn, the order turning every step, so that a busy machine's drift hits them alike. A round is
  one such decoding with fresh caches; tokens/s per round, median and spread (min-max) over rounds,
  and the ratio patched / unpatched per round (> 1: the patched model is faster).
- **prefill**: one forward of ``--prefill-tokens`` tokens into a fresh cache (the last token's
  logits only, as ``generate`` asks), every variant once per round in a turning order; the ratio is
  unpatched time / patched time per round (> 1: patched is faster).
- **profile** (eager only, timing hooks): the share of a decode step and of a prefill spent in the
  rotary tables, the rotation (``apply_rotary_pos_emb``; patched: the fused q/k norm + rotation),
  the q/k norm modules (patched: deferred into the rotation, what is left is the module call), the
  cache write (patched with ``static_cache``: the key normalised and rotated into its slot),
  attention (the attention function), the q/k/v/o projections, the MLP, and the rest (embedding,
  layer norms, the head, the model's Python), unpatched and patched, with DynamicCache and with
  the static caches. Hooks cost a few µs per call: the shares are approximate.

Greedy tokens of every variant are compared with the unpatched eager model's (bfloat16 may flip
a near tie). The load average (``os.getloadavg()``) is recorded before and after each process.
Usage::

    PYTHONPATH=src:lab/src python benchmarks/model_speed.py [--quick] [--models tiny-qwen3 smollm2]
        [--dtypes float32 bfloat16] [--threads 1 2] [--rounds 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone

MODES = ("eager, DynamicCache", "eager, static cache", "compiled, static cache")
SIDES = ("unpatched", "patched")
VARIANTS = tuple(f"{mode} | {side}" for mode in MODES for side in SIDES)
REFERENCE = VARIANTS[0]  # unpatched eager DynamicCache: the tokens every variant is compared with
OPERATORS = "compiled, static cache | patched, ropekit operators traced"  # --traced-operators
CATEGORIES = ("rotary tables", "rotation", "q/k norms", "cache write", "attention", "projections", "MLP", "rest")
# per model (full run, --quick): prompt, new tokens, prefill tokens by dtype, rounds of decoding, of prefill and of
# the profile, and whether the compiled variants' prefill is timed (SmolLM2's prefill graph takes minutes to compile:
# generate prefills eagerly and compiles the decode step only, so the compiled rows are decode-only there)
SETTINGS = {
    "tiny-qwen3": {"full": dict(prompt=32, new=64, prefill={"float32": 1024, "bfloat16": 1024}, rounds=5,
                                prefill_rounds=5, profile_repeats=3, compiled_prefill=True),
                   "quick": dict(prompt=16, new=16, prefill={"float32": 256, "bfloat16": 256}, rounds=2,
                                 prefill_rounds=2, profile_repeats=1, compiled_prefill=True)},
    "smollm2": {"full": dict(prompt=32, new=16, prefill={"float32": 2048, "bfloat16": 512}, rounds=3,
                             prefill_rounds=2, profile_repeats=1, compiled_prefill=False),
                "quick": dict(prompt=16, new=4, prefill={"float32": 256, "bfloat16": 128}, rounds=1,
                              prefill_rounds=1, profile_repeats=1, compiled_prefill=False)},
}


# -- the models ------------------------------------------------------------------------------------------------
def tiny_qwen3(dtype):
    """A random 4-layer Qwen3 (hidden 256, 8 heads, 4 kv heads, head_dim 64, q/k norms), sdpa attention."""
    import torch
    import transformers

    config = transformers.Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                      max_position_embeddings=4096, pad_token_id=0, eos_token_id=None)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config).eval().to(dtype)


def smollm2(dtype):
    """SmolLM2-135M-Instruct (30 layers, hidden 576, 9 heads, 3 kv heads), sdpa attention."""
    import transformers

    from ropekit_lab.smollm2_cache import smollm2_hf_dir

    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf_dir(quiet=True), dtype=dtype,
                                                             attn_implementation="sdpa").eval()


BUILDERS = {"tiny-qwen3": tiny_qwen3, "smollm2": smollm2}


# -- one variant: a model, its cache, eager or compiled ----------------------------------------------------------
class Variant:
    """A model with a cache factory and a forward (eager or compiled), decoding greedily one token per :meth:`step`."""

    def __init__(self, model, new_cache: Callable, forward: Callable) -> None:
        self.model, self.new_cache, self.forward = model, new_cache, forward

    def start(self, prompt) -> None:
        """A fresh cache, the prompt through the eager model (as ``generate`` does), the first token chosen."""
        import torch

        self.cache, self.position = self.new_cache(prompt.shape[1]), prompt.shape[1]
        with torch.no_grad():
            logits = self.model(prompt, past_key_values=self.cache, cache_position=torch.arange(self.position),
                                logits_to_keep=1).logits
        self.token, self.tokens = logits[:, -1:].argmax(-1), []

    def step(self) -> None:
        """Decode the next token (greedy) through this variant's forward."""
        import torch

        position = torch.tensor([self.position])
        with torch.no_grad():
            logits = self.forward(self.token, past_key_values=self.cache, cache_position=position,
                                  position_ids=position[None], logits_to_keep=1).logits
        self.token = logits[:, -1:].argmax(-1)
        self.tokens.append(int(self.token))
        self.position += 1

    def prefill(self, ids) -> None:
        """One forward of ``ids`` into a fresh cache (the last token's logits)."""
        import torch

        cache = self.new_cache(ids.shape[1])
        with torch.no_grad():
            self.forward(ids, past_key_values=cache, cache_position=torch.arange(ids.shape[1]), logits_to_keep=1)


def variants(build: Callable, dtype, new_tokens: int, traced_operators: bool = False) -> dict[str, Variant]:
    """The six variants on two copies of the model (same weights): one left alone, one patched.

    With ``traced_operators``, a seventh on a third copy: patched and compiled with ropekit's
    operators in the graph (``transformers_compile.EXPRESSIONS = False`` while it runs and is traced).
    """
    import torch
    from transformers.cache_utils import DynamicCache, StaticCache

    import ropekit.integrations.transformers_compile as traced
    from ropekit.integrations.transformers import patch, static_cache

    plain, patched = build(dtype), patch(build(dtype))

    def transformers_static(length):
        return StaticCache(config=plain.config, max_cache_len=length + new_tokens)

    def ropekit_static(model):
        return lambda length: static_cache(model, length + new_tokens)

    def compiled(model):
        return torch.compile(model.forward, fullgraph=True, dynamic=False)

    found = {
        "eager, DynamicCache | unpatched": Variant(plain, lambda _: DynamicCache(), plain),
        "eager, DynamicCache | patched": Variant(patched, lambda _: DynamicCache(), patched),
        "eager, static cache | unpatched": Variant(plain, transformers_static, plain),
        "eager, static cache | patched": Variant(patched, ropekit_static(patched), patched),
        "compiled, static cache | unpatched": Variant(plain, transformers_static, compiled(plain)),
        "compiled, static cache | patched": Variant(patched, ropekit_static(patched), compiled(patched)),
    }
    if traced_operators:
        with_operators = patch(build(dtype))
        forward = compiled(with_operators)

        def operators_forward(*args, **kwargs):
            traced.EXPRESSIONS = False
            try:
                return forward(*args, **kwargs)
            finally:
                traced.EXPRESSIONS = True

        found[OPERATORS] = Variant(with_operators, ropekit_static(with_operators), operators_forward)
    return found


def turns(names: list[str], turn: int) -> list[str]:
    """``names`` starting at ``turn`` (mod its length): the order of one turn."""
    turn %= len(names)
    return names[turn:] + names[:turn]


def decode_rounds(runs: dict[str, Variant], prompt, new_tokens: int, rounds: int) -> dict:
    """``name -> {"tokens_per_s": [...], "cpu_tokens_per_s": [...], "tokens": [...]}`` per round.

    The variants take turns at every step (the order turning each step); ``cpu_tokens_per_s``
    divides by the process's CPU time instead of the wall clock (time spent waiting for a core
    another job holds is not counted).
    """
    names = list(runs)
    wall, cpu = ({name: [] for name in names} for _ in range(2))
    for r in range(rounds):
        spent, used = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
        for run in runs.values():
            run.start(prompt)
        for step in range(new_tokens):
            for name in turns(names, r + step):
                start, start_cpu = time.perf_counter(), time.process_time()
                runs[name].step()
                spent[name] += time.perf_counter() - start
                used[name] += time.process_time() - start_cpu
        for name in names:
            wall[name].append(new_tokens / spent[name])
            cpu[name].append(new_tokens / used[name])
    return {name: {"tokens_per_s": wall[name], "cpu_tokens_per_s": cpu[name], "tokens": runs[name].tokens}
            for name in names}


def prefill_rounds(runs: dict[str, Variant], ids, rounds: int) -> dict[str, dict[str, list[float]]]:
    """``name -> {"seconds": [one prefill, per round], "cpu_seconds": [...]}``, the variants in a turning order."""
    names = list(runs)
    found = {name: {"seconds": [], "cpu_seconds": []} for name in names}
    for r in range(rounds):
        for name in turns(names, r):
            start, start_cpu = time.perf_counter(), time.process_time()
            runs[name].prefill(ids)
            found[name]["seconds"].append(time.perf_counter() - start)
            found[name]["cpu_seconds"].append(time.process_time() - start_cpu)
    return found


# -- the profile (eager, timing hooks) ------------------------------------------------------------------------
class Profile:
    """Seconds spent in each category while installed (see the module docstring), by hooks and wrappers."""

    def __init__(self, model) -> None:
        import transformers.modeling_utils as modeling_utils

        self.model, self.seconds, self.undo = model, dict.fromkeys(CATEGORIES[:-1], 0.0), []
        self.attention_functions = modeling_utils.ALL_ATTENTION_FUNCTIONS

    def _timed(self, category: str, function: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[category] += time.perf_counter() - start

        return timed

    def _module(self, module, category: str) -> None:
        started = []

        def before(*_):
            started.append(time.perf_counter())

        def after(*_):
            self.seconds[category] += time.perf_counter() - started.pop()

        self.undo += [module.register_forward_pre_hook(before).remove, module.register_forward_hook(after).remove]

    def install(self, cache=None) -> None:
        """Hook the model's modules, its modeling module's rotation, the attention function and ``cache.update``."""
        import sys as _sys

        for name, module in self.model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if type(module).__name__.endswith("RotaryEmbedding"):
                self._module(module, "rotary tables")
            elif leaf in ("q_norm", "k_norm"):
                self._module(module, "q/k norms")
            elif leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
                self._module(module, "projections")
            elif leaf == "mlp":
                self._module(module, "MLP")
        modeling = _sys.modules[type(self.model).__module__]
        rotation = modeling.apply_rotary_pos_emb
        modeling.apply_rotary_pos_emb = self._timed("rotation", rotation)
        self.undo.append(lambda: setattr(modeling, "apply_rotary_pos_emb", rotation))
        implementation = self.model.config._attn_implementation
        attention = self.attention_functions[implementation]
        self.attention_functions[implementation] = self._timed("attention", attention)
        self.undo.append(lambda: self.attention_functions.__delitem__(implementation))
        if cache is not None:
            cache.update = self._timed("cache write", cache.update)

    def remove(self) -> None:
        """Undo :meth:`install` (the cache's wrapper goes with the cache)."""
        for undo in reversed(self.undo):
            undo()
        self.undo = []


def hooked(run: Variant, cache, work: Callable) -> tuple[dict[str, float], float]:
    """``(seconds per category, total seconds)`` of ``work()`` with the hooks of :class:`Profile` installed."""
    hooks = Profile(run.model)
    hooks.install(cache)
    start = time.perf_counter()
    try:
        work()
    finally:
        hooks.remove()
    return dict(hooks.seconds), time.perf_counter() - start


def profile(runs: dict[str, Variant], prompt, ids, steps: int, repeats: int) -> dict:
    """Shares of an eager decode step and prefill per variant: medians over ``repeats`` passes, the variants in turn.

    ``{"decode": {name: {category: %}}, "prefill": {...}, "decode_ms": {name: ms per step}, "prefill_ms": {...}}``;
    a category's share is the median of its seconds over the passes, divided by the median total.
    """
    import torch

    eager = [name for name in runs if name.startswith("eager")]
    seconds = {part: {name: [] for name in eager} for part in ("decode", "prefill")}
    for repeat in range(repeats):
        for name in turns(eager, repeat):
            run = runs[name]
            run.start(prompt)
            seconds["decode"][name].append(hooked(run, run.cache, lambda run=run: [run.step() for _ in range(steps)]))
            cache = run.new_cache(ids.shape[1])

            def prefill(run=run, cache=cache):
                with torch.no_grad():
                    run.model(ids, past_key_values=cache, cache_position=torch.arange(ids.shape[1]), logits_to_keep=1)

            seconds["prefill"][name].append(hooked(run, cache, prefill))
    found = {}
    for part, per in (("decode", steps), ("prefill", 1)):
        found[part], found[part + "_ms"] = {}, {}
        for name, passes in seconds[part].items():
            total = statistics.median(t for _, t in passes)
            shares = {c: 100.0 * statistics.median(p[c] for p, _ in passes) / total for c in CATEGORIES[:-1]}
            shares["rest"] = 100.0 - sum(shares.values())
            found[part][name], found[part + "_ms"][name] = shares, 1e3 * total / per
    return found


# -- one process: one model, dtype and thread count ----------------------------------------------------------
def worker(model_name: str, dtype_name: str, threads: int, settings: dict, parts: list[str],
           traced_operators: bool) -> dict:
    """Everything measured for one (model, dtype, threads), as a JSON-ready dict."""
    import torch

    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    dtype = getattr(torch, dtype_name)
    runs = variants(BUILDERS[model_name], dtype, settings["new"], traced_operators)
    vocab = runs[REFERENCE].model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, vocab, (1, settings["prompt"]), generator=generator)
    ids = torch.randint(1, vocab, (1, settings["prefill"][dtype_name]), generator=generator)
    warm = {}
    prefilled = {name: run for name, run in runs.items()
                 if settings["compiled_prefill"] or not name.startswith("compiled")}
    for name, run in runs.items():  # compiles the compiled variants (decode graph, then prefill graph)
        start = time.perf_counter()
        run.start(prompt)
        for _ in range(2):
            run.step()
        if "prefill" in parts and name in prefilled:
            run.prefill(ids)
        warm[name] = time.perf_counter() - start
    result = {"model": model_name, "dtype": dtype_name, "threads": threads, "settings": settings, "warmup_s": warm}
    if "decode" in parts:
        result["decode"] = decode_rounds(runs, prompt, settings["new"], settings["rounds"])
    if "prefill" in parts:
        result["prefill"] = prefill_rounds(prefilled, ids, settings["prefill_rounds"])
    if "profile" in parts:
        result["profile"] = profile(runs, prompt, ids, min(settings["new"], 16), settings["profile_repeats"])
    result["load_avg"] = [load_before, os.getloadavg()]
    return result


# -- the tables --------------------------------------------------------------------------------------------------
def summary(values: list[float]) -> dict:
    """Median, min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def cell(stats: dict, digits: int) -> str:
    """``median (min-max)``."""
    return f"{stats['median']:.{digits}f} ({stats['min']:.{digits}f}-{stats['max']:.{digits}f})"


def per_round(numerators: list[float], denominators: list[float]) -> dict:
    """:func:`summary` of the per-round ratios."""
    return summary([a / b for a, b in zip(numerators, denominators, strict=True)])


def ratios(result: dict, clock: str) -> dict:
    """Per mode, patched against unpatched, round by round (> 1: patched is faster).

    Decode: tokens/s patched / unpatched, and the patched static cache / DynamicCache; prefill: time
    unpatched / patched. ``clock``: ``""`` (the wall clock) or ``"cpu_"`` (the process's CPU time).
    """
    found = {}
    for mode in MODES:
        unpatched, patched = f"{mode} | unpatched", f"{mode} | patched"
        if "decode" in result:
            decode = result["decode"]
            found[f"decode {mode}"] = per_round(decode[patched][f"{clock}tokens_per_s"],
                                                decode[unpatched][f"{clock}tokens_per_s"])
        if "prefill" in result and patched in result["prefill"]:
            prefill = result["prefill"]
            found[f"prefill {mode}"] = per_round(prefill[unpatched][f"{clock}seconds"],
                                                 prefill[patched][f"{clock}seconds"])
    compiled = f"{MODES[2]} | unpatched"
    if "decode" in result:
        decode = result["decode"]
        static, dynamic = (decode[f"{mode} | patched"][f"{clock}tokens_per_s"] for mode in MODES[1::-1])
        found["decode static / dynamic"] = per_round(static, dynamic)
        if OPERATORS in decode:
            found[f"decode {OPERATORS}"] = per_round(decode[OPERATORS][f"{clock}tokens_per_s"],
                                                     decode[compiled][f"{clock}tokens_per_s"])
    if "prefill" in result and OPERATORS in result["prefill"]:
        prefill = result["prefill"]
        found[f"prefill {OPERATORS}"] = per_round(prefill[compiled][f"{clock}seconds"],
                                                  prefill[OPERATORS][f"{clock}seconds"])
    return found


def decode_table(results: list[dict]) -> None:
    """Decode tokens/s per mode, and the ratios by the wall clock and by CPU time."""
    print("\nDecode, tokens/s (median (min-max) over rounds); patched / unpatched, the median (min-max) of the "
          "per-round ratios, by the wall clock and by CPU time:\n")
    print("| model | dtype | threads | mode | unpatched | patched | ratio | ratio, CPU time | same tokens |")
    print("|---|---|---:|---|---:|---:|---:|---:|---|")
    for r in results:
        decode, wall, cpu = r["decode"], ratios(r, ""), ratios(r, "cpu_")
        reference = decode[REFERENCE]["tokens"]
        for mode in MODES:
            same = all(decode[f"{mode} | {side}"]["tokens"] == reference for side in SIDES)
            print(f"| {r['model']} | {r['dtype']} | {r['threads']} | {mode} | "
                  f"{cell(summary(decode[f'{mode} | unpatched']['tokens_per_s']), 0)} | "
                  f"{cell(summary(decode[f'{mode} | patched']['tokens_per_s']), 0)} | "
                  f"**{cell(wall[f'decode {mode}'], 2)}** | {cell(cpu[f'decode {mode}'], 2)} | "
                  f"{'yes' if same else 'no'} |")
        if OPERATORS in decode:
            same = decode[OPERATORS]["tokens"] == reference
            print(f"| {r['model']} | {r['dtype']} | {r['threads']} | compiled, ropekit operators in the graph | "
                  f"{cell(summary(decode[MODES[2] + ' | unpatched']['tokens_per_s']), 0)} | "
                  f"{cell(summary(decode[OPERATORS]['tokens_per_s']), 0)} | "
                  f"**{cell(wall[f'decode {OPERATORS}'], 2)}** | {cell(cpu[f'decode {OPERATORS}'], 2)} | "
                  f"{'yes' if same else 'no'} |")
        print(f"| {r['model']} | {r['dtype']} | {r['threads']} | patched: static_cache / DynamicCache | "
              f"{cell(summary(decode[MODES[0] + ' | patched']['tokens_per_s']), 0)} | "
              f"{cell(summary(decode[MODES[1] + ' | patched']['tokens_per_s']), 0)} | "
              f"**{cell(wall['decode static / dynamic'], 2)}** | {cell(cpu['decode static / dynamic'], 2)} | |")


def prefill_table(results: list[dict]) -> None:
    """Prefill ms per mode, and the ratios (unpatched time / patched time) by the wall clock and by CPU time."""
    print("\nPrefill, ms (median (min-max) over rounds); unpatched time / patched time, the median (min-max) of "
          "the per-round ratios, by the wall clock and by CPU time:\n")
    print("| model | dtype | threads | tokens | mode | unpatched | patched | ratio | ratio, CPU time |")
    print("|---|---|---:|---:|---|---:|---:|---:|---:|")
    for r in results:
        prefill, wall, cpu = r["prefill"], ratios(r, ""), ratios(r, "cpu_")
        tokens = r["settings"]["prefill"][r["dtype"]]
        for mode in MODES:
            if f"{mode} | patched" not in prefill:
                continue
            ms = [cell(summary([1e3 * s for s in prefill[f"{mode} | {side}"]["seconds"]]), 0) for side in SIDES]
            print(f"| {r['model']} | {r['dtype']} | {r['threads']} | {tokens} | {mode} | {ms[0]} | {ms[1]} | "
                  f"**{cell(wall[f'prefill {mode}'], 2)}** | {cell(cpu[f'prefill {mode}'], 2)} |")
        if OPERATORS in prefill:
            ms = [cell(summary([1e3 * s for s in prefill[name]["seconds"]]), 0)
                  for name in (f"{MODES[2]} | unpatched", OPERATORS)]
            print(f"| {r['model']} | {r['dtype']} | {r['threads']} | {tokens} | compiled, ropekit operators in the "
                  f"graph | {ms[0]} | {ms[1]} | **{cell(wall[f'prefill {OPERATORS}'], 2)}** | "
                  f"{cell(cpu[f'prefill {OPERATORS}'], 2)} |")


def profile_table(results: list[dict], part: str) -> None:
    """The shares of an eager decode step or prefill, unpatched and patched."""
    what = "one step, over the steps of a decoding" if part == "decode" else "one call"
    print(f"\nProfile of the eager {part} ({what}), % of its time:\n")
    print("| model | dtype | threads | cache | model | ms | " + " | ".join(CATEGORIES) + " |")
    print("|---|---|---:|---|---|---:|" + "---:|" * len(CATEGORIES))
    for r in results:
        for name, shares in r["profile"][part].items():
            mode, side = name.split(" | ")
            print(f"| {r['model']} | {r['dtype']} | {r['threads']} | {mode.removeprefix('eager, ')} | {side} | "
                  f"{r['profile'][part + '_ms'][name]:.1f} | " + " | ".join(f"{shares[c]:.1f}" for c in CATEGORIES)
                  + " |")


def print_tables(results: list[dict], header: dict) -> None:
    """The markdown tables of docs/benchmarks.md."""
    print(f"{header['date']}, torch {header['torch']}, transformers {header['transformers']}, {header['cpus']} CPUs; "
          f"{header['seconds'] / 60:.1f} min in all")
    print("\nLoad average (1 min) before / after each process: " + "; ".join(
        f"{r['model']} {r['dtype']} {r['threads']}t {r['load_avg'][0][0]:.1f}/{r['load_avg'][1][0]:.1f}"
        for r in results))
    print("Warm-up (compiling included), s: " + "; ".join(
        f"{r['model']} {r['dtype']} {r['threads']}t {sum(r['warmup_s'].values()):.0f}" for r in results))
    if any("decode" in r for r in results):
        decode_table([r for r in results if "decode" in r])
    if any("prefill" in r for r in results):
        prefill_table([r for r in results if "prefill" in r])
    for part in ("decode", "prefill"):
        if any("profile" in r for r in results):
            profile_table([r for r in results if "profile" in r], part)


def settings_of(model_name: str, args: argparse.Namespace) -> dict:
    """The model's settings for this run (``--quick`` or the full run), with the command line's overrides."""
    settings = dict(SETTINGS[model_name]["quick" if args.quick else "full"])
    for name, value in (("prompt", args.prompt_tokens), ("new", args.new_tokens), ("rounds", args.rounds),
                        ("prefill_rounds", args.prefill_rounds)):
        if value is not None:
            settings[name] = value
    if args.prefill_tokens is not None:
        settings["prefill"] = dict.fromkeys(settings["prefill"], args.prefill_tokens)
    return settings


def measure(model_name: str, dtype_name: str, threads: int, args: argparse.Namespace) -> dict:
    """One process's measurements (a fresh interpreter at ``threads`` threads), parsed from its JSON line."""
    command = [sys.executable, __file__, "--worker", model_name, dtype_name, str(threads),
               json.dumps(settings_of(model_name, args)), "--parts", *args.parts]
    command += ["--traced-operators"] if args.traced_operators else []
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    print(f"measuring {model_name} {dtype_name} at {threads} thread(s)...", file=sys.stderr, flush=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"measuring {model_name} {dtype_name} at {threads} thread(s) failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    """Run one process per (threads, model, dtype) and print the tables (and write the JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short prompts, few tokens, one or two rounds")
    parser.add_argument("--models", nargs="+", choices=sorted(BUILDERS), default=sorted(BUILDERS)[::-1])
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--parts", nargs="+", choices=["decode", "prefill", "profile"],
                        default=["decode", "prefill", "profile"])
    parser.add_argument("--prompt-tokens", type=int, help="the prompt before decoding (default: per model)")
    parser.add_argument("--new-tokens", type=int, help="tokens decoded per round (default: per model)")
    parser.add_argument("--prefill-tokens", type=int, help="tokens of the prefill (default: per model and dtype)")
    parser.add_argument("--rounds", type=int, help="rounds of decoding (default: per model)")
    parser.add_argument("--prefill-rounds", type=int, help="rounds of prefill (default: per model)")
    parser.add_argument("--traced-operators", action="store_true",
                        help="also compile a patched model with ropekit's operators in the graph")
    parser.add_argument("--json", help="also write every measurement to this file")
    parser.add_argument("--worker", nargs=4, metavar=("MODEL", "DTYPE", "THREADS", "SETTINGS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        model_name, dtype_name, threads, settings = args.worker
        print(json.dumps(worker(model_name, dtype_name, int(threads), json.loads(settings), args.parts,
                                args.traced_operators)))
        return
    started = time.perf_counter()
    results = [measure(model_name, dtype_name, threads, args)
               for threads in args.threads for model_name in args.models for dtype_name in args.dtypes]
    import torch
    import transformers

    header = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "torch": torch.__version__,
              "transformers": transformers.__version__, "cpus": os.cpu_count(),
              "seconds": time.perf_counter() - started, "command": " ".join(sys.argv[1:])}
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"header": header, "results": results}, out)
    print_tables(results, header)


if __name__ == "__main__":
    main()
