"""What the verbs share: reading a config, argument types, printing. Torch-free at import."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from .errors import UserError

__all__ = ["MAX_POSITION", "MAX_ROTARY_DIM", "at_least", "config_arguments", "load_config", "number", "one_thread",
           "positive", "print_json"]


def load_config(path: str | None, preset: str | None, layer_type: str | None = None) -> tuple[Any, str]:
    """``(RopeConfig, label)`` from a ``config.json`` path or a preset name (default: the ``default`` preset)."""
    from ..config import RopeConfig
    from ..config.presets import get_preset

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


#: The largest position, context or sequence length the verbs accept (``ropekit.validation.MAX_POSITION``,
#: spelled out so that parsing does not import torch).
MAX_POSITION = 1 << 40
#: The largest rotary or head dimension (``ropekit.validation.MAX_ROTARY_DIM``).
MAX_ROTARY_DIM = 1 << 16


def positive(kind: type, maximum: float | None = None) -> Any:
    """An argparse type: a positive finite ``kind`` (int or float), at most ``maximum`` if given."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__} <= {maximum:,}, got {text!r}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def one_thread() -> Any:
    """Import torch and run on one thread (the analyses are many small ops: faster on small machines)."""
    import torch

    torch.set_num_threads(1)
    return torch


def number(value: float) -> str:
    """``500,000`` for an integral value, else ``%g``."""
    return f"{int(value):,}" if float(value).is_integer() and abs(value) < 1e15 else f"{value:g}"


def print_json(data: Any) -> None:
    """Print ``data`` as indented JSON (no NaN: the output is for machines)."""
    print(json.dumps(data, indent=2, allow_nan=False))


def config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config PATH | --preset NAME`` and ``--layer-type`` (read by :func:`load_config`)."""
    from ..config.presets import preset_names

    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", metavar="PATH", help="a model's config.json (any form RopeConfig.from_hf reads)")
    source.add_argument("--preset", metavar="NAME", help=f"a named config: {', '.join(preset_names())}")
    parser.add_argument("--layer-type", metavar="TYPE",
                        help="which rope parameters of a per-layer-type config (e.g. full_attention)")


def at_least(minimum: int, maximum: int | None = None):
    """An argparse type: an integer ``>= minimum`` (and ``<= maximum`` if given)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"expected an integer <= {maximum:,}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse
