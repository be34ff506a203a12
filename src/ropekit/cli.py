"""The ``ropekit`` command line: ``ropekit <verb> [options]``.

Verbs: ``inspect`` (a config's rotary frequencies, pair by pair), ``decay`` (RoFormer's long-term
decay bound), ``report`` (an HTML page with figures and live checks), ``bench`` (speed table),
``convert``, ``train`` and ``extrapolate``. Each verb is a small function; the numbers come from
:mod:`ropekit.tools`. Arguments are parsed before torch is imported (``--help`` and ``--version``
never import it); each verb imports its machinery when it runs.

How a run ends, whatever the verb (:func:`main` applies the rule, the verbs do not):

- exit 0, or 1 for a report whose live checks fail;
- exit 2 and one line ``ropekit <verb>: error: <message>`` on stderr for bad input: a usage error
  (argparse), a :class:`UserError`, a ``ValueError``/``TypeError``/``OSError`` raised by a
  ``raise`` statement in ropekit's own code (the library's validation, whose messages name the
  argument, what was expected and what was given), and an ``OSError`` on a path the user named
  (that path, a file inside it, or a folder on the way to it: permission denied, disk full, ...);
- exit 130 and ``ropekit <verb>: interrupted`` on Ctrl-C;
- anything else is a bug and keeps Python's traceback (exit 1): ``KeyError``, ``AttributeError``,
  ``RuntimeError``, a ``ValueError`` raised inside torch or by a builtin such as ``int("x")``, an
  ``OSError`` on one of ropekit's own files.

Output folders and files a verb declares (``--out``, ``decay --png``) are checked before the verb
runs (:mod:`ropekit.tools.outputs`); an output folder the run created is removed again when the
run fails or is interrupted and the folder is still empty.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from .cli_errors import Parser, UserError, user_error_message
from .tools.lab_options import add_extrapolate_parser, add_train_parser
from .tools.outputs import add_out_argument, declare_output_file, prepared_outputs

# -- input -------------------------------------------------------------------------------------------


def load_config(path: str | None, preset: str | None, layer_type: str | None = None) -> tuple[Any, str]:
    """``(RopeConfig, label)`` from a ``config.json`` path or a preset name (default: the ``default`` preset)."""
    from .config import RopeConfig
    from .tools.presets import get_preset

    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UserError(f"config file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read {path}: {exc}") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
        if not isinstance(raw, dict):
            raise UserError(f"{path} must hold a JSON object (a config.json), got {type(raw).__name__}")
        label = str(raw.get("_name_or_path") or path)
    else:
        raw = get_preset(preset or "default")
        label = raw["_name_or_path"] + ("" if preset is None else f" [preset {preset}]")
    try:
        return RopeConfig.from_hf(raw, layer_type=layer_type), label
    except (ValueError, TypeError) as exc:
        message = str(exc).replace("pass layer_type=", "pass --layer-type")
        raise UserError(f"{path or 'preset ' + str(preset)}: {message}") from None


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _one_thread() -> Any:
    """Import torch and run on one thread (the analyses are many small ops: faster on small machines)."""
    import torch

    torch.set_num_threads(1)
    return torch


def _number(value: float) -> str:
    """``500,000`` for an integral value, else ``%g``."""
    return f"{int(value):,}" if float(value).is_integer() and abs(value) < 1e15 else f"{value:g}"


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, allow_nan=False))


# -- verbs -------------------------------------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a config's rotary embedding: dimensions, rule, attention scale and a table per pair."""
    _one_thread()
    from .tools.analysis import describe

    config, label = load_config(args.config, args.preset, args.layer_type)
    info = describe(config, context=args.context, seq_len=args.seq_len, bound=not args.no_bound)
    info = {"source": label, **info}
    if args.json:
        _print_json(info)
        return 0
    print(f"{label}")
    print(f"  layout {info['layout']}, head_dim {info['head_dim']}, rotary_dim {info['rotary_dim']}, "
          f"base {_number(info['base'])}, rope type {info['rope_type']}")
    for key, value in info["rope_parameters"].items():
        shown = f"[{len(value)} values: {value[0]:.4g} .. {value[-1]:.4g}]" if isinstance(value, list) else value
        print(f"    {key} = {shown}")
    print(f"  attention scale {info['attention_scale']:.6g} on cos and sin (logits x{info['logit_scale']:.6g})")
    print(f"  context {info['context']:,} tokens ({info['context_source']}); "
          f"frequencies at seq_len {info['seq_len']:,}")
    regime, scaled = info["regime"], info["rope_type"] != "default"
    head = f"  {'pair':>4} {'theta_i':>11} {'inv_freq':>11} {'wavelength':>12} {'rotations':>11}"
    print(head + (f" {'theta/inv':>9}" if scaled else "") + (f"  {'regime'}" if regime else ""))
    for i in range(info["pairs"]):
        wavelength = info["wavelength"][i]
        line = (f"  {i:>4} {info['theta'][i]:>11.4e} {info['inv_freq'][i]:>11.4e} "
                f"{'inf' if wavelength is None else format(wavelength, '12.1f'):>12} {info['rotations'][i]:>11.3f}")
        if scaled:
            ratio = info["interpolation"][i]
            line += f" {'inf' if ratio is None else format(ratio, '9.3f'):>9}"
        print(line + (f"  {regime[i]}" if regime else ""))
    _print_inspect_summary(info)
    return 0


