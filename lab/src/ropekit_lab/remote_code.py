"""A model folder that needs its own Python code is refused before transformers sees it.

transformers runs Python shipped in a model folder when its ``config.json`` (or
``tokenizer_config.json``) has an ``auto_map``, or asks "run the custom code? [y/N]" on stdout
when it is not told; a ``model_type`` it does not know can only be loaded that way. ropekit never
runs such code: every ``from_pretrained`` / ``from_config`` call passes ``trust_remote_code=False``,
and :func:`refuse_remote_code` turns such a folder into one ``ValueError`` naming the option before
anything is loaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: what ``from_pretrained`` / ``from_config`` get, always
NO_REMOTE_CODE = {"trust_remote_code": False}
_CONFIG_FILES = ("config.json", "tokenizer_config.json")
_LARGEST_CONFIG = 16 << 20  # bytes read to look for auto_map; a larger file is left to transformers' own checks


def _read_json(path: Path) -> dict[str, Any] | None:
    """``path`` as a JSON object, or ``None`` when it is missing, not a regular file, too large or not a JSON object."""
    try:
        if not path.is_file() or path.stat().st_size > _LARGEST_CONFIG:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def known_model_types() -> set[str]:
    """The ``model_type`` names this transformers builds from its own code."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return set(CONFIG_MAPPING.keys())


def refuse_remote_code(directory: str | os.PathLike, option: str, shown: str) -> None:
    """``ValueError`` (one line, naming ``option``) if the model folder ``directory`` needs its own code.

    That is: ``config.json`` or ``tokenizer_config.json`` holds an ``auto_map``, or ``config.json``
    names a ``model_type`` transformers does not know. Reads only those two small JSON files.
    """
    folder = Path(directory)
    for name in _CONFIG_FILES:
        data = _read_json(folder / name)
        if data is not None and "auto_map" in data:
            raise ValueError(f"{option} {shown!r}: {name} has an auto_map: the model needs its own Python code, "
                             "which ropekit never runs (trust_remote_code stays off)")
    config = _read_json(folder / "config.json")
    model_type = config.get("model_type") if config is not None else None
    if isinstance(model_type, str) and model_type not in known_model_types():
        raise ValueError(f"{option} {shown!r}: transformers does not know model_type {model_type!r}: loading it "
                         "would need the model's own Python code, which ropekit never runs")
