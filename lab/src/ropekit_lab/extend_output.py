"""Where ``ropekit extend`` writes: its output folder, and the model copy of ``--write-config``.

Both are written all-or-nothing through :mod:`ropekit.files`: built in a staging directory beside
the destination, then moved into place with one rename or atomic exchange. The output folder is
replaced as a whole (it may hold only an earlier run's outputs). The model copy is a new
directory: ``--write-config DST`` refuses a DST that exists, so nothing is ever overwritten, least of
all the model it copies.

The copy holds the source directory's files (the weights copied, not linked: a link would tie the
copy to a folder the user may move or change) with a ``config.json`` that states the chosen rule
(:func:`ropekit_lab.extend_rules.written_config`); a ``--gguf`` model is written as a transformers
directory: its dequantised float32 weights, its tokenizer, its config without the GGUF's
``quantization_config`` (transformers' ``save_pretrained`` refuses a GGUF-loaded model).
``from_pretrained(DST)`` then runs with the rule.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from ropekit.files import make_directory, replace_directory, staging_directory, write_file

from .extend_rules import Candidate, written_config
from .page_output import check_page_folder, write_page_folder


def check_out_folder(out: str | Path) -> Path:
    """``out`` as an absolute path; ``ValueError`` if it holds anything but an earlier run's outputs."""
    return check_page_folder(out, "extend.json", "extend")


def write_outputs(out: str | Path, document: dict[str, Any], *, figures: bool = True) -> Path:
    """Write ``extend.json``, the figures and ``index.html`` as the folder ``out``, at once; the page's path."""
    from .extend_page import render

    return write_page_folder(check_out_folder(out), document, "extend.json", render, figures=figures)


def _source(args: argparse.Namespace) -> Path | None:
    """The input the copy is made from: the model directory, the GGUF file, or ``None`` for the example."""
    if args.model is not None:
        return Path(args.model).resolve()
    if args.gguf is not None:
        return Path(args.gguf).resolve()
    return None


def check_config_destination(dst: str | Path, args: argparse.Namespace) -> Path:
    """``dst`` as an absolute path; ``ValueError`` if it exists, or lies inside the input, or its parent is missing.

    Checked before any work, so that a run of minutes does not end in a refusal.
    """
    path = Path(dst).resolve()
    if os.path.lexists(dst) or path.exists():
        raise ValueError(f"--write-config {str(dst)!r} exists; give a new directory (extend never overwrites)")
    if not path.parent.is_dir():
        raise ValueError(f"--write-config {str(dst)!r}: its parent directory does not exist")
    source = _source(args)
    if source is not None and (path == source or source in path.parents):
        raise ValueError(f"--write-config {str(dst)!r} is inside the input {str(source)!r}")
    out = Path(args.out).resolve()
    if path == out or out in path.parents or path in out.parents:
        raise ValueError(f"--write-config {str(dst)!r} and --out {args.out!r} overlap")
    return path


def _copyable(directory: Path) -> list[Path]:
    """The regular files directly in ``directory`` (a link is followed only to a regular file inside it)."""
    files = []
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_symlink():
            real = entry.resolve()
            if directory.resolve() not in real.parents or not real.is_file():
                raise ValueError(f"--model: {entry.name} is a link out of the model directory; refusing to copy it")
        elif not stat.S_ISREG(entry.lstat().st_mode):
            continue
        files.append(entry)
    return files


def write_config(dst: str | Path, loaded: Any, document: dict[str, Any]) -> Path:
    """Write the model with the chosen rule's config as the new directory ``dst``, all at once; its path."""
    choice = document["choice"]
    chosen = Candidate(choice["rule"], None, choice["rope_parameters"], choice["max_position_embeddings"], "")
    path = Path(dst).resolve()
    if os.path.lexists(path):
        raise ValueError(f"--write-config {str(dst)!r} exists; give a new directory (extend never overwrites)")
    with staging_directory(path.parent) as stage:
        new = stage / path.name
        make_directory(new)
        source = Path(loaded.path)
        if source.is_dir():
            for file in _copyable(source):
                if file.name == "config.json":
                    continue
                mode = stat.S_IMODE(file.stat().st_mode)
                write_file(new / file.name, lambda p, file=file: _copy(file, p), mode_limit=mode)
            config = json.loads((source / "config.json").read_text(encoding="utf-8"))
        else:  # a GGUF: its dequantised weights (float32) and tokenizer, as ropekit_lab.smollm2_cache writes them
            from safetensors.torch import save_model

            write_file(new / "model.safetensors", lambda p: save_model(loaded.model, str(p)))  # a tied head too
            saved = stage / "tokenizer"
            loaded.tokenizer.save_pretrained(saved)
            for file in sorted(saved.iterdir()):
                if file.is_file():
                    write_file(new / file.name, lambda p, file=file: _copy(file, p))
            config = loaded.model.config.to_dict()
            config.pop("quantization_config", None)  # the GGUF's: the copy holds float32 weights
        text = json.dumps(written_config(config, chosen), indent=2) + "\n"
        write_file(new / "config.json", lambda p: p.write_text(text, encoding="utf-8"))
        replace_directory(new, path)
    return path


def _copy(source: Path, target: Path) -> None:
    with open(source, "rb") as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
