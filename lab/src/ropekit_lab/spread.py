"""The extrapolation table over several seeds: mean and spread of ``ropekit extrapolate`` runs.

``python -m ropekit_lab.spread [--rows A,B,...] OUT RUN [RUN ...]`` reads ``extrapolation.json`` from each RUN
folder (checking, as :func:`ropekit_lab.train.load_results` does, that it describes the model
files beside it), requires the runs to differ in their seed only, and writes into OUT:
``spread.json`` (per row: the values of each seed, their mean and sample standard deviation),
``spread.md`` (the Markdown table ``mean ± std``) and ``spread.png`` (mean with ±1 std bars
against the evaluation length; ``--rows`` limits it to some rows). It prints the table. Bad
input (a missing or inconsistent run, OUT inside a RUN) ends with one line on stderr and exit
code 2; each file is written atomically.
"""

from __future__ import annotations

import io
import json
import statistics
import sys
from pathlib import Path

from ropekit.files import write_bytes_atomic

from .train import load_results

#: Settings that must agree between the runs of one table (the seed is what varies).
SAME = ("train_context", "multiples", "lengths", "attention", "sizes", "finetune_steps")


def load_runs(folders: list[str | Path]) -> list[dict]:
    """The ``extrapolation.json`` of each folder, checked against its model files and against each other.

    Raises ``ValueError`` naming the folder and the setting when a run is missing, does not
    describe its model files, repeats a seed or differs from the first run in anything but the seed.
    """
    if len(folders) < 2:
        raise ValueError(f"runs: a spread needs at least 2 runs, got {len(folders)}")
    runs = []
    for folder in folders:
        if not (Path(folder) / "extrapolation.json").is_file():
            raise ValueError(f"run {str(folder)!r} holds no extrapolation.json (not an extrapolate run, or unfinished)")
        try:
            runs.append(load_results(folder, "extrapolation.json"))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"run {str(folder)!r}: extrapolation.json is not a summary of ropekit extrapolate "
                             f"({type(exc).__name__}: {exc})") from None
    for folder, run in zip(folders[1:], runs[1:], strict=True):
        for key in SAME:
            if run.get(key) != runs[0].get(key):
                raise ValueError(f"run {str(folder)!r} differs from {str(folders[0])!r} in {key}: "
                                 f"{run.get(key)!r} != {runs[0].get(key)!r}")
        if list(run["val_loss"]) != list(runs[0]["val_loss"]):
            raise ValueError(f"run {str(folder)!r} has the rows {list(run['val_loss'])}, "
                             f"{str(folders[0])!r} has {list(runs[0]['val_loss'])}")
    seeds = [run["seed"] for run in runs]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"runs: each seed once, got seeds {seeds}")
    return runs


def spread(runs: list[dict]) -> dict:
    """``{"seeds", "lengths", "train_context", "rows": {name: {"values", "mean", "std"}}}``.

    ``values[k]`` lists the seeds' losses at ``lengths[k]``; ``mean`` and ``std`` (sample standard
    deviation, ``n - 1``) are ``None`` where the row has no value (a learned table past its length).
    """
    rows = {}
    for name in runs[0]["val_loss"]:
        values = [list(column) for column in zip(*(run["val_loss"][name] for run in runs), strict=True)]
        present = [None if None in column else column for column in values]
        rows[name] = {"values": values,
                      "mean": [None if c is None else statistics.fmean(c) for c in present],
                      "std": [None if c is None else statistics.stdev(c) for c in present]}
    return {"seeds": [run["seed"] for run in runs], "lengths": runs[0]["lengths"],
            "train_context": runs[0]["train_context"], "attention": runs[0]["attention"], "sizes": runs[0]["sizes"],
            "finetune_steps": runs[0]["finetune_steps"], "rows": rows}


def markdown(table: dict) -> str:
    """The Markdown table: one row per model, ``mean ± std`` per length, ``n/a`` where there is none."""
    head = "| model | " + " | ".join(f"{n // table['train_context']}× ({n})" for n in table["lengths"]) + " |"
    lines = [head, "|---|" + "---:|" * len(table["lengths"])]
    for name, row in table["rows"].items():
        cells = ["n/a" if m is None else f"{m:.3f} ± {s:.3f}" for m, s in zip(row["mean"], row["std"], strict=True)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def spread_png(table: dict, title: str, rows: list[str] | None = None) -> bytes:
    """PNG bytes: mean loss against evaluation length (log2 axis) with ±1 std error bars, one line per row."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.4), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    lengths = table["lengths"]
    for i, name in enumerate(rows or list(table["rows"])):
        row = table["rows"][name]
        points = [(n, m, s) for n, m, s in zip(lengths, row["mean"], row["std"], strict=True) if m is not None]
        xs, means, stds = zip(*points, strict=True)
        axes.errorbar(xs, means, yerr=stds, marker="o", markersize=3, capsize=3, color=f"C{i % 10}",
                      linestyle="-" if i < 10 else "--", label=name)
    axes.set_xscale("log", base=2)
    axes.set_xticks(lengths, [str(n) for n in lengths])
    axes.axvline(table["train_context"], color="gray", linestyle=":", linewidth=1)
    axes.set_xlabel("evaluation length (characters); dotted: training length")
    axes.set_ylabel("validation loss (nats / character)")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def write(out: str | Path, folders: list[str | Path], rows: list[str] | None = None) -> dict:
    """Read the runs, write ``spread.json``, ``spread.md`` and ``spread.png`` into ``out``; return the table.

    ``rows`` limits the figure to those rows (the table and JSON keep them all).
    """
    out = Path(out)
    for folder in folders:
        inside = out.resolve() == Path(folder).resolve() or Path(folder).resolve() in out.resolve().parents
        if inside:
            raise ValueError(f"OUT {str(out)!r} lies in the run {str(folder)!r}: choose a folder of its own")
    table = spread(load_runs(folders))
    unknown = [name for name in rows or () if name not in table["rows"]]
    if unknown:
        raise ValueError(f"--rows: {', '.join(unknown)} not among the runs' rows {', '.join(table['rows'])}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT {str(out)!r} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    seeds = ", ".join(map(str, table["seeds"]))
    title = (f"trained at {table['train_context']} chars ({table['attention']} attention), mean ± std over seeds "
             f"{seeds}")
    write_bytes_atomic(out / "spread.png", spread_png(table, title, rows))
    write_bytes_atomic(out / "spread.md", markdown(table).encode())
    write_bytes_atomic(out / "spread.json", (json.dumps(table, indent=2, allow_nan=False) + "\n").encode())
    return table


USAGE = "usage: python -m ropekit_lab.spread [--rows A,B,...] OUT RUN RUN [RUN ...]   (RUN: an extrapolate --out)"


def main(argv: list[str] | None = None) -> int:
    """``python -m ropekit_lab.spread [--rows LIST] OUT RUN [RUN ...]``; 0, or 2 with one line on stderr."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rows = None
    if argv[:1] == ["--rows"] and len(argv) > 1:
        rows, argv = [name for name in argv[1].split(",") if name], argv[2:]
    if len(argv) < 3 or any(arg.startswith("-") for arg in argv):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        table = write(argv[0], argv[1:], rows)
    except (ValueError, OSError) as exc:
        print(f"ropekit_lab.spread: error: {exc}", file=sys.stderr)
        return 2
    print(markdown(table), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
