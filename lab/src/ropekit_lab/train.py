"""``ropekit train``: train the character LM of :mod:`ropekit_lab.charlm` with one position encoding or all.

Writes into ``--out``: one ``model-<encoding>-<attention>.pt`` per run (``torch.save`` of config,
state_dict, vocab and the run's record), ``loss_curves.png`` and ``results.json`` (``{"runs":
[{"encoding", "attention", "steps", "train_loss", "val_loss", "model_file", "model_sha256", ...}]}``).
Losses are in nats per character. Each file is written atomically, and in an order that keeps the
folder consistent after an interruption at any point: the old ``results.json`` and
``loss_curves.png`` are removed before the first model file is replaced, and ``results.json`` is
written last; :func:`load_results` checks each listed model file against its sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch

from ropekit import files
from ropekit.files import write_bytes_atomic

from .charlm import CharLM, CharLMConfig, Corpus, load_corpus, save_model
from .options import COMPARE, DEFAULT, QUICK, Sizes, compare_encodings, sizes_for

__all__ = ["COMPARE", "DEFAULT", "QUICK", "Sizes", "evaluate", "load_results", "run", "sizes_for", "train_one",
           "val_windows"]


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
    """A one-line progress bar on stderr, redrawn after a carriage return; no dependency.

    A context manager: the line is ended on leaving, also when an error or Ctrl-C ends the loop,
    so that a message printed next starts on a line of its own. ``enabled=False`` draws nothing.
    """

    def __init__(self, label: str, total: int, stream=None, *, enabled: bool = True) -> None:
        self.label, self.total, self.stream, self.enabled = label, total, stream or sys.stderr, enabled
        self.start, self.drawn = time.perf_counter(), False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def update(self, step: int, loss: float, val: float | None) -> None:
        """Redraw for ``step`` of ``total``."""
        if not self.enabled:
            return
        width = 24
        filled = int(width * step / max(1, self.total))
        elapsed = time.perf_counter() - self.start
        val_text = "" if val is None else f" val {val:.3f}"
        self.drawn = True  # before writing: a Ctrl-C that lands inside the write still ends the line
        self.stream.write(f"\r{self.label:<22} [{'#' * filled}{'.' * (width - filled)}] {step}/{self.total} "
                          f"loss {loss:.3f}{val_text} {elapsed:5.0f}s")
        self.stream.flush()

    def close(self) -> None:
        """End the line, if one was drawn."""
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


def train_one(corpus: Corpus, encoding: str, attention: str, sizes: Sizes, seed: int,
              progress: bool = True) -> tuple[CharLM, dict]:
    """Train one model; return it and its record (``steps``, ``train_loss``, ``val_loss`` lists and more).

    ``train_loss`` at an evaluation step is the mean training loss since the previous one.
    Windows are drawn with a generator seeded by ``seed``; the model's initialisation too.
    """
    torch.manual_seed(seed)
    config = CharLMConfig(vocab_size=len(corpus.vocab), encoding=encoding, attention=attention, dim=sizes.dim,
                          layers=sizes.layers, heads=sizes.heads, context=sizes.context,
                          rope_fraction=sizes.rope_fraction)
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
    running, count, start = 0.0, 0, time.perf_counter()
    model.train()
    with Progress(f"{encoding}/{attention}", sizes.steps, enabled=progress) as bar:
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
            if val is not None or step % 5 == 0:
                bar.update(step, loss.item(), record["val_loss"][-1])
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
            axes.plot(*zip(*train, strict=True), color=color, linestyle="--", alpha=0.6, label=f"{label} train")
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
    """Run on ``--threads N`` CPU threads, default 1 (``OMP_NUM_THREADS`` does not apply: the verb sets the count).

    These models are small: on an idle 2-core machine a second thread saves about a fifth of the
    time, but when another job shares the cores, two OpenMP threads make a run 3-6x slower than
    one (each small parallel region waits for a thread that is not scheduled).
    """
    torch.set_num_threads(args.threads or 1)


def retire(out: Path, *names: str) -> None:
    """Remove the summary files ``names`` from ``out`` before the first model file they describe is replaced.

    Results are written last: after an interruption, a summary present in ``out`` always
    describes the model files next to it, and a missing one says that the run did not finish.
    """
    for name in names:
        if (out / name).exists():
            files.fs_step("unlink", out / name)
            (out / name).unlink()


def load_results(out: str | Path, name: str = "results.json") -> dict:
    """The summary ``out/name`` after checking that every model file it lists is the one it describes.

    Each run's ``model_sha256`` is compared with the file's bytes; raises ``ValueError`` naming the
    file when one is missing or holds another run (a folder rewritten by an interrupted run).
    """
    out = Path(out)
    summary = json.loads((out / name).read_text(encoding="utf-8"))
    for record in summary["runs"]:
        path = out / record["model_file"]
        if not path.is_file():
            raise ValueError(f"{name} lists the model file {str(path)!r}, which does not exist")
        if hashlib.sha256(path.read_bytes()).hexdigest() != record["model_sha256"]:
            raise ValueError(f"{name} does not describe {str(path)!r}: its sha256 differs (another run's file)")
    return summary


def train_all(args: argparse.Namespace, corpus: Corpus, sizes: Sizes, encodings: tuple[str, ...], out: Path,
              model_name, retired: tuple[str, ...]) -> list[tuple[CharLM, dict]]:
    """Train each encoding and save its model as ``out / model_name(encoding)``; the records name and hash it.

    The summary files ``retired`` are removed just before the first model file is written.
    """
    trained = []
    for i, encoding in enumerate(encodings):
        model, record = train_one(corpus, encoding, args.attention, sizes, args.seed, progress=not args.no_progress)
        if i == 0:
            retire(out, *retired)
        name = model_name(encoding)
        record["model_sha256"] = save_model(model, out / name, {"vocab": corpus.vocab, "record": record})
        record["model_file"] = name
        trained.append((model, record))
    return trained


def run(args: argparse.Namespace) -> int:
    """The ``train`` verb: one run or ``--compare``; writes the model files, loss_curves.png, results.json last."""
    set_threads(args)
    sizes = sizes_for(args)
    out = prepare_out(args.out)
    corpus = corpus_for(args)
    encodings = compare_encodings(args.attention) if args.compare else (args.encoding,)
    trained = train_all(args, corpus, sizes, encodings, out, lambda e: f"model-{e}-{args.attention}.pt",
                        ("results.json", "loss_curves.png"))
    runs = [record for _, record in trained]
    summary = {"runs": runs, "corpus": {"source": corpus.source, "train_chars": corpus.train.numel(),
               "val_chars": corpus.val.numel(), "vocab_size": len(corpus.vocab)},
               "sizes": vars(sizes), "quick": args.quick, "threads": torch.get_num_threads()}
    title = f"char LM on {corpus.source}, context {sizes.context}, seed {args.seed}"
    write_bytes_atomic(out / "loss_curves.png", loss_curves_png(runs, title))
    write_json(out / "results.json", summary)
    print(f"{'encoding':<18} {'attention':<9} {'final val loss':>14} {'bits/char':>9} {'seconds':>8}")
    for record in runs:
        val = record["final_val_loss"]
        print(f"{record['encoding']:<18} {record['attention']:<9} {val:>14.4f} {val / math.log(2):>9.3f} "
              f"{record['seconds']:>8.1f}")
    print(f"wrote {out / 'results.json'}, {out / 'loss_curves.png'} and {len(runs)} model file(s)")
    return 0
