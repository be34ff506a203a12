"""``ropekit inspect``: a config's rotary embedding, pair by pair (its JSON: :mod:`ropekit.cli.inspect_json`)."""

from __future__ import annotations

import argparse
from typing import Any

from .common import MAX_POSITION, config_arguments, load_config, number, one_thread, positive, print_json


def add_parser(verbs: Any) -> None:
    """Register the ``inspect`` verb on the ``ropekit`` subparsers."""
    inspect = verbs.add_parser("inspect", help="a config's rotary frequencies, pair by pair",
                               description="Print a config's RoPE: layout, dimensions, base, scaling rule, attention "
                               "scale, and per pair theta_i, wavelength, rotations in the context and regime; "
                               "for multi-axis RoPE (M-RoPE, axial) each pair's axis and the wavelengths per axis.")
    config_arguments(inspect)
    inspect.add_argument("--context", type=positive(int, MAX_POSITION), help="context window in tokens "
                         "(default: from the config; at most 2**40)")
    inspect.add_argument("--seq-len", type=positive(int, MAX_POSITION), help="length at which dynamic rules are "
                         "evaluated (default: the context)")
    inspect.add_argument("--no-bound", action="store_true", help="skip the base-bound search (Men et al. 2024)")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print a config's rotary embedding: dimensions, rule, attention scale and a table per pair."""
    one_thread()
    from .inspect_json import describe

    config, label = load_config(args.config, args.preset, args.layer_type)
    info = describe(config, context=args.context, seq_len=args.seq_len, bound=not args.no_bound)
    info = {"source": label, **info}
    if args.json:
        print_json(info)
        return 0
    print(f"{label}")
    print(f"  layout {info['layout']}, head_dim {info['head_dim']}, rotary_dim {info['rotary_dim']}, "
          f"base {number(info['base'])}, rope type {info['rope_type']}")
    for key, value in info["rope_parameters"].items():
        shown = f"[{len(value)} values: {value[0]:.4g} .. {value[-1]:.4g}]" if isinstance(value, list) else value
        print(f"    {key} = {shown}")
    print(f"  attention scale {info['attention_scale']:.6g} on cos and sin (logits x{info['logit_scale']:.6g})")
    print(f"  context {info['context']:,} tokens ({info['context_source']}); "
          f"frequencies at seq_len {info['seq_len']:,}")
    if info["layer_schedule"]:
        _print_layer_schedule(info["layer_schedule"])
    axes = info["axes"]
    if axes:
        _print_axes(axes)
    regime, scaled = info["regime"], info["rope_type"] != "default"
    head = f"  {'pair':>4}" + (f" {'axis':>6}" if axes else "")
    head += f" {'theta_i':>11} {'inv_freq':>11} {'wavelength':>12} {'rotations':>11}"
    print(head + (f" {'theta/inv':>9}" if scaled else "") + (f"  {'regime'}" if regime else ""))
    for i in range(info["pairs"]):
        wavelength = info["wavelength"][i]
        line = f"  {i:>4}" + (f" {axes['pair_axis'][i]:>6}" if axes else "")
        line += (f" {info['theta'][i]:>11.4e} {info['inv_freq'][i]:>11.4e} "
                 f"{'inf' if wavelength is None else format(wavelength, '12.1f'):>12} {info['rotations'][i]:>11.3f}")
        if scaled:
            ratio = info["interpolation"][i]
            line += f" {'inf' if ratio is None else format(ratio, '9.3f'):>9}"
        print(line + (f"  {regime[i]}" if regime else ""))
    _print_inspect_summary(info)
    return 0


def _print_layer_schedule(schedule: dict) -> None:
    rope, nope = schedule["rope_layers"], schedule["nope_layers"]
    shown = ", ".join(map(str, nope[:8])) + (f", ... ({len(nope)} in all)" if len(nope) > 8 else "")
    print(f"  layers: {schedule['layers']}; RoPE on {len(rope)}, none (NoPE) on {len(nope)}"
          + (f": {shown}" if nope else ""))
    if schedule["attention_chunk_size"] is not None:
        print(f"    RoPE layers attend in chunks of {schedule['attention_chunk_size']:,} tokens (not RoPE: "
              "transformers' mask)")
    tuning = schedule["temperature_tuning"]
    if tuning is not None:
        print(f"    NoPE layers scale q by 1 + {tuning['attn_scale']} * log(1 + floor((p + 1) / "
              f"{tuning['floor_scale']})) at position p (not RoPE: transformers' attention)")


def _print_axes(axes: dict) -> None:
    names = ", ".join(f"{a['name']} ({a['pairs']} pairs)" for a in axes["per_axis"])
    print(f"  multi-axis: positions are ({', '.join(axes['names'])}) vectors; axes {names}")
    for a in axes["per_axis"]:
        if not a["pairs"]:
            print(f"    axis {a['name']}: no pair")
            continue
        shown = a["pair_indices"]
        where = (f"pairs {a['first_pair']}..{a['last_pair']}" if a["contiguous"] else
                 "pairs " + ", ".join(map(str, shown[:3])) + (f", ..., {shown[-1]}" if len(shown) > 3 else "")
                 + " (interleaved with the other axes)")
        shortest = "inf" if a["wavelength_min"] is None else f"{a['wavelength_min']:.4g}"
        longest = "inf" if a["wavelength_max"] is None else f"{a['wavelength_max']:.4g}"
        print(f"    axis {a['name']}: {a['pairs']} pairs, {where}; wavelengths {shortest} .. {longest} "
              f"positions; {a['pairs_without_full_rotation']} never complete a rotation within the context")


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
                  f"{needed} (this config: {number(info['base'])})")
    negative = info["similarity_negative_at"]
    print("  B_m = sum_i cos(m theta_i) with these frequencies: "
          + (f"first negative at m = {negative:,}" if negative is not None else f"non-negative up to {context:,}"))
