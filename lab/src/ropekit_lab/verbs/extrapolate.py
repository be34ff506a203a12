"""``ropekit extrapolate``: train short, evaluate at 1x-8x the length (:mod:`ropekit_lab.extrapolate`)."""

from __future__ import annotations

import argparse
from typing import Any

from ropekit.cli import UserError, add_out_argument, at_least

from ..options import (
    ATTENTIONS,
    COMPARE,
    ENCODINGS,
    FINETUNE_STEPS,
    FINETUNE_STEPS_QUICK,
    QUICK_EXTRAPOLATE,
    SOFTMAX_ONLY,
)
from .common import MAX_STEPS, lab_arguments
from .train import rope_fraction_argument


def encoding_list(text: str) -> tuple[str, ...]:
    """An argparse type: comma-separated names from :data:`ENCODINGS`, each once."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in ENCODINGS]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected distinct names from {', '.join(ENCODINGS)}, got {text!r}")
    return names


def add_parser(verbs: Any) -> argparse.ArgumentParser:
    """Register the ``extrapolate`` verb ."""
    parser = verbs.add_parser(
        "extrapolate", help="train short, evaluate at 1x-8x the length (RoPE +- Linear/NTK/YaRN, xPos, ALiBi, ...)",
        description="Train the character LM at --context per encoding, then report validation loss at 1x, 2x, "
        "4x and 8x that length, with Linear, NTK and YaRN scaling applied to RoPE at evaluation only.")
    parser.add_argument("--attention", choices=ATTENTIONS, default="softmax", help="attention (default softmax)")
    parser.add_argument("--encodings", type=encoding_list, metavar="LIST",
                        help=f"comma-separated encodings to train (default all of {', '.join(COMPARE)}; "
                        f"with linear attention all but {' and '.join(SOFTMAX_ONLY)})")
    rope_fraction_argument(parser)
    add_out_argument(parser, "ropekit-extrapolate")
    parser.add_argument("--finetune-steps", type=at_least(0, MAX_STEPS), metavar="N",
                        help="steps of the short fine-tune for Linear and YaRN at each longer length "
                        f"(default {FINETUNE_STEPS}; --quick {FINETUNE_STEPS_QUICK}; 0: none)")
    lab_arguments(parser, QUICK_EXTRAPOLATE)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the experiment (imports torch and the lab only now); encodings the attention cannot use are refused."""
    refused = [e for e in args.encodings or () if e in SOFTMAX_ONLY and args.attention != "softmax"]
    if refused:
        verb = "acts" if len(refused) == 1 else "act"
        raise UserError(f"--encodings: {', '.join(refused)} {verb} on softmax logits: use --attention softmax")
    from ..extrapolate import run as extrapolate

    return extrapolate(args)
