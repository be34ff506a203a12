"""What the lab's verbs share: the options of ``train`` and ``extrapolate``, their bounds, what they need installed.

Torch-free (``ropekit --help`` imports every verb module).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from ropekit.cli import LAB_INSTALL, at_least, declare_requirements

from ..options import DEFAULT, Sizes

#: Upper bounds of the lab's sizes: work and memory grow with them (attention with the context
#: squared), so a typo fails at once instead of after gigabytes.
MAX_STEPS, MAX_CONTEXT, MAX_THREADS = 10_000_000, 4096, 1024
#: The module every figure is drawn with (report, loss curves, the probe's page).
FIGURES = ("matplotlib",)


def needs(parser: argparse.ArgumentParser, modules: Iterable[str], *, when: str | None = None) -> None:
    """Declare modules the verb needs (when the option ``when`` is given): checked before any work.

    A missing one ends the run with one line naming it and how to install the lab's dependencies.
    """
    declare_requirements(parser, modules, LAB_INSTALL, when=when)


def lab_arguments(parser: argparse.ArgumentParser, quick: Sizes) -> None:
    """Options shared by ``train`` and ``extrapolate``; ``quick`` gives the ``--quick`` defaults in the help."""
    parser.add_argument("--steps", type=at_least(1, MAX_STEPS), metavar="N",
                        help=f"optimizer steps (default {DEFAULT.steps}; --quick {quick.steps})")
    parser.add_argument("--context", type=at_least(2, MAX_CONTEXT), metavar="T", help="training context in characters "
                        f"(default {DEFAULT.context}; --quick {quick.context})")
    parser.add_argument("--seed", type=int, default=0, help="seed of initialisation and batches (default 0)")
    parser.add_argument("--quick", action="store_true", help=f"width {quick.dim}, {quick.layers} layers, "
                        f"{quick.steps} steps: a smoke test of the pipeline")
    parser.add_argument("--threads", type=at_least(1, MAX_THREADS), metavar="N",
                        help="CPU threads (default 1, whatever OMP_NUM_THREADS says: a second thread gains little on "
                        "these small models and costs much when other jobs share the cores)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--max-chars", type=at_least(1000), help=argparse.SUPPRESS)  # tests: a slice of the corpus
    needs(parser, FIGURES)  # the loss curves: checked before the first step, not after the last
