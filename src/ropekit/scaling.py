"""The public namespace of the scaling rules: ``from ropekit.scaling import YaRN``.

The rule classes, the base class every rule satisfies (:class:`ScalingRule`), the registry's
entry points (:func:`register_rule` to add a rule, :func:`rule_class` and :func:`known_rope_types`
to look them up by ``rope_type``) and :func:`rule_from_dict`, which reads a ``config.json`` rope
dict. The rules live in :mod:`ropekit.rope.scaling` (the maths layer), :func:`rule_from_dict` in
:mod:`ropekit.config.rules` (the only layer that parses dicts); helpers of either (``RULE_KEYS``,
``ntk_base``, ...) are imported from there.
"""

from ._deprecation import module_getattr
from .config.rules import rule_from_dict
from .rope.scaling import (
    NTK,
    DynamicNTK,
    Linear,
    Llama3,
    LongRoPE,
    NTKAlpha,
    Proportional,
    ScalingRule,
    YaRN,
    known_rope_types,
    register_rule,
    rule_class,
)

__all__ = [
    "NTK",
    "DynamicNTK",
    "NTKAlpha",
    "Linear",
    "Llama3",
    "LongRoPE",
    "Proportional",
    "ScalingRule",
    "YaRN",
    "known_rope_types",
    "register_rule",
    "rule_class",
    "rule_from_dict",
]

# the internals this namespace re-exported in 0.x (one release): each warns once and names its home
__getattr__ = module_getattr(__name__, {
    "PLAIN_ROPE_TYPES": ("ropekit.config.rules:PLAIN_ROPE_TYPES", "ropekit.config.rules.PLAIN_ROPE_TYPES"),
    "RULE_KEYS": ("ropekit.config.rules:RULE_KEYS", "ropekit.config.rules.RULE_KEYS"),
    "rope_type_of": ("ropekit.config.rules:rope_type_of", "ropekit.config.rules.rope_type_of"),
    "ntk_base": ("ropekit.rope.scaling:ntk_base", "ropekit.rope.scaling.ntk_base"),
    "yarn_mscale": ("ropekit.rope.scaling:yarn_mscale", "ropekit.rope.scaling.yarn_mscale"),
})
