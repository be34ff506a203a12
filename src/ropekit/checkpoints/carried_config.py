"""The ``config.json`` an output directory receives: it never claims a layout its q/k rows are not in.

A carried ``config.json`` is copied byte for byte while transformers rotates that model in the
layout written. Otherwise (``--to interleaved`` of a Hugging Face checkpoint) it is written with a
layout record (:mod:`ropekit.config.layout_record`): transformers then refuses to load the output
instead of computing wrong numbers, and ``ropekit.integrations.transformers.load_converted``
loads it on purpose. Converting back writes the original config again (``json.dumps`` with
``indent=2, sort_keys=True``, as ``save_pretrained`` writes it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..config.layout_record import RECORD_KEY, read_layout_record, with_layout_record
from .source_links import open_source

CONFIG_NAME = "config.json"
#: what happened to the carried config.json: it got a layout record, or lost the one it had
RECORDED, RESTORED = "recorded", "restored"


def rewrite_config(carried: list[Path], directory: Path, layout: str) -> tuple[dict[str, bytes], str | None]:
    """``({file name: new contents}, RECORDED | RESTORED | None)`` for the carried files of ``directory``.

    Empty and ``None`` when no ``config.json`` is carried, when it is no JSON object (transformers
    cannot load it either) or when it is right for ``layout`` as it is.

    Raises:
        ValueError: a layout record in the carried ``config.json`` that is not ropekit's.
    """
    source = next((path for path in carried if path.name == CONFIG_NAME), None)
    if source is None:
        return {}, None
    fd, _ = open_source(source, directory)
    with os.fdopen(fd, "rb") as reader:
        data = reader.read()
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}, None
    if not isinstance(config, dict):
        return {}, None
    try:
        original, recorded = read_layout_record(config)
        written = with_layout_record(original, layout)
    except ValueError as exc:
        raise ValueError(f"{CONFIG_NAME} of SRC: {exc}") from None
    if recorded is None and RECORD_KEY not in written:
        return {}, None
    text = json.dumps(written, indent=2, sort_keys=True) + "\n"
    return {CONFIG_NAME: text.encode("utf-8")}, RECORDED if RECORD_KEY in written else RESTORED
