"""What the character-LM experiments accept: encodings and sizes.

Torch-free on purpose: the ``train`` / ``extrapolate`` verbs (:mod:`ropekit_lab.verbs.train`,
:mod:`ropekit_lab.verbs.extrapolate`) build their ``--help`` from it without importing torch.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

ENCODINGS = ("rope", "rope-interleaved", "sinusoidal", "learned", "none", "xpos", "alibi", "p-rope", "partial-rope")
ATTENTIONS = ("softmax", "linear")
#: Encodings that act on softmax logits (xPos: a decay between q and k; ALiBi: a bias on the logits).
SOFTMAX_ONLY = ("xpos", "alibi")
#: What ``--compare`` trains with softmax attention (``rope-interleaved`` equals ``rope`` up to a permutation).
COMPARE = ("rope", "sinusoidal", "learned", "none", "xpos", "alibi", "p-rope", "partial-rope")
#: The share of rotated pairs of ``p-rope`` and ``partial-rope`` unless ``--rope-fraction`` says otherwise.
ROPE_FRACTION = 0.25


def compare_encodings(attention: str) -> tuple[str, ...]:
    """The encodings ``--compare`` trains with ``attention``: :data:`COMPARE` less those it cannot use."""
    return tuple(e for e in COMPARE if attention == "softmax" or e not in SOFTMAX_ONLY)


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
    rope_fraction: float = ROPE_FRACTION  # share of the pairs that p-rope / partial-rope rotate


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
    if getattr(args, "rope_fraction", None) is not None:
        sizes.rope_fraction = args.rope_fraction
    return sizes
