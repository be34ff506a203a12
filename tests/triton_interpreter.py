"""Import Triton in its CPU interpreter for a test module (a helper, not a test).

``TRITON_INTERPRET=1`` must be in the environment while triton, and the ropekit modules that jit
kernels, are first imported; afterwards only the Triton tests need it (they set it per test), so the
variable is put back as it was and the rest of the suite sees the environment it started with.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def import_interpreted(*modules: str) -> tuple[ModuleType, list[ModuleType]]:
    """``(triton, [modules...])`` imported under ``TRITON_INTERPRET=1``; skips the test module without triton."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        triton = pytest.importorskip("triton")
        return triton, [importlib.import_module(name) for name in modules]
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def count_calls(monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str) -> list[dict]:
    """Wrap ``module.name`` so each call appends its keyword arguments to the returned list (a launch counter)."""
    calls: list[dict] = []
    real = getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls
