"""``ropekit extrapolate``: train at a short context, evaluate at 1x, 2x, 4x and 8x that length.

One model per encoding (rope, sinusoidal, learned, none, xpos, alibi, p-rope, partial-rope, or
the ``--encodings`` given) is trained at ``--context T``; then the validation loss is measured
on windows of ``k*T`` characters, ``k`` in 1, 2, 4, 8. The RoPE model
is evaluated four ways without any fine-tuning: plain, and with :class:`~ropekit.scaling.Linear`
(position interpolation), :class:`~ropekit.scaling.NTK` and :class:`~ropekit.scaling.YaRN` applied
at evaluation with factor ``k`` (``original_max_position_embeddings = T`` for YaRN). Linear and
YaRN are also shown after a short fine-tune at the longer length (``--finetune-steps``, as PI
and YaRN prescribe), each on a copy of the trained model. A learned
table has no rows past ``T``: those cells are reported as not applicable (``null`` in JSON).

Writes the model files, ``extrapolation.png`` and ``extrapolation.json`` into ``--out``, in the
order :mod:`.train` uses: the old summary and figure are removed before the first model file is
replaced and the summary is written last, so a summary present always describes the model files
next to it (``load_results(out, "extrapolation.json")`` checks their sha256).
"""

from __future__ import annotations

import argparse
import copy
import math

import torch

from ropekit.files import write_bytes_atomic
from ropekit.scaling import NTK, Linear, YaRN

from .options import FINETUNE_STEPS, FINETUNE_STEPS_QUICK, QUICK_EXTRAPOLATE, compare_encodings, sizes_for
from .train import corpus_for, evaluate, prepare_out, set_threads, train_all, val_windows, write_json

MULTIPLES = (1, 2, 4, 8)
ROPE_VARIANTS = {
    "rope": lambda factor, length: None,
    "rope+linear": lambda factor, length: Linear(float(factor)),
    "rope+ntk": lambda factor, length: NTK(float(factor)),
    "rope+yarn": lambda factor, length: YaRN(float(factor), original_max_position_embeddings=length),
}


FINETUNED = {"rope+linear+ft": ROPE_VARIANTS["rope+linear"], "rope+yarn+ft": ROPE_VARIANTS["rope+yarn"]}


