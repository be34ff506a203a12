"""The model-level comparisons detect a broken rotation: each mutation below must make them fail.

Each test breaks ropekit's rotation inside a patched model (monkeypatching the table builder or
the kernel entry the transformers integration calls), runs the comparison the integration tests
assert (tests/model_compare.py) against the unpatched model, and asserts that it reports a
mismatch. A mutation that RoPE itself cannot see (every position shifted alike: only relative
positions matter) must pass, which shows the comparison is not failing for unrelated reasons.

The xPos and ALiBi modules are checked the same way with the comparisons of tests/test_nn_xpos.py
and tests/test_nn_alibi.py (their ``*_mismatch`` functions over their ``*_CASES``): for each
mutation the set of comparisons that fail is asserted exactly, so a comparison that stops seeing
a mutation fails here, and one that sees a mutation it cannot (a uniform shift of the positions,
invisible to every score) fails too.
"""

import pytest
import torch

pytest.importorskip("transformers")

import ropekit.integrations.transformers as integ  # noqa: E402
import ropekit.nn.alibi as alibi_module  # noqa: E402
import ropekit.nn.rotary as rotary_module  # noqa: E402
import ropekit.nn.xpos as xpos_module  # noqa: E402
import test_integration_fused as fused  # noqa: E402
import test_integration_transformers as plain  # noqa: E402
import test_nn_alibi as alibi_tests  # noqa: E402
import test_nn_xpos as xpos_tests  # noqa: E402
from model_compare import bfloat16_mismatch, logits_mismatch  # noqa: E402
from ropekit.integrations.transformers import patch, unpatch  # noqa: E402
from ropekit.nn import ALiBiSelfAttention, XPosEmbedding  # noqa: E402

OTHER_LAYOUT = {"half": "interleaved", "interleaved": "half"}


def swapped_pairing(real):
    """The kernel entry called with the other pairing (interleaved for half and back)."""
    def call(*args, layout, **kwargs):
        return real(*args, layout=OTHER_LAYOUT[layout], **kwargs)
    return call


def base_times_1000(real):
    """Tables built with ``base * 1000``: ``inv_freq_i = base^(-2i/d)`` times ``1000^(-2i/d)``."""
    def call(positions, inv_freq, **kwargs):
        pairs = inv_freq.numel()
        return real(positions, inv_freq * 1000.0 ** (-torch.arange(pairs, dtype=inv_freq.dtype) / pairs), **kwargs)
    return call


def positions_off_by_one(real):
    """Every position after the first one too far (position 0, 2, 3, ...): a miscounted first token."""
    def call(positions, inv_freq, **kwargs):
        return real(positions + (positions > 0), inv_freq, **kwargs)
    return call


def positions_all_shifted(real):
    """Every position one too far: relative positions are unchanged, so the logits must not move."""
    def call(positions, inv_freq, **kwargs):
        return real(positions + 1, inv_freq, **kwargs)
    return call


# name -> (integration function replaced, mutation); the kernel entries of the plain and the fused path
MUTATIONS = {
    "swapped pairing": (("apply_rotary_qk", "rms_norm_rotary_qk", "rms_norm_rotary"), swapped_pairing),
    "base x1000": (("cos_sin",), base_times_1000),
    "positions off by one": (("cos_sin",), positions_off_by_one),
}


def mutate(monkeypatch, names, mutation):
    for name in names:
        monkeypatch.setattr(integ, name, mutation(getattr(integ, name)))


def patched_run(monkeypatch, model, names, mutation, run):
    """``run()`` on ``model`` patched by ropekit with ``names`` mutated; the model is unpatched after."""
    with monkeypatch.context() as m:
        mutate(m, names, mutation)
        patch(model)
        try:
            return run()
        finally:
            unpatch(model)


def plain_mismatch(monkeypatch, names, mutation, family="llama"):
    """The float32 comparison of test_integration_transformers, with the patched model mutated."""
    model = plain.tiny(family)
    ref = plain.logits(model, plain.IDS)
    out = patched_run(monkeypatch, model, names, mutation, lambda: plain.logits(model, plain.IDS))
    return logits_mismatch(out, ref)


@pytest.mark.parametrize("family", ["llama", "phi3"])  # full and partial rotary
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_float32_comparison_detects_each_mutation(monkeypatch, mutation, family):
    names, mutate_fn = MUTATIONS[mutation]
    assert plain_mismatch(monkeypatch, (), lambda real: real, family) is None  # unmutated: it matches
    problem = plain_mismatch(monkeypatch, names, mutate_fn, family)
    assert problem is not None and "logits differ" in problem, f"{mutation} went unnoticed in {family}"