def _print_inspect_summary(info: dict) -> None:
    context = info["context"]
    print(f"  {info['pairs_without_full_rotation']} of {info['pairs']} pairs never complete a rotation within "
          f"{context:,} tokens")
    pre = info["pretraining"]
    if pre:
        print(f"  {pre['pairs_without_full_rotation']} of {info['pairs']} unscaled pairs never complete a rotation "
              f"within the {pre['context']:,}-token pre-training context")
    for name, bound in (("context", info["base_lower_bound"]), ("pre-training context", (pre or {}).get(
            "base_lower_bound"))):
        if bound:
            needed = "none found below 1e15" if bound["base"] is None else f"{bound['base']:.3g}"
            if not bound["exact_positions"]:
                needed += " (approximate: positions subsampled)"
            print(f"  base needed for the {bound['context']:,}-token {name} (Men et al. 2024, arXiv:2405.14591): "
                  f"{needed} (this config: {_number(info['base'])})")
    negative = info["similarity_negative_at"]
    print("  B_m = sum_i cos(m theta_i) with these frequencies: "
          + (f"first negative at m = {negative:,}" if negative is not None else f"non-negative up to {context:,}"))


def cmd_decay(args: argparse.Namespace) -> int:
    """RoFormer's long-term decay bound (seed 001, eq. 37) for each distance 0..N."""
    if args.dim <= 0 or args.dim % 2:
        raise UserError(f"--dim must be a positive even number (the rotary dimension), got {args.dim}")
    if not 0 <= args.max_distance <= 10_000_000:
        raise UserError(f"--max-distance must be in 0..10,000,000, got {args.max_distance:,}")
    if args.png and importlib.util.find_spec("matplotlib") is None:
        raise UserError("--png needs matplotlib: pip install 'ropekit[report]'")
    torch = _one_thread()
    from .frequencies import base_inv_freq
    from .tools.analysis import decay_bound

    inv_freq = base_inv_freq(args.dim, args.base)
    distance = torch.arange(args.max_distance + 1)
    bound = decay_bound(inv_freq, distance)
    if args.png:
        from .tools.figures import decay_curve_figure
        from .tools.files import write_bytes_atomic

        write_bytes_atomic(args.png, decay_curve_figure(distance, bound, f"d={args.dim}, base {_number(args.base)}"))
    if args.json:
        _print_json({"dim": args.dim, "base": args.base, "distance": distance.tolist(), "bound": bound.tolist()})
        return 0
    print(f"RoFormer long-term decay bound, d={args.dim}, base {_number(args.base)}: (1/(d/2)) sum_j |S_j|, "
          "S_j = sum_{i<j} exp(1j r theta_i)")
    shown = sorted({0, args.max_distance} | {2**k for k in range(64) if 2**k < args.max_distance})
    for r in shown:
        print(f"  r = {r:>10,}  bound {float(bound[r]):9.4f}")
    print(f"  minimum {float(bound.min()):.4f} at r = {int(bound.argmin()):,}")
    if args.png:
        print(f"  figure: {args.png}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Write the HTML report (figures, live checks, speed table) and print the path of index.html."""
    _one_thread()
    from .tools.report import write_report

    config, label = load_config(args.config, args.preset, args.layer_type)
    summary = write_report(args.out, config, label, quick=args.quick)
    if args.json:
        _print_json(summary)
    else:
        failed = [c["name"] for c in summary["checks"] if not c["passed"]]
        print(summary["index"])
        if failed:
            print(f"ropekit report: {len(failed)} live checks failed: {', '.join(failed)}", file=sys.stderr)
    return 0 if all(c["passed"] for c in summary["checks"]) else 1


def cmd_bench(args: argparse.Namespace) -> int:
    """Time every backend against a plain copy of the same bytes (see ropekit.tools.bench)."""
    import torch

    from .tools import bench

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = bench.run(quick=args.quick, device=args.device)
    if args.json:
        _print_json(rows)
    else:
        print(bench.format_table(rows))
    return 0


# -- parser ------------------------------------------------------------------------------------------


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    from .tools.presets import preset_names

    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", metavar="PATH", help="a model's config.json (any form RopeConfig.from_hf reads)")
    source.add_argument("--preset", metavar="NAME", help=f"a named config: {', '.join(preset_names())}")
    parser.add_argument("--layer-type", metavar="TYPE",
                        help="which rope parameters of a per-layer-type config (e.g. full_attention)")


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    from .tools.presets import preset_names

    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", metavar="PATH", help="a model's config.json (any form RopeConfig.from_hf reads)")
    source.add_argument("--preset", metavar="NAME", help=f"a named config: {', '.join(preset_names())}")
    parser.add_argument("--layer-type", metavar="TYPE",
                        help="which rope parameters of a per-layer-type config (e.g. full_attention)")


#: Verbs whose parser lives in a module that imports torch: imported only when they are the verb to run,
#: else listed by name and help line. The help line must match the module's (tests compare them).
_TORCH_PARSERS = {
    "convert": ("ropekit.tools.convert",
                "permute a checkpoint's q/k projections between the half and interleaved RoPE layouts"),
}


def _add_inspect(verbs: Any) -> None:
    inspect = verbs.add_parser("inspect", help="a config's rotary frequencies, pair by pair",
                               description="Print a config's RoPE: layout, dimensions, base, scaling rule, attention "
                               "scale, and per pair theta_i, wavelength, rotations in the context and regime.")
    _config_arguments(inspect)
    inspect.add_argument("--context", type=_positive(int), help="context window in tokens (default: from the config)")
    inspect.add_argument("--seq-len", type=_positive(int), help="length at which dynamic rules are evaluated "
                         "(default: the context)")
    inspect.add_argument("--no-bound", action="store_true", help="skip the base-bound search (Men et al. 2024)")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(func=cmd_inspect)


def _add_decay(verbs: Any) -> None:
    decay = verbs.add_parser("decay", help="RoFormer's long-term decay bound against distance",
                             description="(1/(d/2)) sum_{j=1..d/2} |S_j|, S_j = sum_{i<j} exp(1j r theta_i), "
                             "for r = 0..N (RoFormer eq. 37, Figure 2).")
    decay.add_argument("--dim", type=int, required=True, help="rotary dimension d (even)")
    decay.add_argument("--base", type=_positive(float), default=10000.0, help="RoPE base (default 10000)")
    decay.add_argument("--max-distance", type=int, required=True, metavar="N", help="largest relative distance")
    decay.add_argument("--png", metavar="PATH", help="also draw the curve into this PNG file")
    decay.add_argument("--json", action="store_true", help="machine-readable output: keys distance and bound")
    declare_output_file(decay, "png", "--png")
    decay.set_defaults(func=cmd_decay)


def _add_report(verbs: Any) -> None:
    report = verbs.add_parser("report", help="an HTML report with figures and live checks",
                              description="Write DIR/index.html and PNG figures about a RoPE config (default: head_dim "
                              "128, base 10000, 4096 tokens) and print the path.")
    add_out_argument(report, "ropekit-report")
    _config_arguments(report)
    report.add_argument("--quick", action="store_true", help="small sizes: under a minute on two cores")
    report.add_argument("--json", action="store_true", help="print a JSON summary instead of the path")
    report.set_defaults(func=cmd_report)


def _add_bench(verbs: Any) -> None:
    bench = verbs.add_parser("bench", help="speed of every backend against a plain copy")
    bench.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    bench.add_argument("--device", choices=("cpu", "cuda"), help="default: CUDA when available")
    bench.add_argument("--threads", type=_positive(int), metavar="N", help="CPU threads (default: torch's default)")
    bench.add_argument("--json", action="store_true", help="machine-readable output")
    bench.set_defaults(func=cmd_bench)


def build_parser(verb: str | None = None, *, lazy: bool = False) -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per verb.

    With ``lazy``, the verbs in :data:`_TORCH_PARSERS` other than ``verb`` (the verb about to run,
    ``None`` for none) get a placeholder with their help line, so that parsing any other command
    line, ``--help`` included, does not import torch.
    """
    from . import __version__

    parser = Parser(prog="ropekit", description="Rotary Position Embedding toolkit.")
    parser.add_argument("--version", action="version", version=f"ropekit {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="<verb>")
    for add in (_add_inspect, _add_decay, _add_report, _add_bench):
        add(verbs)
    for name, (module, help_line) in _TORCH_PARSERS.items():
        if not lazy or verb == name:
            importlib.import_module(module).add_parser(verbs)
        else:
            verbs.add_parser(name, help=help_line)
    add_train_parser(verbs)
    add_extrapolate_parser(verbs)
    return parser


# -- how a run ends ----------------------------------------------------------------------------------


def _verb_in(argv: list[str]) -> str | None:
    """The verb of a command line (the first word that is not an option), before parsing."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ropekit`` console script and ``python -m ropekit``; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    verb = _verb_in(argv)
    args = None
    try:
        args = build_parser(verb, lazy=True).parse_args(argv)
        with prepared_outputs(args):
            return args.func(args)
    except KeyboardInterrupt:
        print(f"{'ropekit ' + verb if verb else 'ropekit'}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`ropekit inspect ... | head`): nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 1
    except (UserError, ValueError, TypeError, OSError) as exc:
        message = None if args is None else user_error_message(exc, args)
        if message is None:
            raise
        print(f"ropekit {args.verb}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
