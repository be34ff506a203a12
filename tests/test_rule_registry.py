"""One place per scaling rule: a class with its ``rope_type`` and one registration, no fall-through.

A rule defined here, in the test, is reached by ``rule_from_dict``, ``RopeConfig.from_hf``,
``ropekit.inv_frequencies`` and ``ropekit inspect``'s description without any other edit; every registered rule
round-trips through its ``rope_type``; an unregistered name raises a ValueError listing the known
ones, never building another rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import pytest
import torch

import ropekit
from ropekit.cli import inspect_json
from ropekit.config.rules import RULE_KEYS, rule_from_dict
from ropekit.rope.frequencies import base_inv_freq
from ropekit.rope.scaling import registry
from ropekit.scaling import register_rule

SAMPLE_PARAMS = {
    "linear": {"factor": 2.0},
    "ntk": {"factor": 2.0},
    "dynamic": {"factor": 2.0},
    "ntk_alpha": {"alpha": 1000.0},
    "proportional": {"factor": 2.0, "partial_rotary_factor": 0.5},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 64},
    "longrope": {"short_factor": [1.0] * 4, "long_factor": [2.0] * 4, "original_max_position_embeddings": 64},
}


@pytest.fixture
def clean_registry():
    """Registrations made by a test are undone after it."""
    rules, aliases = dict(registry.RULES), dict(registry.ALIASES)
    yield
    registry.RULES.clear()
    registry.RULES.update(rules)
    registry.ALIASES.clear()
    registry.ALIASES.update(aliases)


def define_halved_rule():
    """A new rule, complete: one class with its rope_type, keys and from_config, one registration."""

    @register_rule
    @dataclasses.dataclass(frozen=True)
    class Halved:
        """Every frequency divided by ``factor`` and an attention scale of 1/2 (a test rule)."""

        factor: float
        dynamic: ClassVar[bool] = False
        rope_type: ClassVar[str] = "halved"
        aliases: ClassVar[tuple[str, ...]] = ("halved_old",)
        config_keys: ClassVar[frozenset[str]] = frozenset({"factor"})

        @classmethod
        def from_config(cls, params: Mapping[str, Any], max_positions: int | None) -> Halved:
            return cls(params["factor"])

        def compute(self, rotary_dim: int, base: float, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
            return base_inv_freq(rotary_dim, base) / self.factor, 0.5

    return Halved


def test_a_rule_defined_in_one_class_is_reached_everywhere(clean_registry):
    halved = define_halved_rule()
    params = {"rope_type": "halved", "factor": 4.0}
    assert rule_from_dict(params) == halved(4.0)
    assert rule_from_dict({"type": "halved_old", "factor": 4.0}) == halved(4.0)
    assert RULE_KEYS["halved"] == frozenset({"factor"})

    config = ropekit.RopeConfig.from_hf(
        {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 256, "rope_scaling": params}
    )
    assert config.scaling == halved(4.0)
    inv_freq, scale = ropekit.inv_frequencies(16, 10000.0, params)
    torch.testing.assert_close(inv_freq, base_inv_freq(16, 10000.0) / 4.0)
    assert scale == 0.5

    summary = inspect_json.describe(config, context=256, bound=False)
    assert summary["rope_type"] == "halved"
    assert summary["rope_parameters"] == {"factor": 4.0}


def test_a_registered_rule_still_rejects_keys_it_does_not_declare(clean_registry):
    define_halved_rule()
    with pytest.raises(ValueError, match="halved scaling does not take 'beta_fast'"):
        rule_from_dict({"rope_type": "halved", "factor": 4.0, "beta_fast": 32})


@pytest.mark.parametrize("rope_type", sorted(registry.RULES))
def test_every_registered_rule_round_trips_through_its_rope_type(rope_type):
    assert rope_type in SAMPLE_PARAMS, f"add sample parameters for the registered rule {rope_type!r}"
    rule = rule_from_dict({"rope_type": rope_type, **SAMPLE_PARAMS[rope_type]}, max_position_embeddings=256)
    assert type(rule) is registry.RULES[rope_type]
    assert type(rule).rope_type == rope_type
    assert registry.rope_type_of_rule(rule) == rope_type
    assert set(SAMPLE_PARAMS[rope_type]) <= type(rule).config_keys | {"partial_rotary_factor"}


def test_aliases_resolve_to_their_rule():
    for alias, name in registry.ALIASES.items():
        assert registry.rule_class(alias) is registry.RULES[name]
    assert type(rule_from_dict({"type": "su", **SAMPLE_PARAMS["longrope"]}, max_position_embeddings=256)).rope_type == (
        "longrope"
    )


@pytest.mark.parametrize("name", ["spiral", "LongRoPE", "longrope_v2"])
def test_an_unregistered_rope_type_raises_listing_the_known_ones(name):
    with pytest.raises(ValueError, match=rf"unknown rope_type '{name}'; known: \[.*'linear'.*'yarn'.*'su'"):
        rule_from_dict({"rope_type": name, **SAMPLE_PARAMS["longrope"]}, max_position_embeddings=256)
    with pytest.raises(ValueError, match="unknown rope_type"):
        registry.rule_class(name)


def test_a_name_known_only_by_its_keys_does_not_fall_through_to_another_rule(clean_registry):
    """A rule entered without a class of its own cannot exist: the keys come from the class."""
    with pytest.raises(ValueError, match="unknown rope_type 'phantom'"):
        rule_from_dict({"rope_type": "phantom", "short_factor": [1.0] * 4, "long_factor": [1.0] * 4,
                        "original_max_position_embeddings": 64}, max_position_embeddings=256)


def test_an_unregistered_rule_object_has_no_rope_type():
    @dataclasses.dataclass(frozen=True)
    class Unlisted:
        dynamic: ClassVar[bool] = False

    with pytest.raises(ValueError, match="Unlisted is not registered"):
        registry.rope_type_of_rule(Unlisted())


def test_registration_checks_the_declarations(clean_registry):
    class NoName:
        config_keys: ClassVar[frozenset[str]] = frozenset()

        @classmethod
        def from_config(cls, params, max_positions):
            return cls()

    with pytest.raises(TypeError, match="rope_type"):
        register_rule(NoName)

    class Clash(NoName):
        rope_type: ClassVar[str] = "yarn"

    with pytest.raises(ValueError, match="already YaRN's"):
        register_rule(Clash)
