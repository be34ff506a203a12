"""Stopping a tool at a chosen file-system step: ``ropekit.files.fs_step`` is called before every one.

The tests of all-or-nothing outputs stop a run before step 1, 2, ... in turn and check what a
reader would then find.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from ropekit import files


class Killed(BaseException):
    """Stands in for SIGKILL: raised before a file-system step, caught by no ``except Exception``."""


def stop_after(patch: pytest.MonkeyPatch, n: int, error: BaseException | type[BaseException] = Killed,
               actions: Iterable[str] | None = None) -> None:
    """Let ``n`` steps happen, then raise ``error`` before the next one.

    ``actions``: count only these steps (e.g. ``("replace", "unlink")``, the changes a reader sees).
    """
    counted = None if actions is None else frozenset(actions)
    count = [0]

    def step(action, path):
        if counted is None or action in counted:
            count[0] += 1
            if count[0] > n:
                raise error

    patch.setattr(files, "fs_step", step)
