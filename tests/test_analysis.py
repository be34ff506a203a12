"""ropekit.rope.analysis / inspect's JSON / the lab's experiments / presets against numpy and RopeConfig."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import ropekit
from ropekit import RopeConfig
from ropekit.cli import inspect_json
from ropekit.config import presets
from ropekit.rope import analysis
from ropekit.scaling import Llama3, YaRN
from ropekit_lab import experiments

torch.set_num_threads(1)

FIXTURES = Path(__file__).parent / "fixtures" / "configs"


def numpy_decay(dim: int, base: float, distances) -> np.ndarray:
    """Seed 001 eq. 37 written out with explicit complex sums: (1/(d/2)) sum_j |sum_{i<j} e^{i r theta_i}|."""
    n = dim // 2
    theta = base ** (-2.0 * np.arange(n) / dim)
    out = []
    for r in distances:
        terms = np.exp(1j * r * theta)
        out.append(sum(abs(terms[:j].sum()) for j in range(1, n + 1)) / n)
    return np.array(out)


# -- decay bound ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dim, base", [(16, 10000.0), (128, 10000.0), (64, 500000.0)])
def test_decay_bound_matches_direct_complex_sums(dim, base):
    distances = [0, 1, 2, 3, 7, 50, 255, 1000, 12345]
    got = analysis.decay_bound(ropekit.base_inv_freq(dim, base), torch.tensor(distances)).numpy()
    np.testing.assert_allclose(got, numpy_decay(dim, base, distances), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dim", [2, 8, 128])
def test_decay_bound_at_zero_is_mean_of_j(dim):
    n = dim // 2
    value = float(analysis.decay_bound(ropekit.base_inv_freq(dim), torch.tensor([0]))[0])
    assert value == pytest.approx(sum(range(1, n + 1)) / n) == pytest.approx((n + 1) / 2)


def test_decay_bound_decays_on_average():
    bound = analysis.decay_bound(ropekit.base_inv_freq(128), torch.arange(257)).numpy()
    windows = [bound[a : a + 32].mean() for a in range(0, 256, 32)]  # seed 001 Fig. 2: decays, with ripples
    assert all(later < earlier for earlier, later in zip(windows, windows[1:], strict=False))
    assert windows[0] > 2 * windows[-1]
    assert bound.max() == bound[0]


# -- Men et al.: B_m and the base bound -------------------------------------------------------------


def test_similarity_margin_is_sum_of_cosines():
    theta = ropekit.base_inv_freq(32, 10000.0)
    m = torch.tensor([0, 1, 17, 4096])
    expected = np.cos(np.outer(m.numpy(), theta.numpy())).sum(-1)
    np.testing.assert_allclose(analysis.similarity_margin(theta, m).numpy(), expected, rtol=0, atol=1e-12)
    positions = torch.arange(5000)
    first = analysis.first_negative_position(theta, positions)
    margin = np.cos(np.outer(np.arange(5000), theta.numpy())).sum(-1)
    assert first == int(np.argmax(margin < 0))


@pytest.mark.parametrize("dim, context", [(64, 512), (128, 1024), (32, 2048)])
def test_base_lower_bound_satisfies_the_property_and_grid_below_fails(dim, context):
    result = analysis.base_lower_bound(dim, context)
    base = result["base"]
    assert result["exact_positions"] and result["context"] == context and "2405.14591" in result["method"]
    m = np.arange(context + 1)
    theta = base ** (-2.0 * np.arange(dim // 2) / dim)
    assert np.cos(np.outer(m, theta)).sum(-1).min() >= 0
    # every grid base (64 per decade) below the reported one fails: the scan took the first that passes
    k_found = math.ceil(math.log10(base) * 64 - 1e-9)
    for k in range(k_found - 8, k_found):
        grid = 10.0 ** (k / 64)
        if grid < base / 1.0021:
            theta = grid ** (-2.0 * np.arange(dim // 2) / dim)
            assert np.cos(np.outer(m, theta)).sum(-1).min() < 0, grid


def test_base_lower_bound_grows_with_context_and_handles_d2():
    small, large = (analysis.base_lower_bound(128, n)["base"] for n in (1024, 8192))
    assert 3e3 < small < 1e4 and 5e4 < large < 2e5  # the paper's fit 0.0424 L^1.628 gives 3.4e3 and 1.0e5
    assert analysis.base_lower_bound(2, 100, max_base=1e6)["base"] is None  # B_2 = cos(2) < 0 for any base


def test_bound_positions_subsamples_long_contexts():
    positions, exact = analysis.bound_positions(100)
    assert exact and positions.tolist() == list(range(101))
    positions, exact = analysis.bound_positions(10_000, budget=1024)
    assert not exact and positions[0] == 0 and positions[-1] == 10_000 and len(positions) <= 1024
    assert torch.all(positions[1:] > positions[:-1])


# -- regimes and describe() against RopeConfig -----------------------------------------------------


@pytest.mark.parametrize("rule", [YaRN(4.0, 4096), YaRN(32.0, 4096, truncate=False), Llama3(8.0, 1.0, 4.0, 8192)])
def test_regimes_agree_with_the_rule(rule):
    dim, base = 128, 500000.0
    theta = ropekit.base_inv_freq(dim, base)
    inv_freq, _ = ropekit.inv_frequencies(dim, base, rule)
    regimes = analysis.pair_regimes(rule, dim, base)
    assert set(regimes) == {"extrapolated", "blended", "interpolated"}
    for i, regime in enumerate(regimes):
        if regime == "extrapolated":
            assert inv_freq[i] == pytest.approx(float(theta[i]), rel=1e-12)
        elif regime == "interpolated":
            assert inv_freq[i] == pytest.approx(float(theta[i]) / rule.factor, rel=1e-12)
        else:
            assert float(theta[i]) / rule.factor < inv_freq[i] < float(theta[i])
    assert analysis.pair_regimes(None, dim, base) is None


@pytest.mark.parametrize("name", ["llama-3.1-8b.json", "phi-3-mini-128k-instruct.json", "gpt-neox-20b.json",
                                  "deepseek-v3.json", "llama-2-7b-dynamic-ntk.json"])
def test_describe_matches_rope_config(name):
    config = RopeConfig.from_hf(json.loads((FIXTURES / name).read_text()))
    info = inspect_json.describe(config, bound=False)
    inv_freq, scale = config.inv_frequencies(info["seq_len"])
    assert info["inv_freq"] == inv_freq.tolist()
    assert info["attention_scale"] == scale and info["logit_scale"] == pytest.approx(scale**2)
    assert (info["head_dim"], info["rotary_dim"], info["base"], info["layout"]) == (
        config.head_dim, config.rotary_dim, config.base, config.layout)
    assert info["pairs"] == len(info["wavelength"]) == config.rotary_dim // 2
    for f, w, r in zip(inv_freq.tolist(), info["wavelength"], info["rotations"], strict=True):
        assert w == pytest.approx(2 * math.pi / f) and r == pytest.approx(info["context"] * f / (2 * math.pi))
    assert info["pairs_without_full_rotation"] == sum(w > info["context"] for w in info["wavelength"])
    json.dumps(info, allow_nan=False)


def test_describe_takes_a_rope_config_only():
    with pytest.raises(TypeError, match="config must be a ropekit.RopeConfig, got dict"):
        inspect_json.describe({"head_dim": 64})


def test_default_context_uses_factor_times_original():
    qwen = RopeConfig.from_hf(presets.get_preset("qwen2.5-yarn"))
    assert inspect_json.default_context(qwen) == (131072, "factor x original_max_position_embeddings")
    assert inspect_json.default_context(RopeConfig(64)) == (inspect_json.DEFAULT_CONTEXT, "assumed")
    assert inspect_json.default_context(RopeConfig.from_hf(presets.get_preset("llama-2")))[0] == 4096


# -- presets ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_every_preset_loads_and_matches_its_fixture(name):
    config = RopeConfig.from_hf(presets.get_preset(name))
    fixture = FIXTURES / f"{name}.json"  # the published config.json the preset copies
    if not fixture.exists():
        fixture = FIXTURES.parent / "multiaxis" / f"{name}.json"
    assert fixture.exists() or name in ("default", "qwen2.5-7b-instruct")
    if fixture.exists():
        assert config == RopeConfig.from_hf(json.loads(fixture.read_text()))


def test_preset_aliases_and_unknown_names():
    assert presets.get_preset("Llama-3.1") == presets.get_preset("llama-3.1-8b")
    assert presets.get_preset("phi_3")["model_type"] == "phi3"
    presets.get_preset("mistral")["rope_theta"] = 1.0  # a copy: the table itself is untouched
    assert presets.get_preset("mistral")["rope_theta"] == 10000.0
    with pytest.raises(ValueError, match="unknown preset 'gpt-5'.*llama-2"):
        presets.get_preset("gpt-5")


# -- experiments --------------------------------------------------------------------------------------


def test_sinusoidal_cross_terms_move_rope_term_does_not():
    m, terms, rope = experiments.sinusoidal_terms(32, positions=128, distance=5)
    assert m.tolist() == list(range(128))
    total = sum(v for k, v in terms.items() if k != "total")
    torch.testing.assert_close(terms["total"], total)
    for key in ("content-position", "position-content", "position-position", "total"):
        assert float(terms[key].max() - terms[key].min()) > 0.1, key
    assert float(terms["content-content"].max() - terms["content-content"].min()) == 0.0
    assert float(rope.max() - rope.min()) < 1e-10


def test_attention_vs_distance_follows_men_et_al_expectation():
    inv_freq = ropekit.base_inv_freq(64, 10000.0)
    distances = torch.tensor([0, 1, 10, 100, 1000])
    samples = 4000
    out = experiments.attention_vs_distance(inv_freq, distances, samples=samples)
    tolerance = 5 * out["aligned_std"] / math.sqrt(samples)
    assert torch.all((out["aligned_mean"] - out["theory"]).abs() < tolerance)
    assert torch.all(out["random_mean"].abs() < 5 * out["random_std"] / math.sqrt(samples))
    assert float(out["theory"][0]) == pytest.approx(2 * 32 / 8)  # 2 * (d/2) / sqrt(d)


def test_scaling_comparison_rules_match_inv_frequencies():
    config = RopeConfig.from_hf(presets.get_preset("llama-3.1"))
    comparison = experiments.scaling_comparison(config, 131072)
    assert (comparison["factor"], comparison["original"]) == (8.0, 8192)
    names = [rule["name"] for rule in comparison["rules"]]
    assert names[0] == "this config (llama3)" and "none" in names and any(n.startswith("yarn") for n in names)
    own = comparison["rules"][0]
    torch.testing.assert_close(own["inv_freq"], config.inv_frequencies(131072)[0], rtol=0, atol=0)
    plain = RopeConfig(64, base=10000.0, max_positions=2048)
    comparison = experiments.scaling_comparison(plain, 2048)
    assert comparison["factor"] == 4.0 and comparison["original"] == 2048 and len(comparison["rules"]) == 6
