"""``ropekit extend``: which RoPE scaling rule lets *this* model read *this* length, measured without fine-tuning.

For a model trained at ``L`` tokens and a target ``T``, every candidate rule
(:mod:`ropekit_lab.extend_rules`) runs the model over windows of ``T`` tokens of real text, each
hiding a passkey (:mod:`ropekit_lab.extend_eval`). Measured per rule:

- **trained-context loss**: the text tokens at positions below ``L``. Causal attention makes
  position ``p`` depend on positions ``<= p`` only, so for a rule whose tables do not depend on
  the sequence length these are exactly the losses of an ``L``-token run. A length-dependent rule
  (dynamic NTK) gets its own ``L``-token run, unless its frequencies at ``L`` are those of plain RoPE
  (they are: dynamic NTK changes nothing up to ``L``), whose losses it then shares;
- **target loss by position bucket** (where a rule breaks) and over the whole window;
- **passkey retrieval** at ``T``: the key at several depths (one per window), exact match;
- **the pairs out of their trained range** (:func:`ropekit_lab.extend_rules.pair_ranges`).

The choice (:func:`choose`): among the rules whose trained-context perplexity stays within
``tolerance`` of plain RoPE's, the lowest perplexity over the target windows; a rule within
:data:`NEAR` of that best and with more passkeys retrieved wins instead.

:func:`extend` returns the JSON document (schema ``ropekit.extend/1``, docs/extend.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import torch

from ropekit import RopeConfig

from .extend_eval import (
    bucket_edges,
    bucket_means,
    evaluate_window,
    layer_modules,
    load_attention,
    passkey_window,
    peak_rss_mb,
)
from .extend_rules import RULES, Candidate, candidates, describe_factor, pair_ranges
from .probe import LayerBar, model_section, versions

SCHEMA = "ropekit.extend/1"
#: Default passkey depths, one per window in turn (share of the window before the key).
DEPTHS = (0.1, 0.5, 0.9)
#: Trained-context perplexity a rule may add to plain RoPE's and still be chosen (a share).
TOLERANCE = 0.05
#: Target perplexities within this share of the best count as a tie, broken by passkey retrieval.
NEAR = 0.02
#: ``--quick``: the trained context taken as this, the target twice it, one window.
QUICK_CONTEXT, QUICK_TARGET, QUICK_TEXTS = 1024, 2048, 1
DEFAULT_TEXTS, BUCKETS = 3, 8


def _ppl(nll_sum: float, count: int) -> float | None:
    return math.exp(nll_sum / count) if count else None


def _rounded(x: float | None, digits: int = 6) -> float | None:
    return None if x is None or not math.isfinite(x) else float(f"{x:.{digits}g}")


def summarise_rule(candidate: Candidate, runs: list[dict[str, Any]], trained_nll: list[torch.Tensor],
                   trained: int, target: int, edges: list[int]) -> dict[str, Any]:
    """The rule's row: trained-context and target perplexity with their spread over windows, buckets, passkey."""

    def ppl_of(parts: list[torch.Tensor]) -> dict[str, Any]:
        flat = [p[~torch.isnan(p)] for p in parts]
        total = sum(float(p.sum()) for p in flat)
        count = sum(p.numel() for p in flat)
        each = [_ppl(float(p.sum()), p.numel()) for p in flat]
        each = [e for e in each if e is not None]
        return {"ppl": _rounded(_ppl(total, count)), "tokens": count,
                "min": _rounded(min(each)) if each else None, "max": _rounded(max(each)) if each else None}

    nlls = [r["nll"] for r in runs]
    buckets = []
    for k, (low, high) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        per = [bucket_means(n, edges)[k] for n in nlls]
        count = sum(c for _, c in per)
        mean = sum(m * c for m, c in per if c) / count if count else float("nan")
        each = [math.exp(m) for m, c in per if c]
        buckets.append({"start": low, "end": high, "ppl": _rounded(math.exp(mean)) if count else None,
                        "min": _rounded(min(each)) if each else None, "max": _rounded(max(each)) if each else None,
                        "tokens": count})
    beyond = [n[trained - 1:] for n in nlls] if trained < target else []
    passkeys = [{"depth": r["depth"], "key": r["key"], "answer": r["answer"], "correct": r["correct"]} for r in runs]
    correct = sum(p["correct"] for p in passkeys)
    return {"name": candidate.name, "summary": candidate.summary, "rope_parameters": candidate.rope_parameters,
            "max_position_embeddings": candidate.max_position_embeddings,
            "trained": ppl_of(trained_nll), "target": ppl_of(nlls),
            "beyond": ppl_of(beyond) if beyond else None, "buckets": buckets,
            "passkey": {"correct": correct, "total": len(passkeys),
                        "accuracy": correct / len(passkeys) if passkeys else None, "trials": passkeys},
            "seconds": [round(r["seconds"], 2) for r in runs],
            "cpu_seconds": [round(r["cpu_seconds"], 2) for r in runs]}


