"""The public namespace of the scaling rules: ``from ropekit.scaling import YaRN``.

The rules live in :mod:`ropekit.rope.scaling` (the maths layer); :func:`rule_from_dict`, which
reads a ``config.json`` rope dict, lives in :mod:`ropekit.config.rules` (the only layer that parses
dicts). Both are re-exported here under the names ropekit has always used.
"""

from .config.rules import PLAIN_ROPE_TYPES, RULE_KEYS, rope_type_of, rule_from_dict
from .rope.scaling import (
    NTK,
    DynamicNTK,
    Linear,
    Llama3,
    LongRoPE,
    Proportional,
    ScalingRule,
    YaRN,
    known_rope_types,
    ntk_base,
    register_rule,
    rule_class,
    yarn_mscale,
)

__all__ = [
    "NTK",
    "PLAIN_ROPE_TYPES",
    "RULE_KEYS",
    "DynamicNTK",
    "Linear",
    "Llama3",
    "LongRoPE",
    "Proportional",
    "ScalingRule",
    "YaRN",
    "known_rope_types",
    "ntk_base",
    "register_rule",
    "rope_type_of",
    "rule_class",
    "rule_from_dict",
    "yarn_mscale",
]
