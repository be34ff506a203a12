"""Where ``ropekit probe``'s results go: the output folder (replaced as a whole) and the line on stderr."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ropekit.files import make_directory, replace_directory, staging_directory, write_file


def check_out_folder(out: str | Path) -> Path:
    """``out`` as an absolute path; ``ValueError`` if it holds anything but a probe's outputs (they are replaced).

    The probe replaces the whole folder in one step (:func:`write_outputs`), so a folder with other
    files in it is refused before any work.
    """
    folder = Path(out).resolve()
    if folder.is_dir():
        foreign = sorted(p.name for p in folder.iterdir() if not _is_probe_output(p.name))
        if foreign:
            shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
            raise ValueError(f"--out {str(out)!r} holds files the probe did not write ({shown}); the probe replaces "
                             "the whole folder: give it a folder of its own")
    return folder


def _is_probe_output(name: str) -> bool:
    return name in ("index.html", "probe.json") or (name.endswith(".png") and "/" not in name)


def write_outputs(out: str | Path, document: dict[str, Any], *, figures: bool = True) -> Path:
    """Write ``probe.json``, the figures and ``index.html`` as the folder ``out``, all at once.

    The files are built in a staging directory beside ``out`` and the finished folder replaces
    ``out`` with one atomic exchange (:func:`ropekit.files.replace_directory`): a reader, a crash or
    Ctrl-C sees the old outputs or the new ones, never a mix. ``out`` must hold nothing else
    (:func:`check_out_folder`). Returns the path of ``index.html``.
    """
    from .probe_page import render

    folder = check_out_folder(out)
    html, pngs = render(document, figures=figures)
    document["figures"] = list(pngs)
    payload = {**pngs, "probe.json": (json.dumps(document, indent=1, allow_nan=False) + "\n").encode("utf-8"),
               "index.html": html.encode("utf-8")}
    folder.parent.mkdir(parents=True, exist_ok=True)
    with staging_directory(folder.parent) as stage:
        new = stage / folder.name
        make_directory(new)
        for name, data in payload.items():
            write_file(new / name, lambda p, data=data: p.write_bytes(data))
        replace_directory(new, folder)
    return folder / "index.html"


def one_line_summary(document: dict[str, Any]) -> str:
    """``pairing half (weights z=+19.3, 92% of 360 heads; loss 1.36 vs 4.14); 85% of q energy in 21 slow pairs``."""
    pairing, summary = document["pairing"], document["summary"]
    weights, loss = pairing["weights"], pairing["loss"]
    said = weights["layout"] or "undecided"
    return (f"ropekit probe: pairing {pairing['layout']} (weights: {said}, z={weights['z'] or 0:+.1f}, "
            f"{100 * weights['votes']:.0f}% of {weights['heads']} heads; loss half {loss['half']:.3f} vs "
            f"interleaved {loss['interleaved']:.3f}); {100 * summary['slow_energy_share_q']['mean']:.0f}% of the q "
            f"energy in the {summary['slow_pairs']} of {summary['pairs']} pairs that never complete a rotation")