def test_float32_comparison_passes_a_uniform_shift(monkeypatch):
    assert plain_mismatch(monkeypatch, ("cos_sin",), positions_all_shifted) is None


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_fused_comparison_detects_each_mutation(monkeypatch, mutation):
    """qwen3 (q/k norms fused with the rotation), as test_integration_fused compares it."""
    names, mutate_fn = MUTATIONS[mutation]
    model = fused.tiny("qwen3")
    ref, _ = fused.run(model)
    out = patched_run(monkeypatch, model, names, mutate_fn, lambda: fused.run(model)[0])
    assert logits_mismatch(out, ref) is not None, f"{mutation} went unnoticed"


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_bfloat16_comparison_detects_each_mutation(monkeypatch, mutation):
    """The bfloat16 bound of test_integration_transformers (no farther from float32 than transformers' own).

    On the model that test uses (qwen2 with q/k projections times ``QK_GAIN``): at the default
    initialisation a one-position shift moved the logits less than bfloat16 rounding does.
    """
    names, mutate_fn = MUTATIONS[mutation]
    model = plain.sharp(plain.tiny("qwen2")).to(torch.bfloat16)
    exact = plain.logits(plain.sharp(plain.tiny("qwen2")).to(torch.bfloat16).float(), plain.IDS)
    ref = plain.logits(model, plain.IDS)
    out = patched_run(monkeypatch, model, names, mutate_fn, lambda: plain.logits(model, plain.IDS))
    assert bfloat16_mismatch(out, ref, exact) is not None, f"{mutation} went unnoticed in bfloat16"


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_fused_bfloat16_comparison_detects_each_mutation(monkeypatch, mutation):
    """The bfloat16 bound of test_integration_fused, on qwen3."""
    names, mutate_fn = MUTATIONS[mutation]
    model = fused.tiny("qwen3", torch.bfloat16)
    exact, _ = fused.run(fused.tiny("qwen3", torch.bfloat16).float())
    ref, _ = fused.run(model)
    out = patched_run(monkeypatch, model, names, mutate_fn, lambda: fused.run(model)[0])
    assert bfloat16_mismatch(out, ref, exact) is not None, f"{mutation} went unnoticed in bfloat16"


# -- xPos and ALiBi modules: each mutation against the comparisons of test_nn_xpos / test_nn_alibi ----------

def over(cases, comparison):
    """Whether ``comparison`` reports a mismatch for any of ``cases`` (a test parametrized by them fails)."""
    return any(comparison(*case) is not None for case in cases)


def xpos_checks():
    """name -> whether the comparison of tests/test_nn_xpos.py fails over its fixed cases."""
    return {"formula": over(xpos_tests.FORMULA_CASES, xpos_tests.formula_mismatch),
            "rotary-embedding-torch": over(xpos_tests.PEER_CASES, xpos_tests.peer_mismatch),
            "distance only": over(xpos_tests.SHIFT_CASES, xpos_tests.shift_mismatch)}


def alibi_checks():
    """name -> whether the comparison of tests/test_nn_alibi.py fails over its fixed cases."""
    return {"slopes": over([(h,) for h in alibi_tests.SLOPE_HEADS], alibi_tests.slopes_mismatch),
            "bias": over(alibi_tests.BIAS_CASES, alibi_tests.bias_mismatch),
            "attention": over(alibi_tests.ATTENTION_CASES, alibi_tests.attention_mismatch),
            "distance only": over(alibi_tests.SHIFT_CASES, alibi_tests.shift_mismatch)}


def scale_positions(change):
    """XPosEmbedding's scale exponents computed at ``change(positions)``."""
    def wrap(real):
        def call(self, positions):
            return real(self, change(positions))
        return call
    return wrap


def keys_scaled_like_queries(real):
    """Keys multiplied by zeta^(+(m-c)/B), the queries' factor, instead of its reciprocal."""
    def call(self, x, positions, offset, seq_dim, key):
        return real(self, x, positions, offset, seq_dim, False)
    return call


def scale_base_doubled(real):
    """Exponents (n - c) / (2B): the decay of a scale base twice the paper's."""
    def call(self, positions):
        return real(self, positions) / 2
    return call


