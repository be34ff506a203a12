"""The ``ropekit`` command line: ``ropekit <verb> [options]``.

Each verb lives in a small function; errors in user input end with a one-line
message and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch


class UserError(Exception):
    """Bad input from the command line: printed as one line, exit code 2."""


def _default_summary() -> dict:
    from .frequencies import inv_frequencies

    head_dim, base, context = 128, 10000.0, 4096
    inv_freq, scale = inv_frequencies(head_dim, base)
    wavelength = 2 * math.pi / inv_freq
    return {
        "config": {"head_dim": head_dim, "rotary_dim": head_dim, "base": base, "layout": "half",
                   "rope_type": "default", "attention_scale": scale, "context": context},
        "pairs": head_dim // 2,
        "theta_max": float(inv_freq[0]),
        "theta_min": float(inv_freq[-1]),
        "wavelength_min": float(wavelength[0]),
        "wavelength_max": float(wavelength[-1]),
        "pairs_without_full_rotation": int((wavelength > context).sum()),
    }


def cmd_report(args: argparse.Namespace) -> int:
    """Summarise the default configuration and verify the seeds' claims live."""
    from .tools.checks import run_all
    from .tools.precision import bf16_error_comparison

    torch.set_num_threads(1)
    summary = _default_summary()
    checks = run_all()
    precision = {start: bf16_error_comparison(positions_start=start) for start in (20000, 1_000_000)}
    if args.json:
        print(json.dumps({**summary, "checks": [c.as_dict() for c in checks],
                          "bf16_precision": {str(k): v for k, v in precision.items()}}, indent=2))
    else:
        cfg = summary["config"]
        print(f"ropekit report: head_dim {cfg['head_dim']}, base {cfg['base']:g}, layout {cfg['layout']}, "
              f"context {cfg['context']}")
        print(f"  {summary['pairs']} rotary pairs, theta from {summary['theta_max']:.3g} to {summary['theta_min']:.3g} "
              f"rad/token; wavelengths {summary['wavelength_min']:.2f} .. {summary['wavelength_max']:.0f} tokens")
        print(f"  {summary['pairs_without_full_rotation']} pairs never complete a rotation within "
              f"{cfg['context']} tokens")
        print("  checks (measured on this machine):")
        for c in checks:
            mark = "ok  " if c.passed else "FAIL"
            print(f"    {mark} {c.name:<22} error {c.error:9.2e} (bound {c.bound:.0e})  {c.claim}")
        print("  bfloat16 mean |error| vs float64 (head_dim 128; floor = exact result rounded to bf16):")
        for start, p in precision.items():
            print(f"    positions {start:>9,}+: ropekit {p['ropekit_mean']:.3e}  transformers recipe {p['hf_mean']:.3e}"
                  f"  floor {p['floor_mean']:.3e}")
    return 0 if all(c.passed for c in checks) else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per verb."""
    parser = argparse.ArgumentParser(prog="ropekit", description="Rotary Position Embedding toolkit.")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="<verb>")
    report = verbs.add_parser("report", help="verify RoPE's properties on the default configuration")
    report.add_argument("--json", action="store_true", help="machine-readable output")
    report.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ropekit`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (UserError, ValueError, TypeError, FileNotFoundError) as exc:
        print(f"ropekit {args.verb}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
