"""The output folder of a verb that writes a page (``probe``, ``extend``): refused if foreign, replaced at once.

The folder holds ``index.html``, the verb's JSON document and its PNG figures, nothing else. It is
built in a staging directory beside ``out`` and replaces ``out`` with one atomic exchange
(:func:`ropekit.files.replace_directory`): a reader, a crash or Ctrl-C sees the old outputs or the
new ones, never a mix; a folder with other files in it is refused before any work.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ropekit.files import make_directory, replace_directory, staging_directory, write_file


def check_page_folder(out: str | Path, json_name: str, writer: str) -> Path:
    """``out`` as an absolute path; ``ValueError`` if it is a file or holds anything but ``writer``'s outputs.

    ``json_name``: the verb's document (``probe.json``); ``writer``: how the message names the verb
    (``the probe``).
    """
    folder = Path(out).resolve()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out {str(out)!r}: not a directory")
    if folder.is_dir():
        foreign = sorted(p.name for p in folder.iterdir()
                         if not (p.name in ("index.html", json_name) or p.name.endswith(".png")))
        if foreign:
            shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
            raise ValueError(f"--out {str(out)!r} holds files {writer} did not write ({shown}); {writer} replaces "
                             "the whole folder: give it a folder of its own")
    return folder


def write_page_folder(folder: Path, document: dict[str, Any], json_name: str,
                      render: Callable[..., tuple[str, dict[str, bytes]]], *, figures: bool = True) -> Path:
    """Render ``document`` and write the page, the figures and ``json_name`` as ``folder`` at once; the page's path.

    ``folder``: what :func:`check_page_folder` returned. ``render(document, figures=...)`` gives the
    HTML and ``{png name: bytes}``; their names go into ``document["figures"]`` before it is written.
    """
    html, pngs = render(document, figures=figures)
    document["figures"] = list(pngs)
    payload = {**pngs, json_name: (json.dumps(document, indent=1, allow_nan=False) + "\n").encode("utf-8"),
               "index.html": html.encode("utf-8")}
    folder.parent.mkdir(parents=True, exist_ok=True)
    with staging_directory(folder.parent) as stage:
        new = stage / folder.name
        make_directory(new)
        for name, data in payload.items():
            write_file(new / name, lambda p, data=data: p.write_bytes(data))
        replace_directory(new, folder)
    return folder / "index.html"