def zeta_from_i_over_d(real):
    """zeta_i = (i/d + gamma) / (1 + gamma) (pair index over the channels, not 2i/d)."""
    def call(rotary_dim, gamma=0.4):
        return real(2 * rotary_dim, gamma)[: rotary_dim // 2]
    return call


ROTATION_ENTRIES = ("rotate", "rotate_qk", "apply_rotary", "apply_rotary_qk")  # what RotaryEmbedding calls

# name -> ([(owner, attribute), ...] replaced, mutation, the xPos comparisons expected to fail)
ALL_XPOS = {"formula", "rotary-embedding-torch", "distance only"}
XPOS_MUTATIONS = {
    "swapped pairing": ([(rotary_module, n) for n in ROTATION_ENTRIES], swapped_pairing, ALL_XPOS),
    "zeta reversed across pairs": ([(xpos_module, "xpos_zeta")], lambda real: lambda *a, **k: real(*a, **k).flip(0),
                                   ALL_XPOS),
    "base x1000": ([(rotary_module, "cos_sin")], base_times_1000, ALL_XPOS),
    "scale base x2": ([(XPosEmbedding, "_log_scale")], scale_base_doubled, ALL_XPOS),
    "zeta from i/d": ([(xpos_module, "xpos_zeta")], zeta_from_i_over_d, ALL_XPOS),
    "keys scaled like queries": ([(XPosEmbedding, "_channel_scale")], keys_scaled_like_queries, ALL_XPOS),
    "positions off by one (rotation)": ([(rotary_module, "cos_sin")], positions_off_by_one, ALL_XPOS),
    "positions off by one (scale)": ([(XPosEmbedding, "_log_scale")], scale_positions(lambda p: p + (p > 0)),
                                     ALL_XPOS),
    # every scale position one too far is a centre one too low: q' and k' move, no score does
    "scale positions all shifted": ([(XPosEmbedding, "_log_scale")], scale_positions(lambda p: p + 1),
                                    {"formula", "rotary-embedding-torch"}),
}


def alibi_positions(change):
    """ALiBiSelfAttention's query and key positions replaced by ``change`` of them."""
    def wrap(real):
        def call(self, batch, seq, positions, past, device):
            query, key = real(self, batch, seq, positions, past, device)
            return change(query), change(key)
        return call
    return wrap


def keys_one_late(real):
    """The bias of key j computed at position j + 1: -m_h |i - j - 1|."""
    def call(slopes, query_positions, key_positions):
        return real(slopes, query_positions, key_positions + 1)
    return call


def power_of_two_rule_everywhere(real):
    """2^(-8(h+1)/n) for every head count (no interpolation for n not a power of two)."""
    def call(num_heads):
        return torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)], dtype=torch.float64)
    return call


ALL_ALIBI = {"slopes", "bias", "attention"}
ALIBI_MUTATIONS = {
    "slopes in reverse head order": ([(alibi_module, "alibi_slopes")], lambda real: lambda n: real(n).flip(0),
                                     ALL_ALIBI),
    "slope ratio 2^(-4/n)": ([(alibi_module, "alibi_slopes")], lambda real: lambda n: real(n).sqrt(), ALL_ALIBI),
    "power-of-two rule for every head count": ([(alibi_module, "alibi_slopes")], power_of_two_rule_everywhere,
                                               ALL_ALIBI),
    "bias sign flipped": ([(alibi_module, "alibi_bias")], lambda real: lambda *a: -real(*a), {"bias", "attention"}),
    "keys one position late": ([(alibi_module, "alibi_bias")], keys_one_late, {"bias", "attention"}),
    "positions off by one": ([(ALiBiSelfAttention, "_positions")], alibi_positions(lambda p: p + (p > 0)),
                             {"bias", "attention", "distance only"}),
    # every position one too far: only distances enter the bias, so nothing may fail
    "positions all shifted": ([(ALiBiSelfAttention, "_positions")], alibi_positions(lambda p: p + 1), set()),
}


def checks_under(monkeypatch, replaced, mutation, checks):
    with monkeypatch.context() as m:
        for owner, name in replaced:
            m.setattr(owner, name, mutation(getattr(owner, name)))
        return checks()


COMPARISONS = {"xpos": (xpos_checks, XPOS_MUTATIONS), "alibi": (alibi_checks, ALIBI_MUTATIONS)}


@pytest.mark.parametrize("module", sorted(COMPARISONS))
def test_comparisons_pass_the_module_as_it_is(module):
    checks, _ = COMPARISONS[module]
    assert not any(checks().values())


CASES = [(module, name) for module, (_, table) in sorted(COMPARISONS.items()) for name in sorted(table)]


@pytest.mark.parametrize(("module", "mutation"), CASES)
def test_comparisons_detect_each_mutation(monkeypatch, module, mutation):
    checks, table = COMPARISONS[module]
    replaced, mutate_fn, expected = table[mutation]
    caught = checks_under(monkeypatch, replaced, mutate_fn, checks)
    assert {name for name, failed in caught.items() if failed} == expected, caught
