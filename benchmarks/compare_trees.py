"""Two source trees of ropekit timed against their floors in one run (a standalone script, not a test).

Runs ``benchmarks/cpu_floor.py --json`` (this checkout's copy) once per tree and round, the trees
alternating and their order swapped every round, each in its own process with the tree's
``src`` first on ``PYTHONPATH``: drift on a shared machine then hits both alike. Reports, per
shape, dtype and thread count, the median over rounds of each tree's ratio to the floors
(in place / ``x.mul_(1.0)``, out of place / ``x.clone()``) with the spread (min-max), and the
decode step's time. Usage (e.g. the previous commit against the working tree)::

    mkdir ../old && git archive <commit> src | tar -x -C ../old
    python benchmarks/compare_trees.py --old ../old/src --new src [--rounds 5] [--repeats 30]

Prints a Markdown table; ``--json PATH`` also writes every measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

FLOOR_SCRIPT = Path(__file__).resolve().parent / "cpu_floor.py"


def run_tree(src: Path, repeats: int, threads: list[int], shapes: list[str]) -> list[dict]:
    """One cpu_floor.py run with ``src`` as ropekit: its JSON rows."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    command = [sys.executable, str(FLOOR_SCRIPT), "--json", "--repeats", str(repeats), "--threads",
               *map(str, threads), "--shapes", *shapes]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def spread(values: list[float], digits: int = 2) -> str:
    """``median (min-max)``."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    """Measure, then print the comparison table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="src directory of the tree replaced")
    parser.add_argument("--new", type=Path, required=True, help="src directory of the tree replacing it")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shapes", nargs="+", default=["prefill", "decode"])
    parser.add_argument("--json", type=Path, help="write every measurement here")
    args = parser.parse_args()
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    rows: dict[tuple, dict[str, list[dict]]] = {}
    for round_index in range(args.rounds):
        order = ["old", "new"] if round_index % 2 == 0 else ["new", "old"]
        for name in order:
            for row in run_tree(trees[name], args.repeats, args.threads, args.shapes):
                key = (row["shape"], row["dtype"], row["threads"])
                rows.setdefault(key, {"old": [], "new": []})[name].append(row)
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps({" ".join(map(str, k)): v for k, v in rows.items()}, indent=1))
    print("| shape | dtype | threads | in-place ratio, old | new | out-of-place ratio, old | new | "
          "ropekit in place ms, old | new | out of place ms, old | new |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (shape, dtype, threads), by in rows.items():
        cells = [spread([r["in_ratio"] for r in by[t]]) for t in ("old", "new")]
        cells += [spread([r["out_ratio"] for r in by[t]]) for t in ("old", "new")]
        cells += [spread([r["ms"]["ropekit inplace"] for r in by[t]], 3) for t in ("old", "new")]
        cells += [spread([r["ms"]["ropekit out"] for r in by[t]], 3) for t in ("old", "new")]
        print(f"| {shape} | {dtype} | {threads} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
