"""``ropekit convert``: a checkpoint's q/k projections between the two layouts (:mod:`ropekit.checkpoints`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .requirements import declare_requirements

#: What installs the module the verb reads and writes checkpoints with.
CONVERT_INSTALL = "pip install 'ropekit[convert]'"
#: The pairings ``--to``/``--from`` accept (``ropekit.validation.LAYOUTS``; spelled out here so that
#: ``--help`` does not import torch).
LAYOUTS = ("half", "interleaved")


def add_parser(verbs: Any) -> argparse.ArgumentParser:
    """Register the ``convert`` verb on an ``argparse`` subparsers object (``func=run``)."""
    p = verbs.add_parser(
        "convert",
        help="permute a checkpoint's q/k projections between the half and interleaved RoPE layouts",
        description="Permute the q/k projection rows of a checkpoint (safetensors, sharded, .bin/.pth) between the "
        "half and interleaved RoPE layouts; every other tensor is copied bit for bit.",
    )
    p.add_argument("src", help="a .safetensors/.bin/.pth file, a *.index.json or a model directory")
    p.add_argument("dst", help="a .safetensors file (single-file input) or a directory (created if missing)")
    p.add_argument("--to", dest="dst_layout", required=True, choices=LAYOUTS, help="layout to write")
    p.add_argument("--from", dest="src_layout", choices=LAYOUTS,
                   help="layout of SRC (default: its ropekit metadata or the config next to it; required without)")
    p.add_argument("--config", help="a config.json or params.json, in addition to the one next to SRC (always read)")
    p.add_argument("--heads", type=int, help="number of query heads (default: from the config)")
    p.add_argument("--kv-heads", type=int, help="number of key/value heads (default: config, else the k rows)")
    p.add_argument("--head-dim", type=int, help="channels per head (default: config, else the q rows / --heads)")
    p.add_argument("--rotary-dim", type=int, help="rotated channels per head (default: config, else head_dim)")
    p.add_argument("--q-pattern",
                   help="regex selecting q projections (default: q_proj / attention.wq weights and biases)")
    p.add_argument("--k-pattern",
                   help="regex selecting k projections (default: k_proj / attention.wk weights and biases)")
    p.add_argument("--force", action="store_true", help="replace an existing output (never the input)")
    p.add_argument("--verify", action="store_true", help="read the written files back and check attention scores "
                   "before anything is moved into place")
    p.add_argument("--skip-layout-check", action="store_true",
                   help="convert even when SRC's q/k weights say it is already in the --to layout (the weights' "
                   "pairing test, a second witness besides the config, metadata and --from; see docs/probe.md)")
    declare_requirements(p, ["safetensors"], CONVERT_INSTALL)
    p.set_defaults(func=run)
    return p


def _written(result: Any, dst: str) -> str:
    if len(result.outputs) == 1 and not result.carried:
        return str(result.outputs[0])
    shards = len(result.outputs) - len(result.carried)
    text = f"{dst} ({shards} weight/index files"
    if result.carried:
        text += f"; carried {', '.join(result.carried)}"
    if result.skipped:
        text += f"; not carried (weights): {', '.join(result.skipped)}"
    return text + ")"


def _how_to_load(result: Any, dst: str, layout: str) -> str:
    """One line: what the written config says and how to load the output (docs/models.md)."""
    config = f"{dst.rstrip('/')}/config.json"
    if result.config_record == "recorded":
        return (f"load: {config} records rope_layout {layout} (model type ropekit_{layout}), so transformers' "
                f"from_pretrained refuses it instead of rotating these rows in the other layout; load it with "
                f"ropekit.integrations.transformers.load_converted({dst!r}) (docs/models.md)")
    if result.config_record == "restored":
        return (f"load: {config} is the original transformers config again (layout record removed); "
                f"from_pretrained({dst!r}) loads it as an ordinary checkpoint")
    if "config.json" in result.carried:
        return f"load: {config} carried as it was; from_pretrained({dst!r}) loads it"
    return (f"load: q/k rows in the {layout} layout; in a transformers model of this architecture, "
            f"ropekit.integrations.transformers.patch(model, layout={layout!r}) rotates them in it (docs/models.md)")


def run(args: argparse.Namespace) -> int:
    """Run ``ropekit convert`` for parsed ``args``: 0 on success, 1 if ``--verify`` found a mismatch."""
    from ..checkpoints.convert import K_PATTERN, Q_PATTERN, HeadSpec, convert_checkpoint
    from ..validation import check_layout

    spec = HeadSpec(*(getattr(args, name, None) for name in ("heads", "kv_heads", "head_dim", "rotary_dim")))
    result = convert_checkpoint(
        args.src, args.dst, spec, dst_layout=check_layout(args.dst_layout, "--to"),
        src_layout=getattr(args, "src_layout", None), config=getattr(args, "config", None),
        q_pattern=getattr(args, "q_pattern", None) or Q_PATTERN,
        k_pattern=getattr(args, "k_pattern", None) or K_PATTERN,
        force=bool(getattr(args, "force", False)), verify=bool(getattr(args, "verify", False)),
        layout_check="skip" if getattr(args, "skip_layout_check", False) else "on",
    )
    print(f"SRC layout {result.src_layout} ({result.layout_origin}); {result.spec.describe()} "
          f"({result.geometry_origin})")
    if result.layout_evidence is not None:
        print(f"q/k weights: {result.layout_evidence.describe()}")
    if result.layout_warning:
        print(f"ropekit convert: warning: {result.layout_warning}", file=sys.stderr)
    if not result.geometry_pinned:
        print("ropekit convert: note: no config.json/params.json next to SRC and no ropekit metadata: the head "
              "geometry rests on the flags, checked against the tensor shapes only (heads x c with head_dim / c "
              "fits the same shapes; see docs/models.md)", file=sys.stderr)
    if result.verified is False:
        why = result.problems[0] if result.problems else (
            f"attention scores differ by {result.max_score_error:.3g} (relative)")
        print(f"ropekit convert: verification FAILED: {why}; nothing written", file=sys.stderr)
        return 1
    print(f"converted {len(result.converted)} q/k tensors {result.src_layout} -> {args.dst_layout}; "
          f"wrote {_written(result, args.dst)}")
    if result.verified:
        print(f"verified: written files read back, attention scores equal "
              f"(max relative difference {result.max_score_error:.2e})")
    print(_how_to_load(result, str(args.dst), args.dst_layout))
    return 0