def finetune_lengths(model, corpus, context: int, eval_tokens: int, steps: int, lr: float,
                     seed: int) -> dict[str, list]:
    """Rows for :data:`FINETUNED`: a copy of ``model`` fine-tuned ``steps`` steps per length with the rule on.

    Each step sees ``16 // k`` windows of ``k * context + 1`` characters (the tokens of a training
    step); the learning rate is constant. At ``k = 1`` the row is the model as trained.
    """
    table: dict[str, list] = {name: [] for name in FINETUNED}
    for multiple in MULTIPLES:
        length = context * multiple
        windows = val_windows(corpus.val, length, max(eval_tokens, length))
        for name, make_rule in FINETUNED.items():
            tuned = copy.deepcopy(model)
            if multiple > 1:
                tuned.set_rope_scaling(make_rule(multiple, context))
                generator = torch.Generator().manual_seed(seed + multiple)
                optimizer = torch.optim.AdamW(tuned.parameters(), lr=lr, weight_decay=0.01)
                offsets = torch.arange(length + 1)
                tuned.train()
                for _ in range(steps):
                    starts = torch.randint(0, corpus.train.numel() - length - 1, (max(1, 16 // multiple),),
                                           generator=generator)
                    loss = tuned.loss(corpus.train[starts[:, None] + offsets])
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(tuned.parameters(), 1.0)
                    optimizer.step()
                tuned.eval()
            table[name].append(evaluate(tuned, windows, batch=max(1, 16 // multiple)))
    return table


def evaluate_lengths(model, corpus, context: int, eval_tokens: int, variants: dict | None) -> dict[str, list]:
    """``{row name: [val loss or None per multiple]}`` for one trained model.

    ``variants`` maps row names to ``(factor, train length) -> scaling rule``; ``None`` means the
    model is evaluated as it is, under its own encoding's name.
    """
    encoding = model.config.encoding
    rows = variants or {encoding: None}
    table: dict[str, list] = {name: [] for name in rows}
    for multiple in MULTIPLES:
        length = context * multiple
        windows = val_windows(corpus.val, length, max(eval_tokens, length))
        for name, make_rule in rows.items():
            if encoding == "learned" and length > model.config.context:
                table[name].append(None)  # no table rows past the training length
                continue
            if make_rule is not None:
                model.set_rope_scaling(make_rule(multiple, context) if multiple > 1 else None)
            table[name].append(evaluate(model, windows, batch=max(1, 16 // multiple)))
        if variants:
            model.set_rope_scaling(None)
    return table


def extrapolation_png(table: dict[str, list], context: int, title: str) -> bytes:
    """PNG bytes: validation loss against evaluation length (log2 axis), one line per row."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.2), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    lengths = [context * m for m in MULTIPLES]
    for i, (name, losses) in enumerate(table.items()):
        points = [(n, v) for n, v in zip(lengths, losses, strict=True) if v is not None]
        axes.plot(*zip(*points, strict=True), marker="o", color=f"C{i % 10}", linestyle="-" if i < 10 else "--",
                  label=name)
    axes.set_xscale("log", base=2)
    axes.set_xticks(lengths, [str(n) for n in lengths])
    axes.axvline(context, color="gray", linestyle=":", linewidth=1)
    axes.set_xlabel("evaluation length (characters); dotted: training length")
    axes.set_ylabel("validation loss (nats / character)")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def format_table(table: dict[str, list], context: int) -> str:
    """Fixed-width text table, ``n/a`` for missing cells."""
    head = f"{'model':<14}" + "".join(f"{f'{m}x ({context * m})':>14}" for m in MULTIPLES)
    lines = [head]
    for name, losses in table.items():
        lines.append(f"{name:<14}" + "".join(f"{'n/a' if v is None else format(v, '.4f'):>14}" for v in losses))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """The ``extrapolate`` verb."""
    set_threads(args)
    sizes = sizes_for(args, QUICK_EXTRAPOLATE)
    finetune_steps = args.finetune_steps
    if finetune_steps is None:
        finetune_steps = FINETUNE_STEPS_QUICK if args.quick else FINETUNE_STEPS
    out = prepare_out(args.out)
    corpus = corpus_for(args)
    longest = sizes.context * MULTIPLES[-1]
    if corpus.val.numel() < longest + 1:  # checked before training, not after it
        raise ValueError(f"--context {sizes.context}: evaluating at {MULTIPLES[-1]}x needs {longest + 1:,} "
                         f"validation characters, the corpus has {corpus.val.numel():,}")
    encodings = getattr(args, "encodings", None) or compare_encodings(args.attention)
    trained = train_all(args, corpus, sizes, encodings, out,
                        lambda e: f"model-{e}-{args.attention}-ctx{sizes.context}.pt",
                        ("extrapolation.json", "extrapolation.png"))
    table: dict[str, list] = {}
    for model, _ in trained:
        rope = model.config.encoding == "rope"
        table.update(evaluate_lengths(model, corpus, sizes.context, sizes.eval_tokens,
                                      ROPE_VARIANTS if rope else None))
        if rope and finetune_steps > 0:
            table.update(finetune_lengths(model, corpus, sizes.context, sizes.eval_tokens, finetune_steps,
                                          0.1 * sizes.lr, args.seed))
    summary = {"train_context": sizes.context, "multiples": list(MULTIPLES),
               "lengths": [sizes.context * m for m in MULTIPLES], "attention": args.attention, "val_loss": table,
               "not_applicable": {"learned": "a learned position table has no rows past the training length"},
               "runs": [record for _, record in trained], "corpus": {"source": corpus.source,
               "val_chars": corpus.val.numel()}, "sizes": vars(sizes), "seed": args.seed,
               "finetune_steps": finetune_steps, "quick": args.quick}
    title = f"trained at {sizes.context} chars ({args.attention} attention, {corpus.source}, seed {args.seed})"
    write_bytes_atomic(out / "extrapolation.png", extrapolation_png(table, sizes.context, title))
    write_json(out / "extrapolation.json", summary)
    print(f"validation loss (nats/char), trained at context {sizes.context}; scaling factor = eval length / "
          f"{sizes.context}")
    print(format_table(table, sizes.context))
    finite = [v for row in table.values() for v in row if v is not None]
    if not all(math.isfinite(v) for v in finite):
        print("warning: some losses are not finite")
    print(f"wrote {out / 'extrapolation.json'} and {out / 'extrapolation.png'}")
    return 0
