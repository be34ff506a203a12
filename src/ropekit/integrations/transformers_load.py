"""The transformers config of a directory ``ropekit convert`` wrote, and the layout of its q/k rows.

A directory whose q/k rows are in a layout transformers does not rotate that model in carries a
``config.json`` with a layout record (:mod:`ropekit.config.layout_record`) that transformers refuses.
:func:`converted_config` reads the original config back out of it;
:func:`ropekit.integrations.transformers.load_converted` builds the model from it and patches it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config.layout_record import LAYOUT_KEY, RECORD_KEY, read_layout_record

CONFIG_NAME = "config.json"


def converted_config(path: str | Path) -> tuple[Any, str | None]:
    """``(transformers config of the original model, recorded layout)`` for a local model directory.

    Returns ``(None, None)`` when ``path/config.json`` records no layout (an ordinary transformers
    checkpoint, which ``from_pretrained`` loads as it is).

    Raises:
        ValueError: ``path`` is not a directory, its ``config.json`` is missing or not a JSON
            object, its layout record is malformed, or transformers does not know the original
            model type.
    """
    import transformers

    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"path must be a local model directory written by ropekit convert, got {str(path)!r}")
    file = directory / CONFIG_NAME
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"path {str(path)!r} has no {CONFIG_NAME}; a ropekit convert output of a model "
                         "directory carries one") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(config).__name__}")
    if RECORD_KEY not in config and LAYOUT_KEY not in config:
        return None, None
    try:
        original, layout = read_layout_record(config)
    except ValueError as exc:
        raise ValueError(f"{file}: {exc}") from None
    model_type = original.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(f"{file} records the original model type {model_type!r}, which this transformers "
                         f"{transformers.__version__} does not know")
    return transformers.CONFIG_MAPPING[model_type].from_dict(original), layout