def choose(rows: list[dict[str, Any]], tolerance: float = TOLERANCE) -> dict[str, Any]:
    """The chosen rule and why: see the module docstring. ``rows``: :func:`summarise_rule` rows, ``none`` first."""
    reference = rows[0]["trained"]["ppl"]
    limit = reference * (1 + tolerance)
    kept = [r for r in rows if r["trained"]["ppl"] is not None and r["trained"]["ppl"] <= limit]
    dropped = [r["name"] for r in rows if r not in kept]
    best = min(kept, key=lambda r: r["target"]["ppl"])
    near = [r for r in kept if r["target"]["ppl"] <= best["target"]["ppl"] * (1 + NEAR)]
    pick = max(near, key=lambda r: (r["passkey"]["correct"], -r["target"]["ppl"]))
    reason = (f"perplexity {pick['target']['ppl']:.4g} over the target windows, passkey "
              f"{pick['passkey']['correct']}/{pick['passkey']['total']}; trained-context perplexity "
              f"{pick['trained']['ppl']:.4g} against {reference:.4g} with plain RoPE")
    if pick is not best:
        reason += (f" (within {100 * NEAR:g}% of {best['name']}'s {best['target']['ppl']:.4g}, and more passkeys "
                   "retrieved)")
    return {"rule": pick["name"], "reason": reason, "dropped": dropped,
            "criterion": (f"the lowest perplexity over the target windows among the rules whose trained-context "
                          f"perplexity is at most {100 * tolerance:g}% above plain RoPE's ({limit:.4g}); a rule within "
                          f"{100 * NEAR:g}% of that lowest wins if it retrieves more passkeys"),
            "rope_parameters": pick["rope_parameters"], "max_position_embeddings": pick["max_position_embeddings"]}


def _same_tables(a: RopeConfig, b: RopeConfig, seq_len: int) -> bool:
    (fa, sa), (fb, sb) = a.inv_frequencies(seq_len), b.inv_frequencies(seq_len)
    return sa == sb and torch.equal(fa, fb)


class _Bar:
    """One :class:`ropekit_lab.probe.LayerBar` per forward, labelled with the rule and window."""

    def __init__(self, layers: int, total: int, enabled: bool) -> None:
        self.layers, self.total, self.enabled, self.done, self.bar = layers, total, enabled, 0, None

    def start(self, label: str) -> None:
        self.done += 1
        self.bar = LayerBar(self.layers, f"extend {self.done}/{self.total} {label}", enabled=self.enabled)

    def step(self) -> None:
        if self.bar is not None:
            self.bar.step()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def extend(loaded: Any, text_ids: torch.Tensor, *, trained: int, target: int, rules: list[str], texts: int,
           depths: tuple[float, ...] = DEPTHS, tolerance: float = TOLERANCE, text: dict | None = None,
           quick: bool = False, progress: bool = True) -> dict[str, Any]:
    """Measure every rule; return the JSON document (schema ``ropekit.extend/1``).

    ``text_ids``: ``(n,)`` int64 token ids of the text, enough for ``texts`` windows of ``target``.
    """
    model, tokenizer = loaded.model, loaded.tokenizer
    own = RopeConfig.from_hf(model.config)
    attention = load_attention(model)
    chosen = candidates(rules, own, trained, target)
    per_window = passkey_window(tokenizer, text_ids, target, depths[0], seed=0).n_text  # text tokens per window
    windows = [passkey_window(tokenizer, text_ids[i * per_window:], target, depths[i % len(depths)], seed=i)
               for i in range(texts)]
    edges = bucket_edges(target, trained, BUCKETS)
    layers = len(layer_modules(model))
    # length-dependent rules (their tables at L differ from theirs at T) need their own L-token runs, unless
    # their tables at L are plain RoPE's (dynamic NTK): then they share plain RoPE's trained-context losses
    varying = [c for c in chosen if not _same_tables(c.rope(own, trained), c.rope(own, target), trained)]
    extra = [c for c in varying if not _same_tables(c.rope(own, trained), chosen[0].rope(own, trained), trained)]
    bar = _Bar(layers, (len(chosen) + len(extra)) * len(windows), progress)
    rows, seconds, start = [], {"load": round(loaded.seconds, 2)}, time.perf_counter()
    none_trained: list[torch.Tensor] = []
    for cand in chosen:
        runs, trained_nll = [], []
        for k, window in enumerate(windows):
            bar.start(f"{cand.name} window {k + 1}")
            try:
                result = evaluate_window(model, window, cand.rope(own, target), tokenizer, on_layer=bar.step)
            finally:
                bar.close()
            runs.append({"nll": result.nll, "answer": result.answer, "correct": result.correct, "key": window.key,
                         "depth": round(window.depth, 4), "seconds": result.seconds,
                         "cpu_seconds": result.cpu_seconds})
            trained_nll.append(result.nll[:trained - 1])
        if cand in extra:  # its tables at L differ from plain RoPE's and from its own at T: an L-token run each
            trained_nll = []
            for k, window in enumerate(windows):
                short = passkey_window(tokenizer, text_ids[k * per_window:], trained, window.depth, seed=k)
                bar.start(f"{cand.name} at {trained}, window {k + 1}")
                try:
                    trained_nll.append(evaluate_window(model, short, cand.rope(own, trained), tokenizer,
                                                       on_layer=bar.step).nll)
                finally:
                    bar.close()
        elif cand in varying:
            trained_nll = none_trained  # dynamic NTK: plain RoPE up to L
        if cand.name == "none":
            none_trained = trained_nll
        row = summarise_rule(cand, runs, trained_nll, trained, target, edges)
        row["pairs"] = pair_ranges(cand, own, trained, target)
        row["trained_source"] = ("its own L-token runs" if cand in extra else
                                 "plain RoPE's (the rule changes nothing up to L)" if cand in varying
                                 else "the first L positions of the target windows")
        rows.append(row)
    seconds["evaluate"] = round(time.perf_counter() - start, 2)
    choice = choose(rows, tolerance)
    return {
        "schema": SCHEMA,
        "model": model_section(loaded, own),
        "text": {**(text or {}), "windows": len(windows), "tokens_per_window": target},
        "lengths": {"trained": trained, "target": target, "factor": target / trained,
                    "model_max_positions": own.max_positions, "label": describe_factor(trained, target)},
        "buckets": edges,
        "rules": rows,
        "choice": choice,
        "tolerance": tolerance,
        "attention": attention,
        "quick": quick,
        "threads": torch.get_num_threads(),
        "seconds": seconds,
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "versions": versions(),
    }


def one_line_summary(document: dict[str, Any]) -> str:
    """``ropekit extend: 8192 -> 16384: yarn (ppl 12.3, passkey 2/3); none 45.6, linear ...``."""
    choice, lengths = document["choice"], document["lengths"]
    rows = ", ".join(f"{r['name']} {r['target']['ppl']:.4g}" for r in document["rules"])
    return (f"ropekit extend: {lengths['label']}: chose {choice['rule']}; perplexity over the target windows: {rows}; "
            f"{document['seconds']['evaluate']:.0f} s, peak memory {document['peak_rss_mb']:.0f} MiB")


def text_ids_for(tokenizer: Any, text: str, tokens: int, option: str) -> torch.Tensor:
    """At least ``tokens`` token ids of ``text`` (``(n,)`` int64), tokenizing only as much of it as needed."""
    chars = 6 * tokens
    while True:
        ids = tokenizer(text[:chars], return_tensors="pt", add_special_tokens=False)["input_ids"][0]
        if ids.numel() >= tokens or chars >= len(text):
            break
        chars *= 2
    if ids.numel() < tokens:
        raise ValueError(f"{option}: the text gives {ids.numel():,} tokens; the windows need {tokens:,} (a shorter "
                         "--to or fewer --texts)")
    return ids.to(torch.int64)


def default_text() -> tuple[str, str]:
    """``(text, label)``: the whole KJV corpus the lab trains on, in canonical order (about 1M tokens)."""
    from .charlm import fetch_kjv, read_verses

    return "\n".join(v for _, _, v in read_verses(fetch_kjv())), "KJV (the lab's corpus), from Genesis 1:1 on"


def run(args: argparse.Namespace) -> int:
    """The ``extend`` verb: load, measure, write the page (and the config); print the page's path or the JSON."""
    from .extend_output import check_config_destination, check_out_folder, write_config, write_outputs
    from .probe_models import load_chosen
    from .probe_text import read_text, text_record

    torch.set_num_threads(args.threads or 1)
    check_out_folder(args.out)
    if args.write_config is not None:
        check_config_destination(args.write_config, args)
    rules = args.rules or list(RULES)
    texts = args.texts or (QUICK_TEXTS if args.quick else DEFAULT_TEXTS)
    if args.text is not None:
        text, label, option = read_text(args.text), f"--text {args.text}", "--text"
    else:
        text, label, option = *default_text(), "the default text"
    if not text.strip():
        raise ValueError(f"{option}: the text is empty")
    loaded = load_chosen(args)
    own = RopeConfig.from_hf(loaded.model.config)
    trained = args.context or (QUICK_CONTEXT if args.quick else own.max_positions)
    if trained is None:
        raise ValueError("the model's config has no max_position_embeddings: give --context")
    target = args.to or (2 * trained if args.quick else None)
    if target is None:
        raise ValueError("--to: the target length is required (or --quick)")
    if target <= trained:
        raise ValueError(f"--to {target}: must be longer than the trained context {trained}")
    text_ids = text_ids_for(loaded.tokenizer, text, texts * target, option)
    document = extend(loaded, text_ids, trained=trained, target=target, rules=rules, texts=texts,
                      tolerance=args.tolerance, text=text_record(text, label), quick=args.quick,
                      progress=not args.no_progress)
    if args.write_config is not None:
        document["written_config"] = str(write_config(args.write_config, loaded, document))
    index = write_outputs(args.out, document)
    if args.json:
        print(json.dumps(document, indent=1, allow_nan=False))
    else:
        print(index)
        print(one_line_summary(document), file=sys.stderr)
    return 0
