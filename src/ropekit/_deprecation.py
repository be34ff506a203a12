"""Deprecated names: one warning per name, naming what to use instead.

A renamed or moved public name keeps working for one release through a small alias built here:
:func:`deprecated` wraps a function or method, :func:`module_getattr` serves a module's moved
attributes (PEP 562). Each name warns once per process (``DeprecationWarning``, ``"X is
deprecated; use Y"``), however often it is used; :func:`forget` lets a test see the warning again.
This module imports nothing of ropekit and not torch (``import ropekit`` stays light).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable
from typing import Any

_WARNED: set[str] = set()


def warn_once(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Issue ``DeprecationWarning("<old> is deprecated; use <new>")`` the first time ``old`` is used.

    Args:
        old: the deprecated spelling, as the caller wrote it (``"ropekit.scaling.RULE_KEYS"``).
        new: what replaces it, as the caller should write it.
        stacklevel: passed to :func:`warnings.warn` (3: the caller of the function that calls this).
    """
    if old in _WARNED:
        return
    _WARNED.add(old)
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=stacklevel)


def forget(old: str | None = None) -> None:
    """Let ``old`` (every name when None) warn again on its next use (tests)."""
    if old is None:
        _WARNED.clear()
    else:
        _WARNED.discard(old)


def deprecated(function: Callable, old: str, new: str) -> Callable:
    """``function`` under a deprecated name: the same call, after :func:`warn_once` of ``old``."""

    @functools.wraps(function)
    def alias(*args: Any, **kwargs: Any) -> Any:
        warn_once(old, new)
        return function(*args, **kwargs)

    alias.__doc__ = f"Deprecated: use {new} (same arguments and result)."
    return alias


def deprecated_method(new: str, old_label: str, new_label: str) -> Callable:
    """A method under a deprecated name that calls ``self.<new>`` (so that subclasses' overrides apply).

    Args:
        new: the method's new attribute name (``"rotate_one"``).
        old_label, new_label: the spellings the warning names (``"ropekit.RotaryEmbedding.rotate"``).
    """

    def alias(self: Any, *args: Any, **kwargs: Any) -> Any:
        warn_once(old_label, new_label)
        return getattr(self, new)(*args, **kwargs)

    alias.__doc__ = f"Deprecated: use {new_label} (same arguments and result)."
    return alias


def module_getattr(module: str, moved: dict[str, tuple[str, str]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving its moved names, each with one warning.

    Args:
        module: the module's ``__name__`` (``"ropekit.scaling"``).
        moved: old attribute name -> ``(home, new)``: ``home`` is ``"module:attribute"`` where the
            value lives now, ``new`` the spelling the warning recommends.
    """

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        home, new = moved[name]
        home_module, attribute = home.split(":")
        value = getattr(importlib.import_module(home_module), attribute)
        warn_once(f"{module}.{name}", new)
        return value

    return __getattr__
