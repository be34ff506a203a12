"""``ropekit extrapolate``: train short, evaluate at 1x-8x the length (``ropekit.lab.extrapolate``)."""

from __future__ import annotations

import argparse
from typing import Any

from ..lab.options import ATTENTIONS, FINETUNE_STEPS, FINETUNE_STEPS_QUICK, QUICK_EXTRAPOLATE
from .common import at_least, lab_arguments
from .outputs import add_out_argument


def add_parser(verbs: Any) -> argparse.ArgumentParser:
    """Register the ``extrapolate`` verb ."""
    parser = verbs.add_parser(
        "extrapolate", help="train short, evaluate at 1x-8x the length (RoPE +- Linear/NTK/YaRN, absolute)",
        description="Train the character LM at --context per encoding, then report validation loss at 1x, 2x, "
        "4x and 8x that length, with Linear, NTK and YaRN scaling applied to RoPE at evaluation only.")
    parser.add_argument("--attention", choices=ATTENTIONS, default="softmax", help="attention (default softmax)")
    add_out_argument(parser, "ropekit-extrapolate")
    parser.add_argument("--finetune-steps", type=at_least(0), metavar="N",
                        help="steps of the short fine-tune for Linear and YaRN at each longer length "
                        f"(default {FINETUNE_STEPS}; --quick {FINETUNE_STEPS_QUICK}; 0: none)")
    lab_arguments(parser, QUICK_EXTRAPOLATE)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the experiment (imports torch and the lab only now)."""
    from ..lab.extrapolate import run as extrapolate

    return extrapolate(args)
