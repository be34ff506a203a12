"""``ropekit report``: the HTML report on a config (:mod:`ropekit_lab.report`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ropekit.cli import add_out_argument, config_arguments, load_config, one_thread, print_json

from .common import FIGURES, needs


def add_parser(verbs: Any) -> None:
    """Register the ``report`` verb on the ``ropekit`` subparsers."""
    report = verbs.add_parser("report", help="an HTML report with figures and live checks",
                              description="Write DIR/index.html and PNG figures about a RoPE config (default: head_dim "
                              "128, base 10000, 4096 tokens) and print the path.")
    add_out_argument(report, "ropekit-report")
    config_arguments(report)
    report.add_argument("--quick", action="store_true", help="small sizes: under a minute on two cores")
    report.add_argument("--json", action="store_true", help="print a JSON summary instead of the path")
    needs(report, FIGURES)
    report.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the HTML report (figures, live checks, speed table) and print the path of index.html."""
    one_thread()
    from ..report import write_report

    config, label = load_config(args.config, args.preset, args.layer_type)
    summary = write_report(args.out, config, label, quick=args.quick)
    if args.json:
        print_json(summary)
    else:
        failed = [c["name"] for c in summary["checks"] if not c["passed"]]
        print(summary["index"])
        if failed:
            print(f"ropekit report: {len(failed)} live checks failed: {', '.join(failed)}", file=sys.stderr)
    return 0 if all(c["passed"] for c in summary["checks"]) else 1
