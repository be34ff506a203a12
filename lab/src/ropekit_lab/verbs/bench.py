"""``ropekit bench``: every backend and installed peer against a plain copy (:mod:`ropekit_lab.bench`).

The text output starts with one line when the machine was too busy to measure
(:func:`ropekit_lab.bench_rows.busy_notice`) and ends with how the rows were measured.
"""

from __future__ import annotations

import argparse
from typing import Any

from ropekit.cli import positive, print_json

from .common import MAX_THREADS

MAX_BUDGET_S = 24 * 3600.0


def add_parser(verbs: Any) -> None:
    """Register the ``bench`` verb on the ``ropekit`` subparsers."""
    bench = verbs.add_parser(
        "bench", help="speed of every backend against a plain copy",
        description="Time every rotation backend (C++ on the CPU, Triton on CUDA, eager torch) and each installed "
        "peer (transformers' eager recipe, torch.compile of it, Liger on a GPU) on q/k shapes of real models, "
        "forward and forward + backward, against a plain copy of the same bytes; on a decode step also the fused "
        "forms (q/k RMSNorm + rotation, keys rotated into a KV cache) beside transformers' eager and compiled "
        "recipes for them. Print each row's time, its uncertainty, GB/s and the ratio to the copy. torch.compile "
        "peers run in the full sweep only (compiled once per case, warmed up, then timed like the other rows); "
        "--quick leaves them out, since compiling takes tens of seconds a case.")
    bench.add_argument("--quick", action="store_true",
                       help="small shapes, few repeats, no torch.compile peers (nothing is compiled)")
    bench.add_argument("--device", choices=("cpu", "cuda"), help="default: CUDA when available")
    bench.add_argument("--threads", type=positive(int, MAX_THREADS), metavar="N",
                       help="CPU threads (default: torch's default)")
    bench.add_argument("--budget", type=positive(float, MAX_BUDGET_S), metavar="SECONDS",
                       help="seconds of timed rounds in all, after which a time still uncertain stays flagged "
                            "noisy (default: 6 with --quick, 180 without)")
    bench.add_argument("--json", action="store_true", help="machine-readable output")
    bench.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Time every backend against a plain copy of the same bytes (see :mod:`ropekit_lab.bench`)."""
    import torch

    from .. import bench

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = bench.run(quick=args.quick, device=args.device, budget_s=args.budget)
    if args.json:
        print_json(rows)
    else:
        print(bench.format_table(rows))
    return 0
