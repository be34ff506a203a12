"""Scaling rules on their own: the papers' formulas, their limits, validation and rule_from_dict."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ropekit
from ropekit.config.rules import rope_type_of
from ropekit.scaling import (
    NTK,
    DynamicNTK,
    Linear,
    Llama3,
    LongRoPE,
    Proportional,
    YaRN,
    rule_from_dict,
)

torch.set_num_threads(1)

BASE = 10000.0


def theta(dim, base=BASE):
    return base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def close(a, b, rtol=1e-13):
    torch.testing.assert_close(a, b, rtol=rtol, atol=0.0)


# -- the formulas -------------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [1.0, 2.0, 8.0, 32.5])
def test_linear_is_position_interpolation(factor):
    inv_freq, scale = Linear(factor).compute(128, BASE)
    close(inv_freq, theta(128) / factor)
    assert scale == 1.0 and inv_freq.dtype == torch.float64 and inv_freq.shape == (64,)
    # rotating position m with inv_freq/factor is rotating position m/factor with theta
    angles = 3000 * inv_freq
    close(angles, (3000 / factor) * theta(128), rtol=1e-12)


@pytest.mark.parametrize("dim", [2, 8, 64, 128])
@pytest.mark.parametrize("factor", [1.0, 4.0, 16.0])
def test_ntk_keeps_the_highest_and_interpolates_the_lowest_frequency(dim, factor):
    inv_freq, scale = NTK(factor).compute(dim, BASE)
    assert scale == 1.0 and inv_freq[0] == 1.0
    if dim > 2:
        close(inv_freq[-1:], theta(dim)[-1:] / factor, rtol=1e-12)
        close(inv_freq, theta(dim, BASE * factor ** (dim / (dim - 2))))
    assert bool((inv_freq <= theta(dim) * (1 + 1e-12)).all())


def test_dynamic_ntk_is_plain_rope_up_to_the_original_length():
    rule = DynamicNTK(4.0, 2048)
    assert rule.dynamic
    for seq_len in (None, 0, 1, 2047, 2048):
        inv_freq, scale = rule.compute(64, BASE, seq_len)
        close(inv_freq, theta(64))
        assert scale == 1.0


def test_dynamic_ntk_grows_the_base_with_the_sequence():
    rule = DynamicNTK(4.0, 2048)
    previous = theta(64)
    for seq_len in (2049, 4096, 8192, 65536):
        inv_freq, _ = rule.compute(64, BASE, seq_len)
        alpha = 4.0 * seq_len / 2048 - 3.0
        close(inv_freq, theta(64, BASE * alpha ** (64 / 62)))
        assert bool((inv_freq[1:] < previous[1:]).all()) and inv_freq[0] == 1.0
        previous = inv_freq


def test_dynamic_ntk_fixed_seq_len_is_static_and_consistent():
    rule = DynamicNTK(4.0, 2048, fixed_seq_len=8192)
    assert not rule.dynamic
    expected, _ = DynamicNTK(4.0, 2048).compute(64, BASE, 8192)
    for seq_len in (None, 1, 4096, 100_000):
        close(rule.compute(64, BASE, seq_len)[0], expected)


def test_yarn_attention_factor_forms():
    assert YaRN(1.0, 4096).attention_scale() == 1.0
    assert YaRN(10.0, 4096).attention_scale() == 0.1 * math.log(10.0) + 1.0
    assert YaRN(10.0, 4096, attention_factor=0.5).compute(64, BASE)[1] == 0.5
    ratio = (0.1 * 0.9 * math.log(40) + 1) / (0.1 * 0.7 * math.log(40) + 1)
    assert YaRN(40.0, 4096, mscale=0.9, mscale_all_dim=0.7).attention_scale() == pytest.approx(ratio, rel=1e-15)
    assert YaRN(40.0, 4096, mscale=0.707, mscale_all_dim=0.707).attention_scale() == 1.0  # DeepSeek-V2
    # Hugging Face: mscale without a truthy mscale_all_dim falls back to 0.1 ln(s) + 1
    assert YaRN(40.0, 4096, mscale=0.707).attention_scale() == 0.1 * math.log(40) + 1.0
    assert YaRN(40.0, 4096, mscale=0.707, mscale_all_dim=0.0).attention_scale() == 0.1 * math.log(40) + 1.0


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("factor", [2.0, 16.0, 40.0])
def test_yarn_blends_extrapolation_and_interpolation(truncate, factor):
    rule = YaRN(factor, 4096, truncate=truncate)
    inv_freq, _ = rule.compute(128, BASE)
    t = theta(128)
    low, high = rule.ramp_bounds(128, BASE)
    assert 0 < low < high < 64
    if truncate:
        assert low == int(low) and high == int(high)
    index = torch.arange(64)
    close(inv_freq[index <= low], t[index <= low])  # many rotations: kept
    close(inv_freq[index >= high], t[index >= high] / factor)  # few rotations: PI
    assert bool(((inv_freq >= t / factor * (1 - 1e-12)) & (inv_freq <= t * (1 + 1e-12))).all())
    # the boundaries are where the wavelength fits beta_fast / beta_slow times in L
    wavelength = 2 * math.pi / t
    rotations = 4096 / wavelength
    assert bool((rotations[index < math.floor(low)] > 32).all())
    assert bool((rotations[index > math.ceil(high)] < 1).all())


def test_yarn_factor_one_is_plain_rope():
    inv_freq, scale = YaRN(1.0, 4096).compute(64, BASE)
    close(inv_freq, theta(64))
    assert scale == 1.0


def test_llama3_bands_and_continuity():
    rule = Llama3(8.0, 1.0, 4.0, 8192)
    t = theta(128, 500000.0)
    inv_freq, scale = rule.compute(128, 500000.0)
    assert scale == 1.0
    wavelength = 2 * math.pi / t
    high = wavelength < 8192 / 4
    low = wavelength > 8192 / 1
    close(inv_freq[high], t[high])
    close(inv_freq[low], t[low] / 8.0)
    mid = ~high & ~low
    assert mid.any()
    ratio = inv_freq[mid] / t[mid]
    assert bool(((ratio > 1 / 8) & (ratio < 1)).all())
    # the smooth factor reaches 1 at the high edge and 0 at the low edge: with many pairs the
    # scale ratio moves by small steps only, a jump of ~(1 - 1/8) would show a seam
    fine, _ = rule.compute(4096, 500000.0)
    ratio = fine / theta(4096, 500000.0)
    assert float(ratio.diff().abs().max()) < 0.02
    assert float(ratio.max()) == 1.0 and float(ratio.min()) == pytest.approx(1 / 8, rel=1e-14)


def test_llama3_equal_band_edges_are_a_hard_cut():
    t = theta(128, 500000.0)
    inv_freq, _ = Llama3(16.0, 1.0, 1.0, 8192).compute(128, 500000.0)  # Llama 4 Scout
    close(inv_freq, torch.where(2 * math.pi / t > 8192, t / 16.0, t))
    assert bool(torch.isfinite(inv_freq).all())


def test_longrope_switches_at_the_original_length():
    short = [1.0 + i / 10 for i in range(32)]
    long = [2.0 + i for i in range(32)]
    rule = LongRoPE(short, long, 4096, factor=32.0)
    assert rule.dynamic and rule.short_factor == tuple(short)
    expected_scale = math.sqrt(1 + math.log(32.0) / math.log(4096))
    for seq_len, factors in ((None, short), (1, short), (4096, short), (4097, long), (131072, long)):
        inv_freq, scale = rule.compute(64, BASE, seq_len)
        close(inv_freq, theta(64) / torch.tensor(factors, dtype=torch.float64))
        assert scale == expected_scale  # applied on both sides of the switch
    assert LongRoPE(short, long, 4096, factor=1.0).attention_scale() == 1.0
    assert LongRoPE(short, long, 4096, attention_factor=0.8).attention_scale() == 0.8
    frozen = dataclasses.replace(rule, fixed_seq_len=4097)
    assert not frozen.dynamic
    close(frozen.compute(64, BASE, 10)[0], rule.compute(64, BASE, 5000)[0])


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 1.0])
def test_proportional_zeroes_the_low_frequencies(share):
    inv_freq, scale = Proportional(share, 2.0).compute(512, 1e6)
    kept = int(share * 512 // 2)
    close(inv_freq[:kept], theta(512, 1e6)[:kept] / 2.0)
    assert bool((inv_freq[kept:] == 0).all()) and scale == 1.0
    if share == 1.0:
        close(inv_freq, Linear(2.0).compute(512, 1e6)[0])


@st.composite
def rules(draw):
    factor = draw(st.floats(1.0, 64.0))
    length = draw(st.sampled_from([512, 2048, 4096, 8192, 32768]))
    kind = draw(st.sampled_from(["linear", "ntk", "yarn", "llama3"]))
    if kind == "linear":
        return Linear(factor)
    if kind == "ntk":
        return NTK(factor)
    if kind == "yarn":
        slow = draw(st.floats(0.25, 4.0))
        fast = draw(st.floats(slow, 128.0))
        return YaRN(factor, length, beta_fast=fast, beta_slow=slow, truncate=draw(st.booleans()))
    low = draw(st.floats(0.25, 4.0))
    return Llama3(factor, low, draw(st.floats(low * 1.01, 16.0)), length)


@given(rule=rules(), dim=st.sampled_from([4, 16, 64, 96, 128, 256]), base=st.sampled_from([1e4, 5e5, 1e6, 1e7]))
def test_static_rules_only_slow_frequencies_down_by_at_most_the_factor(rule, dim, base):
    inv_freq, scale = rule.compute(dim, base)
    t = theta(dim, base)
    assert inv_freq.shape == (dim // 2,) and inv_freq.dtype == torch.float64
    assert math.isfinite(scale) and scale >= 1.0
    assert bool(((inv_freq <= t * (1 + 1e-12)) & (inv_freq >= t / rule.factor * (1 - 1e-12))).all())
    assert bool((inv_freq[1:] <= inv_freq[:-1]).all())  # still a decreasing spectrum


# -- validation: every error names the key and the value -----------------------------------------


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: Linear(0.5), ["factor", "0.5"]),
        (lambda: Linear("2"), ["factor", "'2'"]),
        (lambda: NTK(float("nan")), ["factor", "nan"]),
        (lambda: DynamicNTK(2.0, 0), ["original_max_position_embeddings", "0"]),
        (lambda: DynamicNTK(2.0, 4096, fixed_seq_len=-1), ["fixed_seq_len", "-1"]),
        (lambda: YaRN(0.9, 4096), ["factor", "0.9"]),
        (lambda: YaRN(4.0, 4096, beta_fast=1, beta_slow=32), ["beta_fast", "beta_slow", "32"]),
        (lambda: YaRN(4.0, 4096, beta_fast=0), ["beta_fast", "0"]),
        (lambda: YaRN(4.0, 4096, attention_factor=0.0), ["attention_factor", "0.0"]),
        (lambda: YaRN(4.0, 4096, truncate="yes"), ["truncate", "'yes'"]),
        (lambda: YaRN(4.0, 4096.5), ["original_max_position_embeddings", "4096.5"]),
        (lambda: YaRN(4.0, 4096, mscale=1.0, mscale_all_dim=-10 / math.log(4.0)), ["mscale_all_dim"]),
        (lambda: Llama3(8.0, 4.0, 1.0, 8192), ["high_freq_factor", "low_freq_factor", "4.0"]),
        (lambda: Llama3(8.0, 0.0, 4.0, 8192), ["low_freq_factor", "0.0"]),
        (lambda: LongRoPE([1.0] * 4, [1.0] * 3, 4096, factor=2.0), ["short_factor", "long_factor", "4", "3"]),
        (lambda: LongRoPE([1.0, -2.0], [1.0, 1.0], 4096, factor=2.0), ["short_factor[1]", "-2.0"]),
        (lambda: LongRoPE([1.0], [1.0], 4096), ["factor", "attention_factor"]),
        (lambda: LongRoPE([1.0], [1.0], 4096, factor=0.5), ["factor", "0.5"]),
        (lambda: Proportional(1.5), ["partial_rotary_factor", "1.5"]),
    ],
)
def test_rule_errors_name_the_key_and_value(make, words):
    with pytest.raises(ValueError) as info:
        make()
    for word in words:
        assert word in str(info.value)


def test_compute_time_errors():
    with pytest.raises(ValueError, match=r"short_factor and long_factor have 4 entries, rotary_dim=64 needs 32"):
        LongRoPE([1.0] * 4, [1.0] * 4, 4096, factor=2.0).compute(64, BASE)
    with pytest.raises(ValueError, match=r"base \(rope_theta\) must be > 1, got 1.0"):
        YaRN(4.0, 4096).compute(64, 1.0)


def test_rules_are_frozen_hashable_values():
    rule = YaRN(4, 32768)
    assert rule.factor == 4.0 and isinstance(rule.factor, float)
    assert rule == YaRN(4.0, 32768) and hash(rule) == hash(YaRN(4.0, 32768))
    assert hash(LongRoPE([1, 2], [3, 4], 10, factor=2)) == hash(LongRoPE((1.0, 2.0), (3.0, 4.0), 10, factor=2.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.factor = 2.0
    assert [r.dynamic for r in (Linear(2), NTK(2), YaRN(2, 8), Llama3(2), Proportional())] == [False] * 5


# -- rule_from_dict ------------------------------------------------------------------------------

PHI = {"short_factor": [1.0] * 48, "long_factor": [4.0] * 48}


@pytest.mark.parametrize(
    "params, expected",
    [
        ({"rope_type": "linear", "factor": 2}, Linear(2.0)),
        ({"type": "linear", "factor": 2.0, "rope_theta": 1e4}, Linear(2.0)),
        ({"rope_type": "ntk", "factor": 4.0}, NTK(4.0)),
        ({"type": "dynamic", "factor": 2.0}, DynamicNTK(2.0, 4096)),
        ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, YaRN(4.0, 32768)),
        ({"type": "yarn", "factor": 4.0}, YaRN(4.0, 4096)),  # original length defaults to max_position_embeddings
        ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 1024}, YaRN(4.0, 1024)),
        (
            {"rope_type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
             "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "attention_factor": None},
            YaRN(40.0, 4096, mscale=0.707, mscale_all_dim=0.707),
        ),
        ({"rope_type": "yarn", "factor": 32.0, "truncate": False, "beta_fast": None}, YaRN(32.0, 4096, truncate=False)),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192},
            Llama3(8.0, 1.0, 4.0, 8192),
        ),
        ({"type": "su", **PHI, "original_max_position_embeddings": 1024}, LongRoPE(**PHI,
         original_max_position_embeddings=1024, factor=4.0)),
        ({"type": "yarn", **PHI}, LongRoPE(**PHI, original_max_position_embeddings=4096, factor=1.0)),  # Phi-3 BC
        ({"rope_type": "longrope", **PHI, "factor": 2.0, "attention_factor": 1.1},
         LongRoPE(**PHI, original_max_position_embeddings=4096, factor=2.0, attention_factor=1.1)),
        ({"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}, Proportional(0.25)),
        ({"rope_type": "proportional"}, Proportional(1.0, 1.0)),
    ],
)
def test_rule_from_dict(params, expected):
    assert rule_from_dict(params, max_position_embeddings=4096) == expected


@pytest.mark.parametrize(
    "params, kwargs, words",
    [
        ({"rope_type": "default"}, {}, ["'default'", "scaling=None"]),
        ({}, {}, ["'default'"]),
        ({"type": "mrope", "mrope_section": [16, 24, 24]}, {}, ["'mrope'"]),
        ({"rope_type": "dynamic-yarn", "factor": 2.0}, {}, ["rope_type", "'dynamic-yarn'"]),
        ({"type": "bogus"}, {}, ["type", "'bogus'"]),
        ({"rope_type": "yarn", "type": "linear", "factor": 2.0}, {}, ["'yarn'", "'linear'"]),
        ({"rope_type": 3}, {}, ["rope_type", "3"]),
        ({"rope_type": "linear"}, {}, ["'factor'"]),
        ({"rope_type": "linear", "factor": 0.5}, {}, ["factor", "0.5"]),
        ({"rope_type": "linear", "factor": 2.0, "beta_fast": 32}, {}, ["'beta_fast'=32"]),
        ({"rope_type": "dynamic", "factor": 2.0}, {}, ["max_position_embeddings", "None"]),
        ({"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 2048},
         {"max_position_embeddings": 4096}, ["'original_max_position_embeddings'=2048"]),
        ({"rope_type": "yarn", "factor": 4.0}, {}, ["'original_max_position_embeddings'"]),
        ({"rope_type": "yarn", "original_max_position_embeddings": 1024}, {}, ["'factor'"]),
        ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, {}, ["'low_freq_factor'"]),
        ({"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 4, "factor": 2.0},
         {"max_position_embeddings": 4096, "rotary_dim": 64}, ["4 entries", "rotary_dim=64", "32"]),
        ({"rope_type": "longrope", "long_factor": [1.0], "factor": 2.0}, {"max_position_embeddings": 8},
         ["'short_factor'"]),
        ({"rope_type": "linear", "factor": 2.0}, {"max_position_embeddings": -5}, ["max_position_embeddings", "-5"]),
    ],
)
def test_rule_from_dict_errors_name_the_key_and_value(params, kwargs, words):
    with pytest.raises(ValueError) as info:
        rule_from_dict(params, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_rule_from_dict_rejects_non_mappings_and_keeps_metadata_keys():
    with pytest.raises(TypeError, match="dict"):
        rule_from_dict([("rope_type", "linear")])
    meta = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6, "partial_rotary_factor": 0.5,
            "mrope_section": [1, 2], "finetuned": True}
    assert rule_from_dict(meta) == Linear(2.0)
    assert rope_type_of({"type": "su"}) == "longrope" and rope_type_of({}) == "default"


def test_inv_frequencies_accepts_a_rope_dict():
    inv_freq, scale = ropekit.inv_frequencies(64, BASE, {"rope_type": "linear", "factor": 4.0})
    close(inv_freq, theta(64) / 4)
    assert scale == 1.0
