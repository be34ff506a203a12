"""Tests from a source checkout (``PYTHONPATH=src``) without the lab installed: set it up as pip would.

The tests run the lab's verbs through the ``ropekit`` command line, which finds them through the
entry-point group ``ropekit.verbs`` of installed metadata. Where the ``ropekit-lab`` distribution
is not installed (README command 2 and CI install it), :func:`use_lab_sources` puts ``lab/src`` on
the path and writes the lab's metadata, its entry points read from ``lab/pyproject.toml``, into a
temporary folder on the path; both go into ``PYTHONPATH`` too, for the subprocesses. Installed, the
lab is used as it is.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import importlib.util
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAB_PYPROJECT = ROOT / "lab" / "pyproject.toml"
GROUP = "ropekit.verbs"


def lab_entry_points(text: str) -> dict[str, str]:
    """``{verb: module}`` of the ``[project.entry-points."ropekit.verbs"]`` table of a pyproject.toml."""
    table = re.search(rf'^\[project\.entry-points\."{re.escape(GROUP)}"\]\n(.*?)(?=^\[|\Z)', text, re.M | re.S)
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.]+)"', table.group(1), re.M)) if table else {}


def lab_version(text: str) -> str:
    """The ``version`` of the ``[project]`` table."""
    return re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)


def installed(distribution: str) -> bool:
    """Whether the metadata of ``distribution`` is on the path."""
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def stale_entry_points(text: str) -> bool:
    """Whether an installed ``ropekit-lab`` lacks a verb that ``lab/pyproject.toml`` registers (an older install)."""
    points = {p.name for p in importlib.metadata.distribution("ropekit-lab").entry_points if p.group == GROUP}
    return not set(lab_entry_points(text)) <= points


def use_lab_sources() -> list[str]:
    """Make the lab importable and its verbs discoverable if they are not; the path entries added.

    An installed lab whose metadata predates a verb of ``lab/pyproject.toml`` gets fresh metadata
    ahead of it on the path, so that the command line finds every verb of this checkout.
    """
    added = []
    if importlib.util.find_spec("ropekit_lab") is None:
        added.append(str(ROOT / "lab" / "src"))
    stale = LAB_PYPROJECT.is_file() and stale_entry_points(LAB_PYPROJECT.read_text(encoding="utf-8"))
    if not installed("ropekit-lab") or stale:
        text = LAB_PYPROJECT.read_text(encoding="utf-8")
        folder = Path(tempfile.mkdtemp(prefix="ropekit-lab-metadata-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        info = folder / f"ropekit_lab-{lab_version(text)}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: ropekit-lab\nVersion: {lab_version(text)}\n")
        points = "".join(f"{verb} = {module}\n" for verb, module in lab_entry_points(text).items())
        (info / "entry_points.txt").write_text(f"[{GROUP}]\n{points}")
        added.append(str(folder))
    if added:
        sys.path[:0] = added
        os.environ["PYTHONPATH"] = os.pathsep.join(added + [p for p in [os.environ.get("PYTHONPATH")] if p])
        importlib.invalidate_caches()
    return added
