"""The one registry of scaling rules: ``rope_type`` name -> rule class.

A rule class declares, next to its maths,

    rope_type: ClassVar[str]                 # the Hugging Face ``rope_type`` (or ropekit's own name)
    aliases: ClassVar[tuple[str, ...]]       # older names still found in published configs
    config_keys: ClassVar[frozenset[str]]    # the rope-dict keys it reads (beyond the metadata keys)
    from_config(params, max_positions)       # classmethod: the rule from its already-checked keys

and is entered here by the :func:`register_rule` class decorator. ``ropekit.config.rules`` checks
a rope dict's keys against ``config_keys`` (unknown keys and ``null`` values are the config
layer's business) and calls ``from_config``; :mod:`ropekit.rope.analysis` names a rule by its
``rope_type``. A name that is not registered raises a ``ValueError`` listing the known names:
there is no fallback to another rule.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ...validation import check_length

#: ``rope_type`` -> rule class, filled by :func:`register_rule`.
RULES: dict[str, type] = {}
#: old name -> ``rope_type`` (``"su"`` is ``"longrope"``), filled by :func:`register_rule`.
ALIASES: dict[str, str] = {}


def register_rule(cls: type) -> type:
    """Class decorator: enter ``cls`` under ``cls.rope_type`` and each of ``cls.aliases``.

    Raises:
        TypeError: the class lacks ``rope_type`` (a string), ``config_keys`` (a frozenset of
            strings) or a callable ``from_config``.
        ValueError: the name or an alias is already taken by another class.
    """
    name = getattr(cls, "rope_type", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_rule: {cls.__name__} needs a class attribute rope_type (a string), got {name!r}")
    keys = getattr(cls, "config_keys", None)
    if not isinstance(keys, frozenset) or not all(isinstance(key, str) for key in keys):
        raise TypeError(f"register_rule: {cls.__name__}.config_keys must be a frozenset of strings, got {keys!r}")
    if not callable(getattr(cls, "from_config", None)):
        raise TypeError(f"register_rule: {cls.__name__} needs a classmethod from_config(params, max_positions)")
    aliases = tuple(getattr(cls, "aliases", ()))
    for taken in (name, *aliases):
        owner = RULES.get(ALIASES.get(taken, taken))
        if owner is not None and owner is not cls:
            raise ValueError(f"register_rule: rope_type {taken!r} is already {owner.__name__}'s, not {cls.__name__}'s")
    RULES[name] = cls
    for alias in aliases:
        ALIASES[alias] = name
    return cls


def known_rope_types() -> list[str]:
    """Every registered ``rope_type`` and alias, sorted."""
    return sorted(RULES) + sorted(ALIASES)


def canonical_rope_type(name: str) -> str:
    """``name`` with an alias resolved (``"su"`` -> ``"longrope"``); any other name unchanged."""
    return ALIASES.get(name, name)


def rule_class(name: str) -> type:
    """The rule class registered under ``name`` (an alias is resolved).

    Raises:
        ValueError: ``name`` is not registered; the message lists the known names.
    """
    cls = RULES.get(ALIASES.get(name, name))
    if cls is None:
        raise ValueError(f"unknown rope_type {name!r}; known: {known_rope_types()}")
    return cls


def rope_type_of_rule(rule: Any) -> str:
    """The ``rope_type`` of a rule object (``"default"`` for ``None``).

    Raises:
        ValueError: the rule's class is not registered (see :func:`register_rule`).
    """
    if rule is None:
        return "default"
    name = getattr(type(rule), "rope_type", None)
    if not isinstance(name, str) or RULES.get(name) is not type(rule):
        raise ValueError(
            f"scaling rule {type(rule).__name__} is not registered; decorate its class with "
            f"ropekit.scaling.register_rule (known: {known_rope_types()})"
        )
    return name


class RuleKeys(Mapping):
    """A live read-only view ``rope_type -> config_keys`` of the registry."""

    def __getitem__(self, name: str) -> frozenset[str]:
        return RULES[name].config_keys

    def __iter__(self) -> Iterator[str]:
        return iter(list(RULES))

    def __len__(self) -> int:
        return len(RULES)

    def __repr__(self) -> str:
        return f"RuleKeys({dict(self)!r})"


# Reading a rule's values out of its (already checked) rope dict: shared by the rules' from_config.


def value(params: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """``params[key]``, or ``default`` when the key is absent or ``null``."""
    found = params.get(key)
    return default if found is None else found


def required(rope_type: str, params: Mapping[str, Any], key: str) -> Any:
    """``params[key]``; a ValueError naming the rule and the key when it is absent or ``null``."""
    found = params.get(key)
    if found is None:
        raise ValueError(f"{rope_type} scaling needs {key!r} in the rope parameters, got {dict(params)!r}")
    return found


def original_length(rope_type: str, params: Mapping[str, Any], max_positions: int | None) -> Any:
    """``original_max_position_embeddings``, defaulting to ``max_position_embeddings`` as Hugging Face does."""
    found = value(params, "original_max_position_embeddings", max_positions)
    if found is None:
        raise ValueError(
            f"{rope_type} scaling needs 'original_max_position_embeddings' in the rope parameters (or "
            f"max_position_embeddings to default it to), got {dict(params)!r}"
        )
    return found


def extension_factor(rope_type: str, params: Mapping[str, Any], original: Any, max_positions: int | None) -> Any:
    """``factor``, else ``max_position_embeddings / original_max_position_embeddings`` (None if neither)."""
    found = params.get("factor")
    if found is None and max_positions is not None:
        found = max_positions / check_length(rope_type, "original_max_position_embeddings", original)
    return found
