"""bfloat16 accuracy: ropekit (float64 angles, float32 tables and math, one rounding) vs the HF recipe.

Numbers come from :func:`ropekit_lab.precision.bf16_error_comparison`; the reference there is a
float64 rotation written out with its own angles, not ropekit's apply.
"""

import pytest

from ropekit_lab.precision import bf16_error_comparison


@pytest.fixture(scope="module")
def at_2e4():
    return bf16_error_comparison(positions_start=20000, n_positions=256, head_dim=128, base=10000.0, seed=0)


def test_ropekit_is_at_the_bfloat16_rounding_floor(at_2e4):
    """ropekit's error is the error of rounding the exact result to bf16: nothing avoidable is left."""
    assert at_2e4["ropekit_mean"] <= 1.001 * at_2e4["floor_mean"]
    assert at_2e4["ropekit_max"] <= at_2e4["floor_max"] + 2.0**-9
    assert at_2e4["ropekit_excess_mean"] < 1e-6


def test_hf_recipe_adds_avoidable_error(at_2e4):
    """The recipe (float32 angles, bf16 tables, bf16 products) is well above the floor at 2e4."""
    assert at_2e4["hf_mean"] > 1.5 * at_2e4["ropekit_mean"]
    assert at_2e4["hf_max"] > 1.5 * at_2e4["ropekit_max"]
    # the avoidable part: ropekit removes (essentially) all of it
    assert at_2e4["ropekit_excess_mean"] < 0.01 * at_2e4["hf_excess_mean"]
    assert at_2e4["ratio_mean"] == pytest.approx(at_2e4["ropekit_mean"] / at_2e4["hf_mean"])


def test_whole_error_halved_at_long_context():
    """At positions ~1e6 float32 angles dominate: ropekit's whole mean error is < 0.5x the recipe's."""
    far = bf16_error_comparison(positions_start=1_000_000, n_positions=256)
    assert far["ropekit_mean"] < 0.5 * far["hf_mean"]
    assert far["ropekit_mean"] <= 1.001 * far["floor_mean"]


def test_comparison_is_deterministic_and_sensitive():
    a = bf16_error_comparison(n_positions=32, head_dim=64, seed=1)
    b = bf16_error_comparison(n_positions=32, head_dim=64, seed=1)
    assert a == b
    # positions 0..31: float32 angles are nearly exact there, so both sit near the floor
    near = bf16_error_comparison(positions_start=0, n_positions=32, head_dim=64, seed=1)
    assert near["hf_mean"] < a["hf_mean"]
    assert set(a) >= {"ropekit_mean", "ropekit_max", "hf_mean", "hf_max"}
    assert all(isinstance(v, float) and v >= 0 for v in a.values())

