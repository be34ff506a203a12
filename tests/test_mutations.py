"""The model-level comparisons detect a broken rotation: each mutation below must make them fail.

Each test breaks ropekit's rotation inside a patched model (monkeypatching the table builder or
the kernel entry the transformers integration calls), runs the comparison the integration tests
assert (tests/model_compare.py) against the unpatched model, and asserts that it reports a
mismatch. A mutation that RoPE itself cannot see (every position shifted alike: only relative
positions matter) must pass, which shows the comparison is not failing for unrelated reasons.
"""

import pytest
import torch

pytest.importorskip("transformers")

import ropekit.integrations.transformers as integ  # noqa: E402
import test_integration_fused as fused  # noqa: E402
import test_integration_transformers as plain  # noqa: E402
from model_compare import bfloat16_mismatch, logits_mismatch  # noqa: E402
from ropekit.integrations.transformers import patch, unpatch  # noqa: E402

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


def plain_mismatch(monkeypatch, names, mutation, family="llama"):
    """The float32 comparison of test_integration_transformers, with the patched model mutated."""
    model = plain.tiny(family)
    ref = plain.logits(model, plain.IDS)
    with monkeypatch.context() as m:
        mutate(m, names, mutation)
        patch(model)
        try:
            out = plain.logits(model, plain.IDS)
        finally:
            unpatch(model)
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
    with monkeypatch.context() as m:
        mutate(m, names, mutate_fn)
        patch(model)
        try:
            out, _ = fused.run(model)
        finally:
            unpatch(model)
    assert logits_mismatch(out, ref) is not None, f"{mutation} went unnoticed"


@pytest.mark.parametrize("mutation", ["swapped pairing", "base x1000"])
def test_bfloat16_comparison_detects_pairing_and_base(monkeypatch, mutation):
    """The bfloat16 bound of test_integration_transformers (no farther from float32 than transformers' own).

    In this plain bfloat16 model a one-position shift moves the logits less than bfloat16 rounding
    does (rms ratio ~1.04); the float32 comparisons above and the fused bfloat16 one below catch it.
    """
    names, mutate_fn = MUTATIONS[mutation]
    model = plain.tiny("qwen2").to(torch.bfloat16)
    exact = plain.logits(plain.tiny("qwen2").to(torch.bfloat16).float(), plain.IDS)
    ref = plain.logits(model, plain.IDS)
    assert bfloat16_mismatch(ref, ref, exact) is None
    with monkeypatch.context() as m:
        mutate(m, names, mutate_fn)
        patch(model)
        try:
            out = plain.logits(model, plain.IDS)
        finally:
            unpatch(model)
    assert bfloat16_mismatch(out, ref, exact) is not None, f"{mutation} went unnoticed in bfloat16"


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_fused_bfloat16_comparison_detects_each_mutation(monkeypatch, mutation):
    """The bfloat16 bound of test_integration_fused, on qwen3."""
    names, mutate_fn = MUTATIONS[mutation]
    model = fused.tiny("qwen3", torch.bfloat16)
    exact, _ = fused.run(fused.tiny("qwen3", torch.bfloat16).float())
    ref, _ = fused.run(model)
    with monkeypatch.context() as m:
        mutate(m, names, mutate_fn)
        patch(model)
        try:
            out, _ = fused.run(model)
        finally:
            unpatch(model)
    assert bfloat16_mismatch(out, ref, exact) is not None, f"{mutation} went unnoticed in bfloat16"
