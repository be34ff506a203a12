"""``ropekit decay``: RoFormer's long-term decay bound against distance (eq. 37, Figure 2)."""

from __future__ import annotations

import argparse
from typing import Any

from .common import MAX_ROTARY_DIM, number, one_thread, positive, print_json
from .errors import UserError
from .outputs import declare_output_file
from .requirements import declare_requirements

#: What installs the module ``--png`` draws with.
PLOT_INSTALL = "pip install 'ropekit[plot]'"
#: The most ``(distances x pairs)`` terms one run sums: ``--max-distance`` 10,000,000 at ``--dim`` 256.
MAX_TERMS = 10_000_001 * 128


def add_parser(verbs: Any) -> None:
    """Register the ``decay`` verb on the ``ropekit`` subparsers."""
    decay = verbs.add_parser("decay", help="RoFormer's long-term decay bound against distance",
                             description="(1/(d/2)) sum_{j=1..d/2} |S_j|, S_j = sum_{i<j} exp(1j r theta_i), "
                             "for r = 0..N (RoFormer eq. 37, Figure 2).")
    decay.add_argument("--dim", type=int, required=True, help="rotary dimension d (even)")
    decay.add_argument("--base", type=positive(float), default=10000.0, help="RoPE base (default 10000)")
    decay.add_argument("--max-distance", type=int, required=True, metavar="N", help="largest relative distance")
    decay.add_argument("--png", metavar="PATH", help="also draw the curve into this PNG file")
    decay.add_argument("--json", action="store_true", help="machine-readable output: keys distance and bound")
    declare_output_file(decay, "png", "--png")
    declare_requirements(decay, ["matplotlib"], PLOT_INSTALL, when="png")
    decay.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """RoFormer's long-term decay bound (Su et al. 2021, eq. 37) for each distance 0..N."""
    if args.dim <= 0 or args.dim % 2 or args.dim > MAX_ROTARY_DIM:
        raise UserError(f"--dim must be a positive even number (the rotary dimension) <= {MAX_ROTARY_DIM:,}, got "
                        f"{args.dim:,}")
    if not 0 <= args.max_distance <= 10_000_000:
        raise UserError(f"--max-distance must be in 0..10,000,000, got {args.max_distance:,}")
    if (args.max_distance + 1) * (args.dim // 2) > MAX_TERMS:
        raise UserError(f"--dim {args.dim:,} with --max-distance {args.max_distance:,} sums "
                        f"{(args.max_distance + 1) * (args.dim // 2):,} terms; at most {MAX_TERMS:,} (e.g. "
                        f"--max-distance {MAX_TERMS // (args.dim // 2) - 1:,} at this --dim)")
    torch = one_thread()
    from ..rope.analysis import decay_bound
    from ..rope.frequencies import base_inv_freq

    inv_freq = base_inv_freq(args.dim, args.base)
    distance = torch.arange(args.max_distance + 1)
    bound = decay_bound(inv_freq, distance)
    if args.png:
        from ..files import write_bytes_atomic
        from .decay_figure import decay_curve_figure

        write_bytes_atomic(args.png, decay_curve_figure(distance, bound, f"d={args.dim}, base {number(args.base)}"))
    if args.json:
        print_json({"dim": args.dim, "base": args.base, "distance": distance.tolist(), "bound": bound.tolist()})
        return 0
    print(f"RoFormer long-term decay bound, d={args.dim}, base {number(args.base)}: (1/(d/2)) sum_j |S_j|, "
          "S_j = sum_{i<j} exp(1j r theta_i)")
    shown = sorted({0, args.max_distance} | {2**k for k in range(64) if 2**k < args.max_distance})
    for r in shown:
        print(f"  r = {r:>10,}  bound {float(bound[r]):9.4f}")
    print(f"  minimum {float(bound.min()):.4f} at r = {int(bound.argmin()):,}")
    if args.png:
        print(f"  figure: {args.png}")
    return 0
