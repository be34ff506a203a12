"""Where ``ropekit probe``'s results go: the output folder (replaced as a whole) and the line on stderr."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .page_output import check_page_folder, write_page_folder


def check_out_folder(out: str | Path) -> Path:
    """``out`` as an absolute path; ``ValueError`` if it holds anything but a probe's outputs (they are replaced).

    The probe replaces the whole folder in one step (:func:`write_outputs`), so a folder with other
    files in it is refused before any work.
    """
    return check_page_folder(out, "probe.json", "the probe")


def write_outputs(out: str | Path, document: dict[str, Any], *, figures: bool = True) -> Path:
    """Write ``probe.json``, the figures and ``index.html`` as the folder ``out``, all at once.

    The files are built in a staging directory beside ``out`` and the finished folder replaces
    ``out`` with one atomic exchange (:func:`ropekit.files.replace_directory`): a reader, a crash or
    Ctrl-C sees the old outputs or the new ones, never a mix. ``out`` must hold nothing else
    (:func:`check_out_folder`). Returns the path of ``index.html``.
    """
    from .probe_page import render

    return write_page_folder(check_out_folder(out), document, "probe.json", render, figures=figures)


def one_line_summary(document: dict[str, Any]) -> str:
    """``pairing half (weights z=+19.3, 92% of 360 heads; loss 1.36 vs 4.14); 85% of q energy in 21 slow pairs``."""
    pairing, summary = document["pairing"], document["summary"]
    weights, loss = pairing["weights"], pairing["loss"]
    said = weights["layout"] or "undecided"
    return (f"ropekit probe: pairing {pairing['layout']} (weights: {said}, z={weights['z'] or 0:+.1f}, "
            f"{100 * weights['votes']:.0f}% of {weights['heads']} heads; loss half {loss['half']:.3f} vs "
            f"interleaved {loss['interleaved']:.3f}); {100 * summary['slow_energy_share_q']['mean']:.0f}% of the q "
            f"energy in the {summary['slow_pairs']} of {summary['pairs']} pairs that never complete a rotation")
